"""The one name -> object registry used by every kind of pluggable part (docs/concepts/architecture.md,
"One way to do a thing").

One :class:`Registry` instance per kind, owned by the module that defines the kind (advantage estimators in
``algorithms/advantage.py``, policy losses in ``algorithms/losses.py``, rollout backends in ``rollout/base.py``,
drivers, training engines, tools, rewards ...). Every registry behaves the same way:

- ``@registry.register("name", **meta)`` adds a function or class and returns it unchanged; ``meta`` is free-form
  metadata the kind defines (an estimator declares ``needs_values=True``, a rollout ``uses_hybrid_engine=True``),
  read with :meth:`Registry.meta` (:meth:`Registry.declared` where an unknown name reads as a default), so that no
  code decides on a name string outside the registry.
- ``get(name)`` returns the entry or raises :class:`UnknownNameError`, whose message lists the known names and
  the nearest one ("did you mean ...").
- Registering a *different* object under a taken name raises ``ValueError``; registering the same one again is a
  no-op (modules may be imported twice, e.g. by ``trainer.plugins`` on the driver and in a worker).
- Configuration travels with the registration: ``config=SomeDataclass`` (metadata :data:`CONFIG`) adds the
  dataclass's fields (keys, defaults, the comment on each) to the kind's config section (the registry's
  ``config_section``, or the entry's own ``config_section=`` metadata; a tuple of sections adds them to each, as
  a training engine's sub-section joins every role that may run it), and ``config_checks=fn`` (:data:`CHECKS`,
  ``fn(get) -> list[str]``) validates them at load; :mod:`hybridflow.config.assemble` builds the run's schema from
  every registry's entries, so a plugin's keys are validated like the built-in ones. A field whose type is a
  dataclass adds a sub-section (``fsdp_config: FSDPConfig``).
- ``registry.register_lazy("name", "package.module:Attribute", **meta)`` registers an entry whose object is imported
  at its first :meth:`Registry.get`: its metadata (config, checks, abilities) is known without importing the
  module that defines it (a training engine's torch/Ray code).

This module imports nothing from hybridflow, so every layer may use it. User code registers into these
registries from its own module, listed in ``trainer.plugins`` so the workers import it too.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from typing import Any, Callable, Generic, Iterable, Iterator, Optional, TypeVar, Union

from hybridflow.errors import UserError

T = TypeVar("T")

CONFIG = "config"  # metadata key: a dataclass whose fields join the entry's config section
CHECKS = "config_checks"  # metadata key: checks(get) -> list[str] of the entry's keys, run at config load
SECTION = "config_section"  # metadata key: the dotted section(s) an entry's config joins (default: the registry's)


class UnknownNameError(UserError, KeyError, ValueError):
    """A registry (or a fixed table such as the KL estimators) was asked for a name it does not know.

    A :class:`~hybridflow.errors.UserError` (the CLI prints it as one line), a ``KeyError`` (it is a failed lookup)
    and a ``ValueError`` (it is a bad config value), so any of those ``except`` clauses catches it.
    ``str(err)`` is the plain message.
    """

    def __str__(self) -> str:  # KeyError would wrap the message in quotes
        return str(self.args[0]) if self.args else ""


def unknown_name_error(kind: str, name: object, known: Iterable[str],
                       missing: Optional[str] = None) -> UnknownNameError:
    """The error for an unknown ``name`` of ``kind``: lists the ``known`` names and the closest one, if any.

    ``missing`` replaces the default opening ``"unknown {kind} {name!r}"`` (a format string with the fields
    ``kind`` and ``name``), for a kind whose lookup key reads better in other words ("no reward registered for
    data_source 'x'").
    """
    known = sorted(known)
    opening = (missing or "unknown {kind} {name!r}").format(kind=kind, name=name)
    message = f"{opening}; known: {', '.join(known) or '(none)'}"
    close = difflib.get_close_matches(str(name), known, n=1, cutoff=0.6) if isinstance(name, str) else []
    if close:
        message += f" (did you mean {close[0]!r}?)"
    return UnknownNameError(message)


class Registry(Generic[T]):
    """Maps names to objects (functions or classes) of one kind, each with optional metadata.

    Args:
        kind: what the entries are, used in messages ("policy loss", "rollout backend").
        adapter: optional ``adapter(name, obj) -> callable``; ``get`` then returns the adapted entry (gives every
            entry of a kind one calling convention while the function keeps its natural signature).
        check: optional ``check(name, obj)`` run at registration; it raises ``TypeError`` for an object that is
            not of this kind (e.g. a class that does not subclass the kind's base class).
        missing: optional opening of the unknown-name message (see :func:`unknown_name_error`).
        config_section: the dotted config section (``"actor_rollout_ref.actor"``), or a tuple of them, that the
            ``config=`` dataclass of an entry extends, unless the entry gives its own ``config_section=``; None:
            entries must give it.
    """

    def __init__(self, kind: str, adapter: Optional[Callable[[str, T], Any]] = None,
                 check: Optional[Callable[[str, T], None]] = None, missing: Optional[str] = None,
                 config_section: Union[str, tuple[str, ...], None] = None) -> None:
        self.kind = kind
        self.config_section = config_section
        self._adapter = adapter
        self._check = check
        self._missing = missing
        self._originals: dict[str, T] = {}
        self._entries: dict[str, Any] = {}
        self._meta: dict[str, dict[str, Any]] = {}  # every entry, resolved or lazy
        self._lazy: dict[str, str] = {}  # name -> "module:attribute" of an entry not imported yet

    def register(self, name: str, **meta: Any) -> Callable[[T], T]:
        """Decorator adding the decorated object under ``name`` with metadata ``meta``.

        Raises:
            ValueError: ``name`` is empty or not a string, or already registered to a different object (or lazily
                to another ``module:attribute``).
            TypeError: the kind's ``check`` refused the object, or the ``config``/``config_checks``/
                ``config_section`` metadata is malformed (see :meth:`_check_config_meta`).
        """
        self._check_name(name)
        self._check_config_meta(name, meta)

        def decorator(obj: T) -> T:
            existing = self._originals.get(name)
            known = _target(existing) if existing is not None else self._lazy.get(name)
            if known is not None and existing is not obj and known != _target(obj):
                raise ValueError(f"{self.kind} {name!r} is already registered to {known}; choose another name")
            self._add(name, obj)
            self._meta[name] = dict(meta)
            self._lazy.pop(name, None)
            return obj

        return decorator

    def register_lazy(self, name: str, target: str, **meta: Any) -> None:
        """Register ``name`` as ``target`` (``"package.module:Attribute"``), imported at the first :meth:`get` (or
        :meth:`original`); ``meta`` is known at once (:meth:`meta`, :meth:`names`, the config it brings), so
        code that only reads metadata never imports the module. The kind's ``check`` runs at that import.

        Raises:
            ValueError: ``name`` is empty or not a string, ``target`` is not ``module:attribute``, or ``name`` is
                already registered to another object or target.
            TypeError: malformed ``config`` metadata (see :meth:`_check_config_meta`).
        """
        self._check_name(name)
        if not isinstance(target, str) or target.count(":") != 1 or not all(target.split(":")):
            raise ValueError(f"{self.kind} {name!r}: the lazy target must be 'module:attribute', got {target!r}")
        self._check_config_meta(name, meta)
        known = self._lazy.get(name) or (_target(self._originals[name]) if name in self._originals else None)
        if known is not None and known != target:
            raise ValueError(f"{self.kind} {name!r} is already registered to {known}; choose another name")
        if name not in self._originals:
            self._lazy[name] = target
        self._meta[name] = dict(meta)

    def _check_name(self, name: object) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")

    def _add(self, name: str, obj: T) -> None:
        """Store ``obj`` (checked by the kind's ``check``) and its adapted entry under ``name``."""
        if self._check is not None:
            self._check(name, obj)
        self._originals[name] = obj
        self._entries[name] = self._adapter(name, obj) if self._adapter else obj

    def _resolve(self, name: str) -> None:
        """Import the lazy entry ``name`` (its module and attribute) and store it."""
        module, attribute = self._lazy[name].split(":")
        obj = getattr(importlib.import_module(module), attribute)
        self._add(name, obj)
        del self._lazy[name]

    def _check_config_meta(self, name: str, meta: dict[str, Any]) -> None:
        """The config metadata of entry ``name``: ``config`` a dataclass type whose every field has a default,
        ``config_checks`` callable, a section or a non-empty tuple of sections (the entry's or the registry's) for
        a ``config``.

        Raises:
            TypeError: one of them is not so.
        """
        config, checks = meta.get(CONFIG), meta.get(CHECKS)
        where = f"{self.kind} {name!r}"
        if config is not None:
            if not (isinstance(config, type) and dataclasses.is_dataclass(config)):
                raise TypeError(f"{where}: config= must be a dataclass type, got {config!r}")
            missing = [f.name for f in dataclasses.fields(config)
                       if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
            if missing:
                raise TypeError(f"{where}: every field of config={config.__name__} needs a default (the value a "
                                f"config that does not set it gets); none for {', '.join(missing)}")
            section = meta.get(SECTION, self.config_section)
            sections = section if isinstance(section, tuple) else (section,)
            if not sections or not all(isinstance(s, str) for s in sections):
                raise TypeError(f"{where}: config= needs config_section= (the dotted section its keys join, or a "
                                f"tuple of them), got {section!r}")
        if checks is not None and not callable(checks):
            raise TypeError(f"{where}: config_checks= must be callable as checks(get) -> list[str], got {checks!r}")

    def config_entries(self) -> list[tuple[str, str, type]]:
        """``(name, dotted section, dataclass)`` of every entry that declares a ``config``, by name, once per
        section it joins (lazy entries too: nothing is imported)."""
        out = []
        for n in self.names():
            if self._meta[n].get(CONFIG) is not None:
                section = self._meta[n].get(SECTION, self.config_section)
                out += [(n, s, self._meta[n][CONFIG]) for s in (section if isinstance(section, tuple) else (section,))]
        return out

    def config_checks(self) -> list[tuple[str, Callable[[Callable[[str], Any]], list[str]]]]:
        """``(name, checks)`` of every entry that declares ``config_checks``, by name."""
        return [(n, self._meta[n][CHECKS]) for n in self.names() if self._meta[n].get(CHECKS) is not None]

    def get(self, name: str) -> Any:
        """The entry registered under ``name``.

        A lazy entry (:meth:`register_lazy`) is imported here the first time.

        Raises:
            UnknownNameError: ``name`` is not registered (the message lists the known names and the nearest).
            ImportError, TypeError: a lazy entry's module does not import, or the kind's ``check`` refuses it.
        """
        self._known(name)
        if name in self._lazy:
            self._resolve(name)
        return self._entries[name]

    def _known(self, name: Any) -> None:
        """Raises :class:`UnknownNameError` unless ``name`` is registered (resolved or lazy); imports nothing."""
        try:
            if name in self._meta:
                return
        except TypeError:  # unhashable name
            pass
        raise unknown_name_error(self.kind, name, self._meta, self._missing)

    def original(self, name: str) -> T:
        """The object as registered (before the adapter), raising like :meth:`get`."""
        self.get(name)
        return self._originals[name]

    def meta(self, name: str, key: Optional[str] = None, default: Any = None) -> Any:
        """The metadata of ``name`` (a copy of the dict), or one ``key`` of it (``default`` when unset).

        Raises:
            UnknownNameError: ``name`` is not registered.
        """
        self._known(name)
        if key is None:
            return dict(self._meta[name])
        return self._meta[name].get(key, default)

    def declared(self, name: Any, key: str, default: Any = None) -> Any:
        """Metadata ``key`` of ``name`` as its entry declares it; ``default`` when unset or when no entry is named
        ``name`` (for checks that run next to the name check, which reports the unknown name). Raises nothing."""
        try:
            return self.meta(name, key, default)
        except UnknownNameError:
            return default

    def unregister(self, name: str) -> T:
        """Remove ``name`` and return the object registered under it (tests clean up what they registered).

        Raises:
            UnknownNameError: ``name`` is not registered.
        """
        obj = self.original(name)
        del self._originals[name], self._entries[name], self._meta[name]
        return obj

    pop = unregister  # the dict spelling, for code that treated a registry as a dict

    def names(self, **where: Any) -> list[str]:
        """Registered names, sorted; with ``where`` only those whose metadata has each given value."""
        return sorted(n for n in self._meta if all(self._meta[n].get(k) == v for k, v in where.items()))

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._meta

    def __len__(self) -> int:
        return len(self._meta)


def _qualname(obj: object) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _target(obj: object) -> str:
    """``obj`` as a lazy target, ``module:qualname``."""
    return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', repr(obj))}"

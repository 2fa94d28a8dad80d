"""The run's config schema, assembled from the central sections (:mod:`hybridflow.config.schema`) and the config
dataclasses the registry entries bring (``config=`` metadata, :mod:`hybridflow.registry`).

Each section that an entry extends becomes a dataclass derived from its central class with the entry's fields
appended (``actor_rollout_ref.actor`` gains ``aipo_rho`` from the ``aipo`` policy loss, the root gains
``async_training`` from the ``async`` driver; an entry may extend several sections: the ``fsdp2`` training engine
adds its ``fsdp_config`` sub-section to the actor and the critic, ``megatron`` its ``megatron`` sub-section to the
actor, the reference and the critic), so the keys a user writes are those of verl however the schema is
built, an unknown key is still refused with the nearest valid one, and a plugin's keys (its module imported through
``trainer.plugins`` before the schema is built) are validated like the built-in ones. Every registered entry
contributes, whichever one a config selects: a key exists as long as its entry is registered.

The derived classes subclass the central ones (``isinstance(section, ActorConfig)`` holds) and record where each
added field was declared in ``__field_origins__`` (field name -> the dataclass that declared it), which the
generated config reference reads for the key's comment. Their objects pickle by reference to those classes (plain
``pickle`` too): the receiving process rebuilds an equal class.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import typing
from typing import Any, Callable

from hybridflow.config.schema import HybridFlowConfig
from hybridflow.errors import UserError
from hybridflow.registry import Registry

__all__ = ["REGISTRIES", "assembled_schema", "central_class", "entry_checks", "field_origin", "registries",
           "section_class"]

#: (module, attribute) of every registry whose entries may bring config: a Registry, or a function returning one.
#: The training engines' registry imports neither torch nor Ray: the built-in engines register lazily from light
#: modules (hybridflow/training/fsdp2_config.py, megatron_config.py), the engine classes are imported when built.
REGISTRIES: tuple[tuple[str, str], ...] = (
    ("hybridflow.algorithms", "POLICY_LOSSES"),
    ("hybridflow.algorithms", "ADV_ESTIMATORS"),
    ("hybridflow.trainer.driver", "driver_registry"),
    ("hybridflow.rollout", "ROLLOUTS"),
    ("hybridflow.tools", "TOOLS"),
    ("hybridflow.training", "ENGINES"),
)

Get = Callable[[str], Any]


def registries() -> list[Registry]:
    """The registries of :data:`REGISTRIES`, with their built-in entries registered (their modules imported)."""
    out = []
    for module, attribute in REGISTRIES:
        found = getattr(importlib.import_module(module), attribute)
        out.append(found if isinstance(found, Registry) else found())
    return out


def _extensions() -> dict[str, list[tuple[str, type]]]:
    """Dotted section -> ``[(owner, dataclass)]``: the config each entry brings, its owner as "kind 'name'"."""
    out: dict[str, list[tuple[str, type]]] = {}
    for registry in registries():
        for name, section, config in registry.config_entries():
            out.setdefault(section, []).append((f"{registry.kind} {name!r}", config))
    return out


def assembled_schema() -> type:
    """The root dataclass of the run's schema: :class:`HybridFlowConfig` with every registered entry's config.

    Built once per set of registered configs (a plugin registering more builds a new one).

    Raises:
        UserError: an entry's config declares a key its section already has with another type or default (from
            the central schema or another entry), or extends a section the schema does not have.
    """
    extensions = _extensions()
    signature = tuple(sorted((s, owner, id(c)) for s, pairs in extensions.items() for owner, c in pairs))
    cached = _CACHE.get(signature)
    if cached is None:
        sections = _sections(HybridFlowConfig)
        unknown = sorted(s for s in extensions if s not in sections)
        if unknown:
            owners = "; ".join(f"{owner} extends {s!r}" for s in unknown for owner, _ in extensions[s])
            raise UserError(f"config of a registry entry names a section the schema does not have: {owners}; "
                            f"sections: {', '.join(s or '(root)' for s in sections)}")
        cached = _CACHE[signature] = _extend(HybridFlowConfig, "", extensions)
    return cached


_CACHE: dict[tuple, type] = {}


def _sections(cls: type, prefix: str = "") -> list[str]:
    """Every dotted section of the central schema, the root as ``""``."""
    out = [prefix[:-1]]
    for name, hint in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(hint):
            out += _sections(hint, f"{prefix}{name}.")
    return out


def _rebuild(cls: type, default: Any) -> Any:
    """A ``cls`` object (an assembled section class) holding the values of ``default`` (an object of its central
    base class), the nested sections rebuilt the same way where their class was assembled too."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(default):
        value = getattr(default, f.name)
        if dataclasses.is_dataclass(value) and hints[f.name] is not type(value):
            value = _rebuild(hints[f.name], value)
        values[f.name] = copy.deepcopy(value) if isinstance(value, (list, dict)) else value
    return cls(**values)


def _section_factory(sub: type, central: dataclasses.Field, hint: type) -> Callable[[], Any]:
    """The default factory of an assembled section ``sub``: the central field's default (``hint()`` when it has
    none) rebuilt as a ``sub`` object."""
    def factory() -> Any:
        default = central.default_factory() if central.default_factory is not dataclasses.MISSING else hint()
        return _rebuild(sub, default)

    return factory


def _extend(cls: type, prefix: str, extensions: dict[str, list[tuple[str, type]]]) -> type:
    """``cls`` (the section at ``prefix``) with its own extensions and those below it; ``cls`` itself if none."""
    section = prefix[:-1]
    if not any(s == section or s.startswith(prefix) for s in extensions):
        return cls
    hints = typing.get_type_hints(cls)
    fields: list[tuple[str, Any, Any]] = []
    origins: dict[str, type] = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if not dataclasses.is_dataclass(hint):
            continue
        sub = _extend(hint, f"{prefix}{f.name}.", extensions)
        if sub is not hint:
            fields.append((f.name, sub, dataclasses.field(default_factory=_section_factory(sub, f, hint))))
    added: dict[str, tuple[str, type, dataclasses.Field]] = {}
    for owner, config in extensions.get(section, []):
        for f in dataclasses.fields(config):
            _check_new_key(f"{prefix}{f.name}", owner, config, f, hints, added)
            if f.name not in added:
                added[f.name] = (owner, config, f)
                hint = typing.get_type_hints(config)[f.name]
                fields.append((f.name, hint, _copy_field(f)))
                origins[f.name] = config
    if not fields:
        return cls
    namespace = {"__module__": __name__, "__doc__": cls.__doc__, "__field_origins__": origins,
                 "__reduce__": _reduce_section}
    return dataclasses.make_dataclass(cls.__name__, fields, bases=(cls,), namespace=namespace)


def central_class(cls: type) -> type:
    """The central (or entry-declared) dataclass an assembled section class derives from; ``cls`` when it is one."""
    return next(c for c in cls.__mro__ if c.__module__ != __name__)


def _reduce_section(obj: Any) -> tuple:
    """Pickle an assembled section object by reference only: its central class, the added fields' origins and its
    values; the receiving process rebuilds an equal class (:func:`_restore`), so plain ``pickle`` works too."""
    cls = type(obj)
    extras: dict[str, type] = {}
    for klass in reversed(cls.__mro__):
        extras.update(klass.__dict__.get("__field_origins__", {}))
    values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    return _restore, (central_class(cls), tuple(sorted(extras.items())), values)


def _restore(base: type, extras: tuple[tuple[str, type], ...], values: dict[str, Any]) -> Any:
    return (_restored_class(base, extras) if extras else base)(**values)


@functools.cache
def _restored_class(base: type, extras: tuple[tuple[str, type], ...]) -> type:
    """``base`` with the fields ``extras`` (name, the dataclass that declares it) appended."""
    fields = []
    for name, origin in extras:
        declared = next(f for f in dataclasses.fields(origin) if f.name == name)
        fields.append((name, typing.get_type_hints(origin)[name], _copy_field(declared)))
    namespace = {"__module__": __name__, "__doc__": base.__doc__, "__field_origins__": dict(extras),
                 "__reduce__": _reduce_section}
    return dataclasses.make_dataclass(base.__name__, fields, bases=(base,), namespace=namespace)


def _copy_field(f: dataclasses.Field) -> dataclasses.Field:
    if f.default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=f.default_factory)
    return dataclasses.field(default=f.default)


def _check_new_key(key: str, owner: str, config: type, f: dataclasses.Field, hints: dict[str, Any],
                   added: dict[str, tuple[str, type, dataclasses.Field]]) -> None:
    """A key an entry adds must be new to its section, or declared by another entry with the same type and default
    (two losses sharing a knob).

    Raises:
        UserError: the central section has the key, or another entry declared it differently.
    """
    if f.name in hints:
        raise UserError(f"{owner}: its config {config.__name__} declares {key}, a key the schema already has; "
                        "rename the field")
    if f.name in added:
        other_owner, other, g = added[f.name]
        same_type = typing.get_type_hints(other)[f.name] == typing.get_type_hints(config)[f.name]
        if not (same_type and g.default == f.default and g.default_factory == f.default_factory):
            raise UserError(f"{owner} and {other_owner} both declare {key} with different types or defaults; "
                            "rename one")


def section_class(path: str) -> type:
    """The assembled dataclass of the dotted section ``path`` (``"actor_rollout_ref.actor"``; ``""``: the root): its
    objects have every registered entry's keys with their defaults (build test or tool configs with it).

    Raises:
        KeyError: no such section.
    """
    cls = assembled_schema()
    for part in filter(None, path.split(".")):
        hint = typing.get_type_hints(cls).get(part)
        if not dataclasses.is_dataclass(hint):
            raise KeyError(f"no config section {path!r}")
        cls = hint
    return cls


def field_origin(cls: type, name: str) -> type:
    """The dataclass whose source declares field ``name`` of ``cls`` (an assembled or central section class)."""
    for klass in cls.__mro__:
        origin = klass.__dict__.get("__field_origins__", {}).get(name)
        if origin is not None:
            return origin
        if klass.__module__ != __name__ and name in klass.__dict__.get("__annotations__", {}):
            return klass
    raise KeyError(f"{cls.__name__} has no field {name!r}")


def entry_checks() -> list[tuple[str, Callable[[Get], list[str]]]]:
    """``(owner, checks)`` for every registered entry that declares ``config_checks``; each is run at load."""
    return [(f"{registry.kind} {name!r}", fn) for registry in registries() for name, fn in registry.config_checks()]

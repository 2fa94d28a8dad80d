"""A name -> function registry, one instance per kind (advantage estimators, policy losses).

Each kind lives in its own module (``advantage.py`` owns the advantage-estimator registry,
``losses.py`` the policy-loss registry); this module only holds the shared machinery so that every
registry behaves the same way: a decorator to add a function, a lookup whose error lists the known
names, and a refusal to silently replace a registered function with a different one.
"""

from __future__ import annotations

from typing import Callable, Generic, Optional, TypeVar

F = TypeVar("F", bound=Callable)


class UnknownNameError(KeyError, ValueError):
    """A registry (or a fixed table such as the KL estimators) was asked for a name it does not know.

    Subclasses both ``KeyError`` (it is a failed lookup) and ``ValueError`` (it is a bad config
    value), so either ``except`` clause catches it. ``str(err)`` is the plain message.
    """

    def __str__(self) -> str:  # KeyError would wrap the message in quotes
        return str(self.args[0]) if self.args else ""


def unknown_name_error(kind: str, name: object, known: list[str]) -> UnknownNameError:
    """Build the error for an unknown ``name`` of ``kind``, listing the ``known`` names."""
    return UnknownNameError(f"unknown {kind} {name!r}; known: {', '.join(sorted(known)) or '(none)'}")


class Registry(Generic[F]):
    """Maps names to functions of one kind.

    ``register(name)`` is a decorator; it returns the decorated function unchanged and stores
    ``adapter(fn)`` when the registry was built with an adapter (used to give every entry of a
    kind one calling convention while the function keeps its natural signature). ``get(name)``
    returns the stored callable or raises :class:`UnknownNameError` listing the known names.
    Registering a *different* function under a taken name raises ``ValueError``; registering the
    same function again is a no-op.
    """

    def __init__(self, kind: str, adapter: Optional[Callable[[str, F], Callable]] = None) -> None:
        self.kind = kind
        self._adapter = adapter
        self._originals: dict[str, F] = {}
        self._entries: dict[str, Callable] = {}

    def register(self, name: str) -> Callable[[F], F]:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")

        def decorator(fn: F) -> F:
            existing = self._originals.get(name)
            if existing is not None and existing is not fn:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered to "
                    f"{existing.__module__}.{existing.__qualname__}; choose another name"
                )
            self._originals[name] = fn
            self._entries[name] = self._adapter(name, fn) if self._adapter else fn
            return fn

        return decorator

    def get(self, name: str) -> Callable:
        try:
            return self._entries[name]
        except (KeyError, TypeError):  # TypeError: unhashable name
            raise unknown_name_error(self.kind, name, list(self._entries)) from None

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._entries

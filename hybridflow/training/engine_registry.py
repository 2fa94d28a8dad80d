"""The training-engine registry, without the engines: ``ENGINES``, :func:`register_engine` and the lookups.

Importing it imports neither torch nor Ray, so the config loader and the auto-mapper read what each engine declares
(its config sub-section and checks, the layout section, what the mapper may plan for it) without building one. The
built-in engines register lazily from their light modules (:mod:`hybridflow.training.fsdp2_config`,
:mod:`hybridflow.training.megatron_config`): the class is imported by the first :func:`get_engine_class`.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from hybridflow.registry import Registry

__all__ = ["ENGINES", "ENGINE_SECTIONS", "get_engine_class", "register_engine", "registered_engines"]

#: the role sections an engine's ``config=`` joins unless its registration names others (``config_section=``): the
#: roles whose workers build their engine from their own section (the actor, whose process also runs the reference,
#: and the critic)
ENGINE_SECTIONS = ("actor_rollout_ref.actor", "critic")


def _check_engine(name: str, cls: object) -> None:
    # a TrainEngine subclass exists only once its base module is imported; reading it from sys.modules keeps this
    # module free of torch and base.py (which imports this registry) free of an import cycle
    base = sys.modules.get("hybridflow.training.base")
    if base is None or not (isinstance(cls, type) and issubclass(cls, base.TrainEngine)):
        raise TypeError(f"register_engine({name!r}) expects a TrainEngine subclass, got {cls!r}")


ENGINES: Registry[type] = Registry("training engine", check=_check_engine,
                               config_section=ENGINE_SECTIONS)


def register_engine(name: str, **meta: Any) -> Callable[[type], type]:
    """Class decorator registering a :class:`~hybridflow.training.base.TrainEngine` subclass under ``name`` (the
    ``strategy`` value).

    Metadata (so no code decides on an engine's name):

    * ``config=`` a dataclass whose fields join each role section of ``config_section=`` (default
      :data:`ENGINE_SECTIONS`); a field typed by a dataclass is a sub-section (fsdp2: ``fsdp_config``, megatron:
      ``megatron``), validated at load like the built-in keys; ``config_checks=fn(get) -> list[str]`` checks them;
    * ``layout_section``: the sub-section holding the role's (tp, pp, ep) layout (megatron: ``"megatron"``);
    * ``requires_package`` and ``install_hint``: a config naming the engine without that package is refused at load;
    * ``sequence_parallel``, ``router_replay``, ``process_wide_state``: what the config checks and the trainer read;
    * ``abilities``: a dict of plain values the auto-mapper plans within (``max_pp``, ``max_gen_pp``, ``tp_roles``,
      ``pp_roles``, ``sp_roles``, ``ep_roles``, ``reference_with_actor``; :mod:`hybridflow.mapping.abilities`).

    Raises:
        TypeError: the class is not a TrainEngine subclass, or the config metadata is malformed.
        ValueError: ``name`` is taken by another class.
    """
    return ENGINES.register(name, **meta)


def get_engine_class(name: str) -> type:
    """The :class:`~hybridflow.training.base.TrainEngine` subclass registered under ``name`` (a built-in one is
    imported here, with torch and its parallel code).

    Raises:
        hybridflow.registry.UnknownNameError: unknown name (the message lists the registered engines).
    """
    return ENGINES.get(name)


def registered_engines() -> list[str]:
    """Sorted names of the registered engines."""
    return ENGINES.names()

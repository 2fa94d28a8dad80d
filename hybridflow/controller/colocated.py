"""Several worker classes colocated in one process per rank (verl's ``create_colocated_worker_cls``).

Worker groups on one resource pool may each run their own actor per bundle (``RayWorkerGroup``), or share one:
:func:`create_colocated` starts a single Ray actor per bundle that holds one instance of every class (constructed
in the order given, after the rank's environment is applied, as ``RayWorkerGroup`` does for one class) and returns
one group view per class (:class:`ColocatedWorkerGroup`). On the actor, method ``m`` of the instance named ``name``
is ``f"{name}__{m}"``; a view binds its class's registered methods to those names, so ``view.m(...)`` dispatches and
collects exactly as a ``RayWorkerGroup`` of that class would, and errors name the view (``name``) and the rank.

What changes with colocation:

* one process per rank instead of one per class: the imports and the interpreter are paid once, and the instances
  share the process's globals (its ``torch.distributed`` default group, its RNG, its environment);
* the calls of all views reach an actor one after the other, in the order the driver submitted them (a Ray actor
  runs one call at a time, in submission order, for every caller). A call may depend on an earlier call of
  another view (``submit_after``, a future as argument): it was submitted first, so it runs first. A class whose
  ``ray_actor_options`` asks for ``max_concurrency > 1`` (methods that run alongside others in threads) cannot be
  colocated (:func:`can_colocate`);
* the actor takes ``fraction`` of each bundle (default all of it), not ``1 / max_colocate_count`` per class;
* the process title is ``ray::<Class1>_<Class2>...``, so ``ps`` shows what runs where;
* killing one view's actors (``shutdown``, or a process dying) ends every colocated view.

This module knows nothing about RL.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Optional, Sequence

import ray

from hybridflow.controller.decorator import get_registered_methods
from hybridflow.controller.resource_pool import ResourcePool
from hybridflow.controller.unread import forget
from hybridflow.controller.worker_group import (
    ActorSet,
    RayClassWithInitArgs,
    RayWorkerGroup,
    _WorkerGroupBase,
    apply_env,
    placements_of,
    share_of,
)

logger = logging.getLogger(__name__)

__all__ = ["ColocatedWorkerGroup", "can_colocate", "colocated_class", "create_colocated", "create_groups"]

#: between a colocated instance's name and its method's name on the shared actor
SEPARATOR = "__"

#: the ``Worker`` methods a group calls by name besides the registered ones
_GROUP_METHODS = ("_query_dispatch_info", "get_master_addr_port")


def can_colocate(cls: type) -> bool:
    """Whether ``cls`` may share its process with other worker classes: not when its ``ray_actor_options`` ask for
    ``max_concurrency > 1`` (its methods run in threads alongside other calls, which colocated classes would then
    do too)."""
    return int(getattr(cls, "ray_actor_options", {}).get("max_concurrency", 1)) <= 1


def _exposed_methods(cls: type) -> list[str]:
    """The methods of ``cls`` reachable on a colocated actor: the registered ones, its public functions and the
    ones a group calls by name (:data:`_GROUP_METHODS`)."""
    names = set(get_registered_methods(cls)) | set(_GROUP_METHODS)
    names |= {n for n in dir(cls) if not n.startswith("_") and inspect.isfunction(getattr(cls, n, None))}
    return sorted(names)


def _forward(name: str, method: str) -> Any:
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._hf_instances[name], method)(*args, **kwargs)

    call.__name__ = call.__qualname__ = f"{name}{SEPARATOR}{method}"
    return call


def _construct(self: Any, hf_env: dict[str, Optional[str]], inits: Sequence[tuple[tuple, dict]]) -> None:
    """The colocated actor's ``__init__``: apply ``hf_env`` (``None`` unsets), then construct each class in order.
    An exception of a constructor propagates with a note naming the instance."""
    apply_env(hf_env)
    self._hf_instances = {}
    for (name, cls), (args, kwargs) in zip(type(self)._hf_classes, inits):
        try:
            self._hf_instances[name] = cls(*args, **kwargs)
        except Exception as err:
            err.add_note(f"(constructing {cls.__name__} as {name!r} in a colocated worker process)")
            raise


def _master_addr_port(self: Any) -> tuple[str, int]:
    """``(MASTER_ADDR, MASTER_PORT)`` of this rank's process, which every colocated instance shares."""
    first = next(iter(self._hf_instances.values()))
    return first.get_master_addr_port()


def _set_master_addr_port(self: Any, addr: str, port: int) -> None:
    """Set the process's ``MASTER_ADDR``/``MASTER_PORT`` (the environment every colocated instance shares)."""
    next(iter(self._hf_instances.values())).set_master_addr_port(addr, port)


def colocated_class(classes: dict[str, type]) -> type:
    """A class holding one instance of each of ``classes`` (name -> ``Worker`` subclass, in construction order),
    named ``<Class1>_<Class2>...`` (Ray's process title shows it). Its ``__init__(hf_env, inits)`` applies the
    environment ``hf_env`` and constructs the instances (``inits``: ``(args, kwargs)`` per class, in order); method
    ``m`` of instance ``name`` is ``f"{name}__{m}"``; ``get_master_addr_port`` and ``set_master_addr_port`` are the
    process's.

    Raises:
        ValueError: no class, a name that is not an identifier or contains ``__``, or a class that
            :func:`can_colocate` rejects.
    """
    if not classes:
        raise ValueError("colocated_class needs at least one class")
    for name, cls in classes.items():
        if not name.isidentifier() or SEPARATOR in name:
            raise ValueError(f"colocated name {name!r} must be an identifier without {SEPARATOR!r}")
        if not can_colocate(cls):
            raise ValueError(
                f"{cls.__name__} ({name!r}) cannot be colocated: its ray_actor_options ask for max_concurrency="
                f"{cls.ray_actor_options['max_concurrency']} (methods running alongside other calls); give it a "
                "worker group of its own")
    attrs: dict[str, Any] = {"__init__": _construct, "get_master_addr_port": _master_addr_port,
                             "set_master_addr_port": _set_master_addr_port,
                             "_hf_classes": tuple(classes.items()),
                             "__doc__": "Colocated: " + ", ".join(f"{n} ({c.__name__})" for n, c in classes.items())}
    for name, cls in classes.items():
        for method in _exposed_methods(cls):
            attrs[f"{name}{SEPARATOR}{method}"] = _forward(name, method)
    return type("_".join(cls.__name__ for cls in classes.values()), (), attrs)


def _merged_options(classes: dict[str, type]) -> dict[str, Any]:
    """The union of the classes' ``ray_actor_options``.

    Raises:
        ValueError: two classes ask for different values of one option."""
    merged: dict[str, Any] = {}
    for cls in classes.values():
        for key, value in getattr(cls, "ray_actor_options", {}).items():
            if key in merged and merged[key] != value:
                raise ValueError(f"colocated classes disagree on the Ray actor option {key!r}: {merged[key]!r} and "
                                 f"{value!r} ({cls.__name__})")
            merged[key] = value
    return merged


class ColocatedWorkerGroup(_WorkerGroupBase):
    """One class's view of a colocated actor set: its registered methods bound as on a ``RayWorkerGroup``, called
    on the shared actors under its prefix. ``name`` is the instance's name (errors name it and the rank);
    ``colocated_with`` lists the views sharing its processes. Built by :func:`create_colocated`.

    Raises (from the constructor): like ``RayWorkerGroup``'s binding (``ValueError``, ``KeyError``)."""

    def __init__(self, name: str, cls: type, actors: ActorSet, colocated_with: Sequence[str],
                 pool: Optional[ResourcePool] = None) -> None:
        super().__init__(name, actors.workers, {}, pool)
        self._cls, self._actors, self.colocated_with = cls, actors, tuple(colocated_with)
        for method_name, spec in get_registered_methods(cls).items():
            self._bind(method_name, self._remote_name(method_name), spec, getattr(cls, method_name).__doc__)

    def _remote_name(self, method_name: str) -> str:
        return f"{self._name}{SEPARATOR}{method_name}"

    def shutdown(self) -> None:
        """Kill the shared actors (every colocated view's) and forget the views' calls nobody read; safe to call
        twice, and from every view."""
        self._actors.shutdown()
        forget([self._name, *self.colocated_with])


def create_colocated(resource_pool: ResourcePool, classes: dict[str, RayClassWithInitArgs],
                     env: Optional[dict[str, str]] = None, fraction: float = 1.0,
                     _start: bool = True) -> dict[str, ColocatedWorkerGroup]:
    """One Ray actor per bundle of ``resource_pool`` holding an instance of each of ``classes`` (name -> class and
    constructor arguments, constructed in this order); returns a view per name, in the same order.

    Args:
        env: extra environment every rank has before the constructors run (as ``RayWorkerGroup``'s ``env``).
        fraction: the share of each bundle the actor takes (CPUs, and GPUs on a GPU pool); 1: the whole bundle.

    Raises:
        ValueError: see :func:`colocated_class` and :func:`_merged_options`; the pool has no placement groups;
            ``fraction`` not in ``(0, 1]``.
        TypeError: a value of ``classes`` is not a ``RayClassWithInitArgs``.
        WorkerError: a constructor failed on a rank (names the colocated set; the started actors are killed).
    """
    bad = {n: type(c).__name__ for n, c in classes.items() if not isinstance(c, RayClassWithInitArgs)}
    if bad:
        raise TypeError(f"create_colocated: classes must map names to RayClassWithInitArgs, got {bad}")
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    types = {name: init.cls for name, init in classes.items()}
    actor_cls = colocated_class(types)
    options = {**share_of(resource_pool, fraction), **_merged_options(types)}
    inits = [(init.args, init.kwargs) for init in classes.values()]
    actors = ActorSet("+".join(classes), actor_cls.__name__, ray.remote(actor_cls), placements_of(resource_pool),
                      options, (inits,), {}, resource_pool.use_gpu, env=env)
    views = {name: ColocatedWorkerGroup(name, cls, actors, [n for n in classes if n != name], resource_pool)
             for name, cls in types.items()}
    if _start:
        ActorSet.start_all([actors])
    return views


def create_groups(specs: Sequence[tuple[ResourcePool, RayClassWithInitArgs, str]],
                  env: Optional[dict[str, str]] = None, colocate: bool = True) -> list[_WorkerGroupBase]:
    """Build the groups ``(resource_pool, class and arguments, name)`` (as ``RayWorkerGroup.create_many``), with
    ``colocate`` the classes of one pool (the same ``ResourcePool`` object) in one process per rank
    (:func:`create_colocated`, in ``specs`` order), except those :func:`can_colocate` rejects, which keep their own
    actors; a colocated set takes what its pool's bundles leave to them (``1 - separate / max_colocate_count``).
    Every process starts concurrently. Returns the groups in ``specs`` order.

    Raises:
        ValueError: two specs on one pool share a name; see ``RayWorkerGroup`` and :func:`create_colocated`.
        WorkerError: a constructor failed (every started actor is killed).
    """
    shared: dict[int, list[int]] = {}  # id(pool) -> indices of its colocatable specs
    for i, (pool, init, _) in enumerate(specs):
        if colocate and can_colocate(init.cls):
            shared.setdefault(id(pool), []).append(i)
    groups: list[Optional[_WorkerGroupBase]] = [None] * len(specs)
    sets: list[ActorSet] = []
    for indices in (ix for ix in shared.values() if len(ix) > 1):
        pool = specs[indices[0]][0]
        names = [specs[i][2] for i in indices]
        if len(set(names)) < len(names):
            raise ValueError(f"colocated groups on {pool!r} need distinct names, got {names}")
        separate = sum(p is pool for p, _, _ in specs) - len(indices)
        views = create_colocated(pool, {specs[i][2]: specs[i][1] for i in indices}, env,
                                 max(1 - separate / pool.max_colocate_count, 1 / pool.max_colocate_count),
                                 _start=False)
        for i in indices:
            groups[i] = views[specs[i][2]]
        sets.append(views[names[0]]._actors)
    for i, (pool, init, name) in enumerate(specs):
        if groups[i] is None:
            if colocate and not can_colocate(init.cls):
                logger.info("%s (%s) runs in processes of its own: its ray_actor_options ask for max_concurrency > 1",
                            name, init.cls.__name__)
            group = RayWorkerGroup(pool, init, name, env=env, _start=False)
            groups[i] = group
            sets.append(group._actors)
    ActorSet.start_all(sets)
    return groups

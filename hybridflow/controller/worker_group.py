"""``RayWorkerGroup``: N Ray actors running one ``Worker`` class SPMD-style, driven from the single controller.

Building a group starts one actor per bundle of a ``ResourcePool`` (rank ``r`` in bundle ``r``), sets the
``torchrun`` environment variables in each (see ``worker.py``) and binds every ``register``-ed method of the
class onto the group object: ``wg.compute(batch)`` dispatches ``batch`` per the method's dispatch mode, runs the
method on the ranks its execute mode names, and collects the outputs. A method whose mode collects a ``DataProto``
returns a ``DataProtoFuture`` at once (read lazily: ``futures.py``; a call dropped unread reports its failure at
the next call, ``unread.py``); other modes wait and return the collected
value (``blocking=False``: a list of ``ObjectRef``). A ``DataProto`` argument holding futures (``union``-ed, not yet
read) reaches the ranks as a ``PendingBatch``: each rank fetches its chunk of the futures' outputs itself. Calls of
groups on one resource pool run one after the other (:class:`_PoolOrder`); calls on different pools run together.
Any bound method can also be started without waiting: ``wg.compute.submit(batch)`` returns its future whatever the
dispatch mode (``get()``: the collected value; ``futures.get_all`` waits for several calls together), and
``wg.compute.submit_after(previous, batch)`` starts it once an earlier call's future ``previous`` has finished, with
no driver round trip between the two (Ray holds the call until ``previous``'s outputs exist).

Roles that share memory run in one worker class (``ActorRolloutRefWorker`` holds actor, rollout and reference);
roles in separate groups share devices through their resource pool, each in its own processes, or colocated in one
process per rank (``colocated.py``: one actor per bundle holding an instance of each class, one group view per
class).
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any, Optional, Sequence

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hybridflow.controller.decorator import AFTER_PREFIX, WAIT_KEY, Execute, MethodSpec, get_registered_methods
from hybridflow.controller.dispatch import (
    Collector,
    DispatchError,
    DispatchPlan,
    MeshDispatchInfo,
    get_dispatch_mode,
)
from hybridflow.controller.futures import DataProtoFuture, PendingBatch, get_outputs
from hybridflow.protocol import DataProto
from hybridflow.controller.resource_pool import ResourcePool
from hybridflow.controller.unread import forget, raise_unread_errors, track
from hybridflow.controller.worker import MASTER_LATER, Worker

logger = logging.getLogger(__name__)

__all__ = ["ActorSet", "RayClassWithInitArgs", "RayWorkerGroup", "placements_of", "share_of"]


class RayClassWithInitArgs:
    """A ``Worker`` subclass and the arguments to construct it with in every rank.

    ``cls`` may be a plain class or one decorated with ``@ray.remote`` (unwrapped here; the group applies
    ``ray.remote`` with its own options). Raises ``TypeError`` when ``cls`` is not a ``Worker`` subclass.
    """

    def __init__(self, cls: type, *args: Any, **kwargs: Any) -> None:
        cls = getattr(cls, "__ray_actor_class__", cls)
        if not (isinstance(cls, type) and issubclass(cls, Worker)):
            raise TypeError(f"RayClassWithInitArgs needs a subclass of hybridflow.controller.Worker, got {cls!r}")
        self.cls, self.args, self.kwargs = cls, args, kwargs

    def __repr__(self) -> str:
        return f"RayClassWithInitArgs({self.cls.__name__})"


def apply_env(env: dict[str, Optional[str]]) -> None:
    """Set each variable of ``env`` in this process (a ``None`` value unsets it): a rank's environment, applied
    before its worker classes are constructed."""
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _with_env(cls: type) -> type:
    """A subclass of ``cls`` whose constructor first applies an env dict (``None`` values unset the variable),
    so the worker's ``__init__`` sees its rank variables."""

    def __init__(self: Any, hf_env: dict[str, Optional[str]], *args: Any, **kwargs: Any) -> None:
        apply_env(hf_env)
        cls.__init__(self, *args, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": __init__, "__doc__": cls.__doc__})


def _refs_of(previous: Any) -> list[ray.ObjectRef]:
    """The ``ObjectRef``s of an earlier call's future (a ``DataProtoFuture`` or a list of ``ObjectRef``s).

    Raises:
        TypeError: ``previous`` is neither."""
    if isinstance(previous, DataProtoFuture):
        return list(previous.futures)
    if isinstance(previous, (list, tuple)) and all(isinstance(r, ray.ObjectRef) for r in previous):
        return list(previous)
    raise TypeError(f"submit_after: previous must be a call's future (DataProtoFuture or list of ObjectRef), "
                    f"got {type(previous).__name__}")


def _argument(value: Any, spec: MethodSpec, mode: Any) -> Any:
    """A call's argument as its dispatch gets it: a ``DataProto`` with the method's declared columns
    (``spec.select_inputs``); one with futures unioned into it and not read yet becomes a :class:`PendingBatch`
    (its columns so far, and the futures the ranks fetch themselves) when ``mode.forwards_pending``, else it is read
    here (waiting for the futures)."""
    if isinstance(value, DataProto) and mode.forwards_pending:
        known, futures = value.split_pending()
        if futures and (known.batch or known.non_tensor_batch) and all(isinstance(f, DataProtoFuture)
                                                                       for f in futures):
            select = None if spec.batch_keys is None and spec.non_tensor_batch_keys is None else spec.select_inputs
            return PendingBatch(spec.select_inputs(known), futures, select)
    return spec.select_inputs(value)


class _PoolOrder:
    """Calls on one resource pool run one after the other: a call of a group whose processes differ from those of
    the pool's previous call first waits for that call to end, successfully or not (its ranks ``ray.wait`` on the
    call's refs, :data:`~hybridflow.controller.decorator.WAIT_KEY`); colocated groups share processes, which Ray
    already runs in submission order; calls on different pools run concurrently. Each pool holds its last call."""

    @staticmethod
    def before(pool: Optional[ResourcePool], workers: list) -> list[ray.ObjectRef]:
        """The refs a new call of the group running on ``workers`` in ``pool`` must wait for."""
        last = getattr(pool, "_hf_last_call", None)
        return [] if last is None or last[0] is workers else list(last[1])

    @staticmethod
    def record(pool: Optional[ResourcePool], workers: list, refs: list[ray.ObjectRef]) -> None:
        """``refs`` (a call of the group on ``workers``) are now ``pool``'s last call."""
        if pool is not None:
            pool._hf_last_call = (workers, list(refs))


_POOL_ORDER = _PoolOrder()


class _WorkerGroupBase:
    """Binding, dispatch and execution of a worker group's registered methods (``RayWorkerGroup`` adds the
    actors).

    ``call_timeout_s``: seconds the caller waits for one call's outputs (a blocking call, ``execute_*``, a
    returned future's ``get()``) before :class:`~hybridflow.controller.futures.CallTimeoutError` names the ranks
    that did not answer; None (default): unbounded. Settable at any time; a future keeps the value it was made with.
    """

    def __init__(self, name: str, workers: list, mesh_cache: dict[str, MeshDispatchInfo],
                 pool: Optional[ResourcePool] = None) -> None:
        self._name = name
        self._pool = pool
        self._workers = workers
        self._mesh_cache = mesh_cache
        self._remote_names: dict[str, str] = {}
        self._call_timeout_s: Optional[float] = None

    @property
    def call_timeout_s(self) -> Optional[float]:
        """Seconds a call's outputs are waited for (None: unbounded); see the class docstring."""
        return self._call_timeout_s

    @call_timeout_s.setter
    def call_timeout_s(self, value: Optional[float]) -> None:
        if value is not None and not value > 0:
            raise ValueError(f"worker group {self._name!r}: call_timeout_s must be None or > 0, got {value!r}")
        self._call_timeout_s = None if value is None else float(value)

    # ------------------------------------------------------------------ accessors
    @property
    def name(self) -> str:
        """The group's name (its name prefix)."""
        return self._name

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return len(self._workers)

    @property
    def workers(self) -> list:
        """The Ray actor handles, in rank order."""
        return list(self._workers)

    def dispatch_info(self, mesh_name: str) -> MeshDispatchInfo:
        """Per-rank ``(dp_rank, is_collect)`` of mesh ``mesh_name``, asked from the workers once and cached.

        Raises:
            WorkerError: a rank never registered the mesh (``Worker._register_dispatch_collect_info``).
            DispatchError: the layout is invalid (dp ranks with a gap, not exactly one collector per dp rank).
        """
        if mesh_name not in self._mesh_cache:
            remote = self._remote_name("_query_dispatch_info")
            refs = [getattr(w, remote).remote(mesh_name) for w in self._workers]
            infos = get_outputs(refs, range(len(refs)), self._name, "_query_dispatch_info", self._call_timeout_s)
            self._mesh_cache[mesh_name] = MeshDispatchInfo(
                mesh_name, tuple(int(d) for d, _ in infos), tuple(bool(c) for _, c in infos)
            )
        return self._mesh_cache[mesh_name]

    # ------------------------------------------------------------------ raw execution
    def _remote_name(self, method_name: str) -> str:
        """The name of ``method_name`` on the Ray actor (a colocated group's view adds its role's prefix)."""
        return method_name

    def execute_all_async(self, method_name: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        """Call ``method_name`` with the same arguments on every rank; return the ``ObjectRef``s in rank order."""
        remote = self._remote_name(method_name)
        return [getattr(w, remote).remote(*args, **kwargs) for w in self._workers]

    def execute_all(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        """``execute_all_async`` and wait: the outputs in rank order. Raises ``WorkerError`` naming the rank,
        ``CallTimeoutError`` past ``call_timeout_s``."""
        refs = self.execute_all_async(method_name, *args, **kwargs)
        return get_outputs(refs, range(len(refs)), self._name, method_name, self._call_timeout_s)

    def execute_rank_zero(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method_name`` on rank 0 only and return its output. Raises ``WorkerError``, ``CallTimeoutError``
        past ``call_timeout_s``."""
        ref = getattr(self._workers[0], self._remote_name(method_name)).remote(*args, **kwargs)
        return get_outputs([ref], [0], self._name, method_name, self._call_timeout_s)[0]

    # ------------------------------------------------------------------ registered methods
    def _bind(self, method_name: str, remote_name: str, spec: MethodSpec, doc: Optional[str]) -> None:
        if hasattr(type(self), method_name):
            raise ValueError(
                f"registered method {method_name!r} clashes with the worker group's own attribute of that name; "
                "rename the worker method"
            )
        mode = get_dispatch_mode(spec.dispatch_mode, spec.mesh_name)
        self._remote_names[method_name] = remote_name

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._call(method_name, remote_name, spec, mode, args, kwargs)

        def submit(*args: Any, **kwargs: Any) -> DataProtoFuture:
            return self._call(method_name, remote_name, spec, mode, args, kwargs, future=True)

        def submit_after(previous: Any, *args: Any, **kwargs: Any) -> DataProtoFuture:
            return self._call(method_name, remote_name, spec, mode, args, kwargs, after=_refs_of(previous),
                              future=True)

        call.__name__ = method_name
        call.__doc__ = doc
        call.submit = submit  # group.method.submit(...): start the call, return its future (any dispatch mode)
        call.submit_after = submit_after  # group.method.submit_after(future, ...): submit, once future is done
        setattr(self, method_name, call)

    def _call(self, method_name: str, remote_name: str, spec: MethodSpec, mode: Any, args: tuple, kwargs: dict,
              after: Sequence[ray.ObjectRef] = (), future: bool = False) -> Any:
        """Dispatch, run and collect one call of a registered method (see the module docstring). First the earlier
        calls whose futures were dropped unread and have finished are checked (:func:`raise_unread_errors`).

        Raises:
            WorkerError: an earlier call nobody read failed (names its group, rank and method); or, for a blocking
                call, a rank of this one failed.
            CallTimeoutError: a blocking call's ranks did not answer within ``call_timeout_s``.
            DispatchError: the arguments cannot be dispatched (e.g. batch sizes differ).
        """
        raise_unread_errors(wait=False)
        args = tuple(_argument(a, spec, mode) for a in args)  # the columns the method declares it reads
        kwargs = {k: _argument(v, spec, mode) for k, v in kwargs.items()}
        try:
            plan = mode.dispatch_fn(self, *args, **kwargs)
        except DispatchError as err:
            raise DispatchError(f"{self._name}.{method_name}(): {err}") from err
        self._check_plan(method_name, plan)
        ranks = list(range(self.world_size)) if spec.execute_mode is Execute.ALL else [0]
        counted = ranks if plan.collect_ranks is None else plan.collect_ranks
        missing = [r for r in counted if r not in ranks]
        if missing:
            raise DispatchError(
                f"{self._name}.{method_name}(): its dispatch mode collects from ranks {missing}, which do not run "
                f"under execute_mode={spec.execute_mode}"
            )
        ordering = {f"{AFTER_PREFIX}{i}": ref for i, ref in enumerate(after)}  # top-level refs: Ray waits for them
        previous = _POOL_ORDER.before(self._pool, self._workers)
        if previous:  # nested in a list, Ray does not wait for them: the ranks do (failed or not)
            ordering[WAIT_KEY] = previous
        refs = [
            getattr(self._workers[r], remote_name).remote(
                *(a[r] for a in plan.args), **{k: v[r] for k, v in plan.kwargs.items()}, **ordering
            )
            for r in ranks
        ]
        _POOL_ORDER.record(self._pool, self._workers, refs)
        padding = None if plan.padding is None else [plan.padding[r] for r in counted]
        collector = Collector(mode.collect_fn, [ranks.index(r) for r in counted], padding)
        if mode.returns_proto or future:  # a DataProto's call (or a submitted one) returns its future at once
            return DataProtoFuture(collector, refs, source=(self._name, method_name, ranks),
                                   by_rank=spec.rows_per_row, timeout_s=self._call_timeout_s,
                                   call=track(refs, ranks, self._name, method_name, self._call_timeout_s))
        if not spec.blocking:
            return [refs[ranks.index(r)] for r in counted]
        return collector(get_outputs(refs, ranks, self._name, method_name, self._call_timeout_s))

    def _check_plan(self, method_name: str, plan: DispatchPlan) -> None:
        n = self.world_size
        lengths = {f"argument {i}": len(a) for i, a in enumerate(plan.args)}
        lengths.update({f"argument {k!r}": len(v) for k, v in plan.kwargs.items()})
        if plan.padding is not None:
            lengths["padding"] = len(plan.padding)
        bad = {k: v for k, v in lengths.items() if v != n}
        if bad:
            raise DispatchError(
                f"{self._name}.{method_name}(): the dispatch function must give one value per rank "
                f"({n}), got lengths {bad}"
            )
        if plan.pad_size and plan.padding is None:
            raise DispatchError(
                f"{self._name}.{method_name}(): the dispatch function padded the batch (pad_size={plan.pad_size}) "
                "but gave no DispatchPlan.padding (per rank: chunk rows, padding rows), so the rows the padding "
                "produced cannot be removed from the outputs"
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._name!r}, world_size={self.world_size})"


def placements_of(resource_pool: ResourcePool) -> list[tuple[Any, int, int]]:
    """``(placement group, bundle index, bundles on that node)`` per rank of a group on ``resource_pool``.

    Raises:
        ValueError: the pool has no placement groups (removed)."""
    placements = [
        (pg, index, count)
        for pg, count in zip(resource_pool.placement_groups, resource_pool.process_on_nodes)
        for index in range(count)
    ]
    if not placements:
        raise ValueError(f"{resource_pool!r} has no placement groups (was it removed?)")
    return placements


class ActorSet:
    """The Ray actors behind one group (or behind several colocated groups, ``colocated.py``): one per rank,
    rank ``r`` in bundle ``r``, each constructed as ``actor_cls(env, *args, **kwargs)`` where ``env`` is the rank's
    environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, the extra ``env``, the master
    address, and ``CUDA_VISIBLE_DEVICES=""`` without GPUs). ``name`` names the set in errors and logs,
    ``label`` what runs in it (class names). ``workers`` is filled by :meth:`start_all` and shared with the group
    objects that call the actors."""

    def __init__(self, name: str, label: str, actor_cls: Any, placements: list, options: dict, args: tuple,
                 kwargs: dict, use_gpu: bool, bin_pack: bool = True, env: Optional[dict[str, str]] = None) -> None:
        self.name, self.label, self.workers = name, label, []
        self._actor_cls, self._placements, self._options = actor_cls, placements, options
        self._args, self._kwargs = args, kwargs
        self._use_gpu, self._bin_pack, self._env = use_gpu, bin_pack, dict(env or {})

    def _start_rank(self, rank: int) -> Any:
        pg, index, count = self._placements[rank]
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=index if self._bin_pack else -1
        )
        # rank 0 picks the rendezvous address; the others get it by set_master_addr_port (MASTER_LATER)
        master = {"MASTER_ADDR": None, "MASTER_PORT": None, **({MASTER_LATER: "1"} if rank else {})}
        env = {"RANK": str(rank), "WORLD_SIZE": str(len(self._placements)), "LOCAL_RANK": str(index),
               "LOCAL_WORLD_SIZE": str(count), **self._env, **master}
        if not self._use_gpu:  # a worker that reserved no GPU sees none (so it runs on CPU, gloo)
            env["CUDA_VISIBLE_DEVICES"] = ""
        worker = self._actor_cls.options(scheduling_strategy=strategy, **self._options).remote(
            env, *self._args, **self._kwargs
        )
        self.workers.append(worker)
        return worker

    @staticmethod
    def start_all(sets: Sequence["ActorSet"]) -> None:
        """Start every rank of several sets at once (their processes start and import concurrently), then give
        each set's other ranks the rendezvous address its rank 0 picked (``set_master_addr_port``, their first
        call; they start with ``MASTER_LATER``), and wait for all of them.

        Raises:
            WorkerError: a rank's ``__init__`` failed or its actor died (every started actor is killed)."""
        started: list[ActorSet] = []
        try:
            for actors in sets:
                started.append(actors)
                for rank in range(len(actors._placements)):
                    actors._start_rank(rank)
            for actors in sets:
                rank0, others = actors.workers[0], actors.workers[1:]
                get_outputs([rank0.__ray_ready__.remote()], [0], actors.name, "__init__")
                addr, port = get_outputs([rank0.get_master_addr_port.remote()], [0], actors.name,
                                         "get_master_addr_port")[0]
                ranks = range(1, len(actors._placements))
                get_outputs([w.set_master_addr_port.remote(addr, port) for w in others], ranks, actors.name,
                            "__init__")
                logger.info("worker group %s: %d ranks of %s, master %s:%s", actors.name, len(actors._placements),
                            actors.label, addr, port)
        except BaseException:
            for actors in started:
                actors.shutdown()
            raise

    def shutdown(self) -> None:
        """Kill every actor. Safe to call twice."""
        for worker in self.workers:
            ray.kill(worker)
        self.workers.clear()


class RayWorkerGroup(_WorkerGroupBase):
    """One Ray actor per bundle of ``resource_pool``, running ``ray_cls_with_init``; registered methods bound.

    Args:
        resource_pool: where the ranks run (rank ``r`` in bundle ``r``, nodes in order).
        ray_cls_with_init: the ``Worker`` subclass and its constructor arguments.
        name_prefix: the group's name in errors and logs (default: class name + random suffix).
        num_cpus_per_worker: CPUs each actor asks for (default: ``cpus_per_bundle / max_colocate_count``, so
            up to ``max_colocate_count`` groups fit on one pool). Each actor also takes
            ``1 / max_colocate_count`` GPU when the pool uses GPUs.
        bin_pack: ``True`` pins rank ``r`` to bundle ``r`` (ranks of groups sharing a pool line up on the same
            device); ``False`` lets Ray pick any bundle of the rank's node placement group (only for a group
            that shares its pool with no other).
        env: extra environment variables every rank has before its ``__init__`` runs (e.g. the plugin modules
            ``Worker.__init__`` imports, ``HYBRIDFLOW_PLUGINS``).

    Every rank starts at once; rank 0 picks ``MASTER_ADDR``/``MASTER_PORT`` and the group passes them to the
    other ranks before any other call. The constructor returns once every rank's ``__init__`` finished. Several
    classes in one process per rank: :func:`hybridflow.controller.colocated.create_colocated`.

    Raises:
        TypeError: ``ray_cls_with_init`` is not a ``RayClassWithInitArgs``.
        ValueError: the pool has no placement groups (removed), or a registered method name clashes with a
            group attribute.
        KeyError: a method uses a dispatch mode that is not registered.
        WorkerError: a rank's ``__init__`` failed (the started actors are killed).
    """

    def __init__(
        self,
        resource_pool: ResourcePool,
        ray_cls_with_init: RayClassWithInitArgs,
        name_prefix: Optional[str] = None,
        num_cpus_per_worker: Optional[float] = None,
        bin_pack: bool = True,
        env: Optional[dict[str, str]] = None,
        _start: bool = True,
    ) -> None:
        if not isinstance(ray_cls_with_init, RayClassWithInitArgs):
            raise TypeError(f"ray_cls_with_init must be a RayClassWithInitArgs, got {type(ray_cls_with_init).__name__}")
        cls = ray_cls_with_init.cls
        name = name_prefix or f"{cls.__name__}_{uuid.uuid4().hex[:6]}"
        placements = placements_of(resource_pool)
        actors = ActorSet(name, cls.__name__, ray.remote(_with_env(cls)), placements,
                          {**share_of(resource_pool, 1 / resource_pool.max_colocate_count, num_cpus_per_worker),
                           # a Worker class may ask for more Ray actor options, e.g. {"max_concurrency": 4} for
                           # methods that run at the same time as another call (in threads)
                           **getattr(cls, "ray_actor_options", {})},
                          ray_cls_with_init.args, ray_cls_with_init.kwargs, resource_pool.use_gpu, bin_pack, env)
        super().__init__(name, actors.workers, {}, resource_pool)  # its workers are its actor set's (filled at start)
        for method_name, spec in get_registered_methods(cls).items():
            self._bind(method_name, method_name, spec, getattr(cls, method_name).__doc__)
        self._cls = cls
        self._actors = actors
        if _start:
            ActorSet.start_all([actors])

    @classmethod
    def create_many(
        cls, specs: Sequence[tuple[ResourcePool, RayClassWithInitArgs, Optional[str]]],
        env: Optional[dict[str, str]] = None,
    ) -> list["RayWorkerGroup"]:
        """Build several groups at once, ``(resource_pool, ray_cls_with_init, name_prefix)`` each, every rank with
        the extra environment ``env``; their processes start concurrently (faster than one group after the
        other). Raises like the constructor."""
        groups = [cls(pool, cls_with_init, name, env=env, _start=False) for pool, cls_with_init, name in specs]
        ActorSet.start_all([group._actors for group in groups])
        return groups

    def shutdown(self) -> None:
        """Kill every actor of the group, and forget its calls nobody read. Safe to call twice."""
        self._actors.shutdown()
        forget([self._name])


def share_of(resource_pool: ResourcePool, fraction: float, num_cpus: Optional[float] = None) -> dict[str, float]:
    """Ray actor options for an actor that takes ``fraction`` of each bundle of ``resource_pool`` (``num_cpus``
    CPUs instead, when given): ``num_cpus`` and ``num_gpus`` (0 on a CPU pool)."""
    return {"num_cpus": resource_pool.cpus_per_bundle * fraction if num_cpus is None else num_cpus,
            "num_gpus": fraction if resource_pool.use_gpu else 0}

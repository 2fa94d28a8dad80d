"""Dispatch modes: how a driver-side call becomes per-rank calls, and how the outputs come back.

A mode is a pair of functions (``DispatchMode``):

* ``dispatch_fn(worker_group, *args, **kwargs) -> DispatchPlan``: per-rank arguments (``plan.args[i][r]`` is
  positional argument ``i`` for rank ``r``), the ranks whose outputs count (``collect_ranks``), the number of
  padding rows added to the batch (``pad_size``) and, when it padded, where the padding went (``padding``: per
  rank, the rows of its chunk and how many of them, at the chunk's end, are padding). ``worker_group`` offers
  ``world_size`` and ``dispatch_info(mesh_name)``.
* ``collect_fn(outputs) -> result``: ``outputs`` are those of ``collect_ranks``, in that order, with the rows
  that the padding produced already removed (see "Padding" below).

Padding: a batch of ``B`` rows split into ``C`` chunks is padded to a multiple of ``C`` with copies of its first
rows, appended at the end, so the padding sits at the end of the last chunk(s). A method may return any number
of rows per input row (a rollout with ``n`` samples per prompt returns ``n``), so the padding is removed from the
*outputs*: a rank whose chunk is all padding is dropped; a rank whose chunk of ``k`` rows ends with ``p`` padding
rows returned ``m`` rows, i.e. ``m / k`` per input row, and its last ``p * m / k`` rows are dropped. This needs
the method to keep each input row's outputs together and in input order (e.g. ``repeat(n, interleave=True)``);
a chunk with padding whose output size is not a multiple of its input size raises ``ValueError``.

Built-in modes (``B``: batch rows, ``W``: world size, ``D``: data-parallel size of a mesh):

* ``ONE_TO_ALL``: every rank gets the same arguments; result: the list of the ``W`` outputs.
* ``ALL_TO_ALL``: every argument is a list of length ``W``; rank ``r`` gets element ``r``; result: list.
* ``DP_COMPUTE_PROTO``: every ``DataProto`` argument is padded to a multiple of ``W`` and split into ``W``
  chunks (rank ``r`` gets rows ``[r*k, (r+1)*k)``); other arguments are broadcast; result: the outputs, padding
  removed, concatenated in rank order. A ``DataProtoFuture`` argument is chunked lazily and cannot be
  padded: its batch must be divisible by ``W`` (else the worker raises when it materializes its chunk).
* ``RANK_ZERO``: same arguments everywhere; result: rank 0's output (use with ``Execute.RANK_ZERO``).
* ``MESH_COMPUTE_PROTO`` (``mesh_name``): each rank declared ``(dp_rank, is_collect)`` for the mesh; the batch is
  split into ``D`` chunks, each ``ray.put`` once and the same ``ObjectRef`` given to all ranks of that dp rank
  (tensor/pipeline peers); outputs of the collecting ranks, ordered by dp rank, are concatenated and unpadded.

A ``DataProto`` argument broadcast to several ranks is put into the object store once.

Add a mode with ``register_dispatch_mode(name, dispatch_fn, collect_fn)`` and use it as
``register(dispatch_mode=name)``.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import ray

from hybridflow.controller.decorator import Dispatch
from hybridflow.controller.futures import DataProtoFuture, Joined, PendingBatch
from hybridflow.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto
from hybridflow.registry import Registry
from hybridflow.utils.metrics import KINDS, finalize, reduce_metrics

__all__ = [
    "DISPATCH_MODES",
    "DispatchError",
    "DispatchPlan",
    "DispatchMode",
    "MeshDispatchInfo",
    "Collector",
    "register_dispatch_mode",
    "get_dispatch_mode",
    "dispatch_one_to_all",
    "dispatch_all_to_all",
    "dispatch_dp_compute_data_proto",
    "dispatch_rank_zero",
    "dispatch_mesh_compute_data_proto",
    "collect_all_to_all",
    "collect_rank_zero",
    "collect_dp_compute_data_proto",
]


class DispatchError(ValueError):
    """The arguments of a worker-group call do not fit its dispatch mode (the message says which and why)."""


@dataclass
class DispatchPlan:
    """Per-rank arguments of one call and what its collect step needs.

    ``args[i][r]``: positional argument ``i`` for rank ``r``; ``kwargs[name][r]`` likewise. Every list has
    ``world_size`` entries. ``collect_ranks``: ranks whose outputs the collect function gets, in that order
    (``None``: every executed rank, in rank order). ``pad_size``: padding rows added to the input batch.
    ``padding``: required when ``pad_size > 0``; per rank ``(rows, padding_rows)``: the rows of the batch chunk
    the rank got and how many of them, at the chunk's end, are padding (see the module docstring).
    """

    args: tuple[list, ...]
    kwargs: dict[str, list]
    collect_ranks: Optional[list[int]] = None
    pad_size: int = 0
    padding: Optional[list[tuple[int, int]]] = None


@dataclass(frozen=True)
class DispatchMode:
    """A dispatch function, a collect function, and whether the collected result is a ``DataProto``
    (which decides what a call returns: a ``DataProtoFuture`` at once, or the collected value / a list of
    ``ObjectRef`` for ``blocking=False``). ``forwards_pending``: the dispatch function accepts a
    :class:`~hybridflow.controller.futures.PendingBatch` (a batch with futures unioned into it) and hands the
    futures to the ranks (the built-in ``ONE_TO_ALL``, ``DP_COMPUTE_PROTO``, ``MESH_COMPUTE_PROTO``); other modes
    get such a batch read on the driver."""

    dispatch_fn: Callable[..., DispatchPlan]
    collect_fn: Callable[[list], Any]
    returns_proto: bool = False
    needs_mesh: bool = False  # dispatch_fn takes the mesh name first (bound by get_dispatch_mode)
    forwards_pending: bool = False


@dataclass(frozen=True)
class MeshDispatchInfo:
    """Where each rank sits in a named mesh: ``dp_rank[r]``, ``is_collect[r]``, ``dp_size``, and
    ``collect_ranks`` (the one collecting rank of each dp rank, ordered by dp rank)."""

    mesh_name: str
    dp_rank: tuple[int, ...]
    is_collect: tuple[bool, ...]
    dp_size: int = field(init=False)
    collect_ranks: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        dp_ranks = sorted(set(self.dp_rank))
        dp_size = len(dp_ranks)
        if dp_ranks != list(range(dp_size)):
            raise DispatchError(
                f"mesh {self.mesh_name!r}: dp ranks must be 0..dp_size-1 with no gap, got per-rank dp ranks "
                f"{list(self.dp_rank)}"
            )
        collectors: dict[int, list[int]] = {d: [] for d in range(dp_size)}
        for rank, (d, c) in enumerate(zip(self.dp_rank, self.is_collect)):
            if c:
                collectors[d].append(rank)
        bad = {d: ranks for d, ranks in collectors.items() if len(ranks) != 1}
        if bad:
            listing = ", ".join(f"dp rank {d}: collecting ranks {r}" for d, r in bad.items())
            raise DispatchError(
                f"mesh {self.mesh_name!r}: exactly one rank per dp rank must declare is_collect=True; {listing}"
            )
        object.__setattr__(self, "dp_size", dp_size)
        object.__setattr__(self, "collect_ranks", tuple(collectors[d][0] for d in range(dp_size)))


class Collector:
    """Picklable ``outputs of every executed rank -> result``: keep the counted positions, drop the rows that
    dispatch padding produced, collect.

    Args:
        collect_fn: the dispatch mode's collect function.
        positions: indices, into the executed ranks' outputs, of the counted outputs (in collect order).
        padding: per counted output ``(rows, padding_rows)`` of its input chunk (``None``: nothing was padded).
    """

    def __init__(self, collect_fn: Callable[[list], Any], positions: list[int],
                 padding: Optional[list[tuple[int, int]]] = None) -> None:
        self.collect_fn, self.positions = collect_fn, positions
        self.padding = padding if padding and any(pad for _, pad in padding) else None

    @property
    def concatenates(self) -> Optional[list[int]]:
        """The counted positions when the result is their outputs concatenated, nothing dropped (a DataProto
        mode's collect with no padding); else None."""
        unpadded = self.padding is None and self.collect_fn is collect_dp_compute_data_proto
        return self.positions if unpadded else None

    def __call__(self, outputs: list) -> Any:
        counted = [outputs[p] for p in self.positions]
        if self.padding is not None:
            kept = [(i, out, rows, pad) for i, (out, (rows, pad)) in enumerate(zip(counted, self.padding))
                    if pad < rows]  # an output computed from padding only is dropped whole
            counted = [drop_padding_rows(out, rows, pad, f"output {i} of {len(self.padding)}")
                       for i, out, rows, pad in kept]
        return self.collect_fn(counted)


def drop_padding_rows(output: Any, rows: int, pad: int, what: str = "output") -> Any:
    """``output`` of a chunk of ``rows`` input rows whose last ``pad`` are padding, without the rows the padding
    produced: the method returned ``len(output) / rows`` rows per input row, so the last ``pad`` times that many
    are dropped. ``pad == 0`` returns ``output`` itself.

    Raises:
        TypeError: ``pad > 0`` and ``output`` is not a ``DataProto``.
        ValueError: ``len(output)`` is not a multiple of ``rows`` (the padding's outputs cannot be located).
    """
    if pad == 0:
        return output
    if not isinstance(output, DataProto):
        raise TypeError(f"the batch was padded, so {what} must be a DataProto, got {type(output).__name__}")
    if len(output) % rows:
        raise ValueError(
            f"{what}: the method returned {len(output)} rows for an input chunk of {rows} rows whose last {pad} are "
            f"dispatch padding; it must return the same number of rows for every input row, each input row's "
            f"rows together and in input order (e.g. repeat(n, interleave=True)), so the padding's rows can be "
            f"removed; or give the method a batch divisible by the number of chunks"
        )
    return unpad_dataproto(output, pad * (len(output) // rows))


# ---------------------------------------------------------------------- helpers
def _broadcast(value: Any, n: int) -> list:
    """``n`` copies of ``value`` for ``n`` ranks; a ``DataProto`` is put into the object store once; a
    :class:`PendingBatch` becomes one :class:`Joined` (each rank fetches the futures' outputs itself)."""
    if isinstance(value, PendingBatch):
        return [Joined(_broadcast(value.known, n)[0], value.futures, value.select)] * n
    if isinstance(value, DataProto) and n > 1:
        value = ray.put(value)
    return [value] * n


def _scatter(args: tuple, kwargs: dict, chunks: int, chunk_of_rank: list[int], put_chunks: bool):
    """Per-rank arguments: every DataProto(Future) argument is padded and split into ``chunks`` pieces and rank
    ``r`` gets piece ``chunk_of_rank[r]``; other arguments are broadcast.

    Returns ``(args, kwargs, pad_size, padding)``; ``padding[r]`` is ``(rows, padding_rows)`` of rank ``r``'s
    chunk (None without DataProto arguments). With ``put_chunks`` each ``DataProto`` piece that several ranks get
    is ``ray.put`` once and its ``ObjectRef`` shared by them; a piece of one rank is passed inline (a ``ray.put``
    costs ~1.5 ms here, more than sending a small piece twice; Ray moves large arguments through its object store
    itself).

    Raises ``DispatchError`` when DataProto arguments differ in batch size, or when padding would be needed
    alongside a ``DataProtoFuture`` (whose size is unknown).
    """
    named = [(f"argument {i}", a) for i, a in enumerate(args)] + [(f"argument {k!r}", v) for k, v in kwargs.items()]
    sizes = {name: len(v) for name, v in named if isinstance(v, (DataProto, PendingBatch))}
    if len(set(sizes.values())) > 1:
        raise DispatchError(f"DataProto arguments must have the same batch size, got {sizes}")
    batch = next(iter(sizes.values()), 0)
    pad_size = (-batch) % chunks
    futures = [name for name, v in named if isinstance(v, DataProtoFuture)]
    if pad_size and futures:
        raise DispatchError(
            f"DataProto arguments {sizes} need {pad_size} padding rows to split into {chunks} chunks, which "
            f"cannot be matched on the DataProtoFuture arguments {futures} (their size is unknown)"
        )
    world = len(chunk_of_rank)
    readers = [chunk_of_rank.count(c) for c in range(chunks)]  # ranks that get each piece

    def per_rank(value: Any) -> list:
        if isinstance(value, PendingBatch) and pad_size:  # a future cannot be padded: read it here
            value = value.settle()
        if isinstance(value, PendingBatch):  # each rank joins its chunk of the columns and of every future
            known = per_rank(value.known)
            parts = [f.chunk(chunks) for f in value.futures]
            return [Joined(known[r], [p[c] for p in parts], value.select) for r, c in enumerate(chunk_of_rank)]
        if isinstance(value, DataProtoFuture):
            pieces = value.chunk(chunks)
        elif isinstance(value, DataProto):
            pieces = pad_dataproto_to_divisor(value, chunks)[0].chunk(chunks)
            if put_chunks:  # a piece several ranks read (tp/pp peers) is stored once; one reader's goes inline
                pieces = [ray.put(p) if readers[c] > 1 else p for c, p in enumerate(pieces)]
        else:
            return _broadcast(value, world)
        return [pieces[c] for c in chunk_of_rank]

    padding = None
    if sizes:
        rows = (batch + pad_size) // chunks  # the padding rows are the last pad_size of the padded batch
        padding = [(rows, min(rows, max(0, (c + 1) * rows - batch))) for c in chunk_of_rank]
    return tuple(per_rank(a) for a in args), {k: per_rank(v) for k, v in kwargs.items()}, pad_size, padding


# ---------------------------------------------------------------------- built-in modes
def dispatch_one_to_all(worker_group: Any, *args: Any, **kwargs: Any) -> DispatchPlan:
    """Every rank gets the same arguments."""
    n = worker_group.world_size
    return DispatchPlan(tuple(_broadcast(a, n) for a in args), {k: _broadcast(v, n) for k, v in kwargs.items()})


def dispatch_all_to_all(worker_group: Any, *args: Any, **kwargs: Any) -> DispatchPlan:
    """Rank ``r`` gets element ``r`` of every argument.

    Raises ``DispatchError`` naming the argument when one is not a list/tuple of length ``world_size``.
    """
    n = worker_group.world_size
    named = [(f"argument {i}", a) for i, a in enumerate(args)] + [(f"argument {k!r}", v) for k, v in kwargs.items()]
    for name, value in named:
        if not isinstance(value, (list, tuple)) or len(value) != n:
            got = f"length {len(value)}" if isinstance(value, (list, tuple)) else f"a {type(value).__name__}"
            raise DispatchError(f"ALL_TO_ALL: {name} must be a list of length world_size={n}, got {got}")
    return DispatchPlan(tuple(list(a) for a in args), {k: list(v) for k, v in kwargs.items()})


def dispatch_rank_zero(worker_group: Any, *args: Any, **kwargs: Any) -> DispatchPlan:
    """Same arguments everywhere; only rank 0's output counts."""
    plan = dispatch_one_to_all(worker_group, *args, **kwargs)
    plan.collect_ranks = [0]
    return plan


def dispatch_dp_compute_data_proto(worker_group: Any, *args: Any, **kwargs: Any) -> DispatchPlan:
    """Split ``DataProto`` arguments into ``world_size`` chunks, padding if needed; broadcast the rest."""
    n = worker_group.world_size
    args, kwargs, pad_size, padding = _scatter(args, kwargs, n, list(range(n)), put_chunks=False)
    return DispatchPlan(args, kwargs, pad_size=pad_size, padding=padding)


def dispatch_mesh_compute_data_proto(mesh_name: str, worker_group: Any, *args: Any, **kwargs: Any) -> DispatchPlan:
    """Split ``DataProto`` arguments into ``dp_size`` chunks of mesh ``mesh_name``; rank ``r`` gets the chunk of
    its dp rank (one ``ray.put`` per chunk that several peers share); only collecting ranks' outputs count."""
    info = worker_group.dispatch_info(mesh_name)
    args, kwargs, pad_size, padding = _scatter(args, kwargs, info.dp_size, list(info.dp_rank), put_chunks=True)
    return DispatchPlan(args, kwargs, collect_ranks=list(info.collect_ranks), pad_size=pad_size, padding=padding)


def collect_all_to_all(outputs: list) -> list:
    """The outputs as a list, in rank order."""
    return list(outputs)


def collect_rank_zero(outputs: list) -> Any:
    """The single counted output (rank 0's)."""
    return outputs[0]


def collect_dp_compute_data_proto(outputs: list) -> DataProto:
    """Concatenate the counted outputs in order: ``meta_info`` from the first, except the values declared as metric
    kinds, pooled over them (:func:`pool_declared_metrics`). Raises ``TypeError`` naming the first non-DataProto
    output, or one key declared with two kinds."""
    for i, out in enumerate(outputs):
        if not isinstance(out, DataProto):
            raise TypeError(
                f"a DataProto dispatch mode needs every counted rank to return a DataProto; output {i} of "
                f"{len(outputs)} is a {type(out).__name__}"
            )
    merged = DataProto.concat(outputs)
    merged.meta_info.update(pool_declared_metrics([out.meta_info for out in outputs]))
    return merged


def pool_declared_metrics(metas: list[dict]) -> dict[str, Any]:
    """The entries of several ranks' ``meta_info`` that are declared metric kinds (:mod:`hybridflow.utils.metrics`:
    ``Mean``, ``Sum``, ``Max``, ``Min``, ``Std``), each pooled over the ranks that have it by its kind and finalized
    to a float: a key whose value is a kind (e.g. a method's worker seconds, ``Max``: the driver waits for the
    slowest rank), or a dict holding kinds (e.g. ``metrics``), whose plain numbers stay the first rank's (values
    every rank already holds alike). Entries with no kind are not returned."""
    pooled: dict[str, Any] = {}
    for key in dict.fromkeys(k for meta in metas for k in meta):
        values = [meta[key] for meta in metas if key in meta]
        if isinstance(values[0], KINDS):
            pooled[key] = reduce_metrics({key: v} for v in values)[key].result()
        elif isinstance(values[0], dict) and any(isinstance(v, KINDS) for d in values for v in d.values()):
            kinds = [{k: v for k, v in d.items() if isinstance(v, KINDS)} for d in values]
            plain = {k: v for k, v in values[0].items() if not isinstance(v, KINDS)}
            pooled[key] = {**plain, **finalize(reduce_metrics(kinds))}
    return pooled


# ---------------------------------------------------------------------- registry
def _key(mode: Union[Dispatch, str]) -> str:
    return mode.value if isinstance(mode, Dispatch) else mode


DISPATCH_MODES: Registry = Registry("dispatch mode")
for _mode, _entry in (
    (Dispatch.ONE_TO_ALL, DispatchMode(dispatch_one_to_all, collect_all_to_all, forwards_pending=True)),
    (Dispatch.ALL_TO_ALL, DispatchMode(dispatch_all_to_all, collect_all_to_all)),
    (Dispatch.RANK_ZERO, DispatchMode(dispatch_rank_zero, collect_rank_zero, forwards_pending=True)),
    (Dispatch.DP_COMPUTE_PROTO, DispatchMode(dispatch_dp_compute_data_proto, collect_dp_compute_data_proto,
                                             returns_proto=True, forwards_pending=True)),
    (Dispatch.MESH_COMPUTE_PROTO, DispatchMode(dispatch_mesh_compute_data_proto, collect_dp_compute_data_proto,
                                               returns_proto=True, needs_mesh=True, forwards_pending=True)),
):
    DISPATCH_MODES.register(_key(_mode))(_entry)
del _mode, _entry


def register_dispatch_mode(
    name: str,
    dispatch_fn: Callable[..., DispatchPlan],
    collect_fn: Callable[[list], Any],
    returns_proto: bool = False,
) -> None:
    """Add a dispatch mode usable as ``register(dispatch_mode=name)`` (into the registry ``DISPATCH_MODES``).

    ``dispatch_fn(worker_group, *args, **kwargs) -> DispatchPlan``; ``collect_fn(outputs) -> result``;
    ``returns_proto``: the result is a ``DataProto`` (calls then return a ``DataProtoFuture`` at once;
    ``collect_fn`` must then be picklable, e.g. a module-level function). A batch with futures unioned into it is
    read on the driver before ``dispatch_fn`` sees it (only the built-in modes forward it to the ranks).

    Raises ``ValueError`` when ``name`` is taken (built-in names included) and ``TypeError`` for a non-str name
    or non-callable functions.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"dispatch mode name must be a non-empty str, got {name!r}")
    if name in DISPATCH_MODES:
        raise ValueError(f"dispatch mode {name!r} is already registered (known: {DISPATCH_MODES.names()})")
    if not callable(dispatch_fn) or not callable(collect_fn):
        raise TypeError("dispatch_fn and collect_fn must be callable")
    DISPATCH_MODES.register(name)(DispatchMode(dispatch_fn, collect_fn, returns_proto))


def get_dispatch_mode(mode: Union[Dispatch, str], mesh_name: Optional[str] = None) -> DispatchMode:
    """The ``DispatchMode`` for ``mode``; for ``MESH_COMPUTE_PROTO`` its dispatch function is bound to ``mesh_name``.

    Raises:
        UnknownNameError: (a ``KeyError``) ``mode`` is not registered; the message lists the known modes.
    """
    entry = DISPATCH_MODES.get(_key(mode))
    if entry.needs_mesh:
        return dataclasses.replace(entry, dispatch_fn=functools.partial(entry.dispatch_fn, mesh_name))
    return entry

"""Futures of worker-group calls, and the error that names the failing rank.

``DataProtoFuture`` is what every call of a method with a ``DataProto``-collecting dispatch mode
(``DP_COMPUTE_PROTO``, ``MESH_COMPUTE_PROTO``) returns, at once. It holds the Ray ``ObjectRef`` of every rank that
ran, a collect function that knows whose outputs count (and removes dispatch padding), and optionally a
per-consumer selection (``chunk``). It reads like the ``DataProto`` it will be (``batch``, ``meta_info``, ``len``,
``select`` ...: each waits for the call, once), and ``DataProto.union`` records it without waiting. Pass it, or a
batch it was unioned into, straight to the next worker group: that group's dispatch chunks it lazily and each of
its workers materializes only its own chunk (:class:`Joined`), so the driver never calls ``ray.get``.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence

import ray
from ray.exceptions import RayActorError, RayTaskError

from hybridflow.errors import UserError

__all__ = ["CallTimeoutError", "DataProtoFuture", "Joined", "PendingBatch", "WorkerError", "get_all", "get_outputs",
           "get_outputs_many", "materialize"]


class WorkerError(RuntimeError):
    """A worker-group call failed on one rank.

    Attributes: ``group`` (the worker group's name prefix), ``rank``, ``method``, ``cause`` (the Ray error,
    whose text holds the remote traceback; its ``cause`` is the rank's own exception), :attr:`user_error`.
    """

    def __init__(self, group: str, rank: int, method: str, cause: BaseException) -> None:
        self.group, self.rank, self.method, self.cause = group, rank, method, cause
        original = getattr(cause, "cause", None)
        if original is None:  # e.g. the actor died: the Ray error is the whole story
            detail = f"{type(cause).__name__}: {cause}"
        else:  # a RayTaskError: the original exception first, then Ray's text with the remote traceback
            detail = f"{type(original).__name__}: {original}\n--- remote error ---\n{cause}"
        super().__init__(f"worker group {group!r}: rank {rank} failed in {method}(): {detail}")

    def __reduce__(self):  # keep the four fields when pickled (Ray ships errors between processes)
        return (WorkerError, (self.group, self.rank, self.method, self.cause))

    @property
    def location(self) -> str:
        """``<group> rank <rank>``: where the failure happened, to prefix :attr:`user_error`'s line."""
        return f"{self.group} rank {self.rank}"

    @property
    def user_error(self) -> Optional[UserError]:
        """The :class:`~hybridflow.errors.UserError` the rank raised (a ``UserCodeError`` from the user's own code,
        a data error), also through a worker that waited on another group; None for any other failure (a bug, a
        dead actor), which keeps its remote traceback."""
        original = getattr(self.cause, "cause", None)
        if isinstance(original, WorkerError):
            return original.user_error
        return original if isinstance(original, UserError) else None


class CallTimeoutError(TimeoutError):
    """Some ranks did not answer a worker-group call within the caller's time limit.

    Attributes: ``waiting`` (``(group, method, ranks that did not answer)`` per call still waited on, in call
    order), ``timeout_s``; ``group``, ``method`` and ``ranks`` are the first call's. The calls are not stopped
    (their actors keep running until the caller removes them).
    """

    def __init__(self, waiting: Sequence[tuple[str, str, list[int]]], timeout_s: float) -> None:
        self.waiting, self.timeout_s = [(g, m, list(r)) for g, m, r in waiting], timeout_s
        self.group, self.method, self.ranks = self.waiting[0]
        calls = "; ".join(f"worker group {g!r}: ranks {r} did not answer {m}()" for g, m, r in self.waiting)
        super().__init__(f"{calls} within {timeout_s:g} s")

    def __reduce__(self):  # keep the fields when pickled (Ray ships errors between processes)
        return (CallTimeoutError, (self.waiting, self.timeout_s))


def get_outputs(refs: Sequence[ray.ObjectRef], ranks: Sequence[int], group: str, method: str,
                timeout_s: Optional[float] = None) -> list[Any]:
    """``ray.get`` the outputs of one call, raising the first failure as a ``WorkerError`` naming its rank.

    Results are awaited as they complete (``ray.wait``), so a rank that fails early is reported even while
    its peers still block, e.g. in a collective waiting for it. ``timeout_s``: seconds to wait in all (None:
    unbounded).

    Raises:
        WorkerError: a rank raised (``RayTaskError``) or its actor died (``RayActorError``).
        CallTimeoutError: ranks had not answered after ``timeout_s`` seconds (names the group, method, ranks).
    """
    return get_outputs_many([(refs, ranks, group, method)], timeout_s)[0]


def get_outputs_many(calls: Sequence[tuple[Sequence[ray.ObjectRef], Sequence[int], str, str]],
                     timeout_s: Optional[float] = None) -> list[list[Any]]:
    """Wait for several calls, possibly of different groups running together (e.g. a sender and its receivers),
    each ``(refs, their ranks, group, method)``; returns their outputs. The first failure of any of them is
    raised at once as a ``WorkerError``, so a rank whose peer died is not waited for. ``timeout_s``: seconds to
    wait for all of them, from this call on (None: unbounded).

    Raises:
        WorkerError: a rank raised or its actor died (names the group, rank and method); a rank that failed reading
            another call's output it was handed (a future) raises that call's ``WorkerError``, noting the reader.
        CallTimeoutError: ranks had not answered after ``timeout_s`` seconds (names, per call, the group, the
            method and the ranks).
    """
    where = {ref: (group, rank, method) for refs, ranks, group, method in calls for ref, rank in zip(refs, ranks)}
    values: dict[ray.ObjectRef, Any] = {}
    pending = list(where)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while pending:
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not ready and deadline is not None and time.monotonic() < deadline:
            continue  # ray.wait can return a little before its timeout: the limit is waited in full
        if not ready:
            raise _timeout_error(calls, set(pending), timeout_s)
        if pending:  # the others already done are fetched in the same round
            more, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
            ready += more
        for ref in ready:  # each output is fetched and deserialized once
            try:
                values[ref] = ray.get(ref)
            except (RayTaskError, RayActorError) as err:
                group, rank, method = where[ref]
                produced = getattr(err, "cause", None)
                if isinstance(produced, WorkerError):  # the rank read another call's failed output: that one's error
                    produced.add_note(f"(read by worker group {group!r} rank {rank} in {method}())")
                    raise produced from err
                raise WorkerError(group, rank, method, err) from err
    return [[values[ref] for ref in refs] for refs, _, _, _ in calls]


def _timeout_error(calls: Sequence[tuple], pending: set, timeout_s: float) -> CallTimeoutError:
    """The :class:`CallTimeoutError` naming, per call of ``calls`` with refs in ``pending``, the ranks behind them."""
    waiting = [(group, method, [rank for ref, rank in zip(refs, ranks) if ref in pending])
               for refs, ranks, group, method in calls]
    return CallTimeoutError([w for w in waiting if w[2]], timeout_s)


_UNSET = object()


class _SelectChunk:
    """Picklable ``DataProto -> its i-th of n chunks``, applied after an optional earlier selection."""

    def __init__(self, chunks: int, index: int, before: Optional[Callable] = None) -> None:
        self.chunks, self.index, self.before = chunks, index, before

    def __call__(self, data: Any) -> Any:
        if self.before is not None:
            data = self.before(data)
        if len(data) % self.chunks:
            raise ValueError(
                f"a DataProtoFuture of batch size {len(data)} cannot be split into {self.chunks} equal chunks: "
                "a future's size is unknown when it is dispatched, so it cannot be padded; make the producing "
                f"method return a batch divisible by {self.chunks} (or call .get() and pass the DataProto)"
            )
        return data.chunk(self.chunks)[self.index]


class DataProtoFuture:
    """A ``DataProto`` that will exist once some worker-group call finishes: the one future type of the controller.
    (A call started with ``.submit`` of a method whose dispatch mode collects something else, e.g. ``ONE_TO_ALL``'s
    list of every rank's output, returns one too: :meth:`get` returns that collected value.)

    Args:
        collect_fn: ``list of every executed rank's output (rank order) -> DataProto``; it selects the ranks
            whose output counts, concatenates and unpads. Must be picklable (it travels with the future).
        futures: the ``ObjectRef`` of every executed rank, in rank order.
        dispatch_fn: optional ``DataProto -> DataProto`` applied after ``collect_fn`` (a consumer's chunk).
        source: ``(group name, method, ranks of futures)``, used to name the failing rank in errors.
        by_rank: the outputs may be handed to consumers one per rank (:meth:`split_by_rank`).
        timeout_s: how long :meth:`get` waits for the producing call (None: unbounded); the producing group's
            ``call_timeout_s``.
        call: the call's :class:`~hybridflow.controller.unread.CallRecord` (shared by the futures derived from this
            one), closed when the output is read or handed on (pickled for another call, split into its ranks'
            refs); if every future of the call is collected unread, the call's error surfaces at the next
            :func:`~hybridflow.controller.unread.raise_unread_errors`. None: untracked.
    """

    def __init__(
        self,
        collect_fn: Callable[[list], Any],
        futures: list[ray.ObjectRef],
        dispatch_fn: Optional[Callable[[Any], Any]] = None,
        source: Optional[tuple[str, str, list[int]]] = None,
        by_rank: bool = False,
        timeout_s: Optional[float] = None,
        call: Any = None,
    ) -> None:
        self._call = call
        if call is not None:
            call.attach()
        self.collect_fn = collect_fn
        self.futures = list(futures)
        self.dispatch_fn = dispatch_fn
        self.source = source or ("?", "?", list(range(len(self.futures))))
        self.by_rank = by_rank
        self.timeout_s = timeout_s
        self._value: Any = _UNSET  # the collected output, once read

    __dataproto_future__ = True  # DataProto.union records it without waiting (hybridflow.protocol)

    def __getstate__(self) -> dict:
        """Pickled, the future is handed on (another call's argument): its call's error surfaces through that
        consumer, so the call is no longer tracked here. The cached output stays with the reader that fetched it."""
        self._close_call()
        return {k: v for k, v in self.__dict__.items() if k not in ("_value", "_call")}

    def _close_call(self) -> None:
        call = self.__dict__.get("_call")
        if call is not None:
            call.close()

    def __del__(self) -> None:
        call = self.__dict__.get("_call")
        if call is not None:
            call.release()

    def done(self) -> bool:
        """Whether every producing rank has finished (successfully or not); never waits."""
        return not ray.wait(self.futures, num_returns=len(self.futures), timeout=0)[1]

    @property
    def batch(self) -> dict:
        """The collected ``DataProto``'s tensor columns (waits for the call, see :meth:`get`)."""
        return self.get().batch

    @property
    def non_tensor_batch(self) -> dict:
        """The collected ``DataProto``'s numpy columns (waits for the call, see :meth:`get`)."""
        return self.get().non_tensor_batch

    @property
    def meta_info(self) -> dict:
        """The collected ``DataProto``'s ``meta_info`` (waits for the call, see :meth:`get`)."""
        return self.get().meta_info

    def __len__(self) -> int:
        return len(self.get())

    def __getitem__(self, index: Any) -> Any:
        return self.get()[index]

    def __getattr__(self, name: str) -> Any:  # DataProto's other methods (select, pop, union, repeat, ...)
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.get(), name)

    def split_by_rank(self) -> "DataProtoFuture":
        """This future, with the caller's promise that the producing method returns the same number of rows for
        every input row (a rollout: ``rollout.n`` per prompt). Its outputs, when the producer's dispatch split
        the batch evenly (no padding) and a concatenating collect counts them all, are then equal consecutive
        slices of the batch, so a consumer with as many chunks as outputs gets output ``i`` as chunk ``i``
        (:meth:`chunk`): each consumer rank receives one producer rank's output straight from Ray, instead of
        fetching every output and splitting the batch again. Other splits fall back to :meth:`chunk`'s lazy
        pieces."""
        return DataProtoFuture(self.collect_fn, self.futures, self.dispatch_fn, self.source, by_rank=True,
                               timeout_s=self.timeout_s, call=self.__dict__.get("_call"))

    def _rank_outputs(self, chunks: int) -> Optional[list[ray.ObjectRef]]:
        """The counted outputs' refs when they are the ``chunks`` chunks one to one (:meth:`split_by_rank`): the
        collect function concatenates unpadded outputs (``Collector.concatenates``) of ``chunks`` ranks."""
        positions = getattr(self.collect_fn, "concatenates", None)
        if not self.by_rank or self.dispatch_fn is not None or positions is None or len(positions) != chunks:
            return None
        return [self.futures[p] for p in positions]

    def chunk(self, chunks: int) -> list[Any]:
        """Split lazily into ``chunks`` futures; the i-th materializes to chunk i of the collected batch. After
        :meth:`split_by_rank`, with one chunk per counted output, the pieces are the outputs' ``ObjectRef``s
        (passed as a call's argument, Ray hands the worker the ``DataProto`` itself).

        Nothing is fetched here. ``get()`` on a piece raises ``ValueError`` when the collected batch size is
        not divisible by ``chunks`` (a future cannot be padded before its size is known).
        """
        if not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunk: chunks must be a positive int, got {chunks!r}")
        outputs = self._rank_outputs(chunks)
        if outputs is not None:  # handed on as the ranks' refs: the consumer's read raises the error
            self._close_call()
            return outputs
        return [
            DataProtoFuture(self.collect_fn, self.futures, _SelectChunk(chunks, i, self.dispatch_fn), self.source,
                            timeout_s=self.timeout_s, call=self.__dict__.get("_call"))
            for i in range(chunks)
        ]

    def get(self) -> Any:
        """Wait for the producing call and return the collected (and, for a chunk, selected) ``DataProto``.

        The output is fetched once; later calls return the same object (a ``DataProto`` the caller may change).

        Raises:
            WorkerError: a producing rank failed (names the producer's group, rank and method).
            CallTimeoutError: producing ranks had not answered after ``timeout_s`` seconds.
            ValueError: this is a chunk of a batch whose size is not divisible by the number of chunks.
        """
        if self.__dict__.get("_value", _UNSET) is _UNSET:
            self._close_call()  # read: its error (if any) surfaces here
            group, method, ranks = self.source
            self._cache(get_outputs(self.futures, ranks, group, method, self.timeout_s))
        return self._value

    def _cache(self, outputs: list) -> None:
        """Keep the value of the producing ranks' ``outputs`` (rank order), as :meth:`get` would."""
        output = self.collect_fn(outputs)
        self._value = output if self.dispatch_fn is None else self.dispatch_fn(output)

    def __repr__(self) -> str:
        group, method, ranks = self.source
        select = self.dispatch_fn
        chunk = f", chunk {select.index} of {select.chunks}" if isinstance(select, _SelectChunk) else ""
        return f"DataProtoFuture({group}.{method}, ranks={ranks}{chunk})"


def get_all(*futures: DataProtoFuture) -> list[Any]:
    """The values of several calls' futures (:meth:`DataProtoFuture.get` of each, in argument order), waited for
    together: for calls whose ranks wait on each other (a sender and its receivers in a collective spanning two
    groups), so the first failure of any is raised at once instead of after a peer that will never finish. The time
    limit is the largest of the futures' ``timeout_s`` (unbounded if any is None), from this call on.

    Raises:
        WorkerError: a producing rank failed (the first failure of any call; names its group, rank and method).
        CallTimeoutError: ranks had not answered within the limit (names, per call, the group, method and ranks).
    """
    waiting = [f for f in futures if f.__dict__.get("_value", _UNSET) is _UNSET]
    limits = [f.timeout_s for f in waiting]
    timeout_s = None if not limits or None in limits else max(limits)
    outputs = get_outputs_many([(f.futures, f.source[2], f.source[0], f.source[1]) for f in waiting], timeout_s)
    for future, output in zip(waiting, outputs):
        future._cache(output)
    return [f.get() for f in futures]


class PendingBatch:
    """A driver-side call argument: a batch's columns known now (``known``, a ``DataProto`` with columns) and the
    futures unioned into it, not yet read (``futures``, all ``DataProtoFuture``). A ``DataProto``-splitting dispatch
    gives each rank a :class:`Joined` of its chunk of each; :meth:`settle` reads them on the driver instead (when
    the batch must be padded, which a future's unknown size does not allow). ``select``: picklable ``DataProto ->
    DataProto`` the ranks apply to the joined batch (the method's declared columns), None: all."""

    def __init__(self, known: Any, futures: Sequence[DataProtoFuture], select: Optional[Callable] = None) -> None:
        self.known, self.futures, self.select = known, list(futures), select

    def __len__(self) -> int:
        return len(self.known)

    def settle(self) -> Any:
        """The whole batch on the driver: ``known`` with every future's output unioned (waits for them)."""
        for future in self.futures:
            self.known.union(future.get())
        self.futures = []
        return self.known if self.select is None else self.select(self.known)


class Joined:
    """One rank's argument made of a batch's columns known at dispatch (``known``: a ``DataProto`` or its
    ``ObjectRef``) and pieces of the futures unioned into it (``pieces``: ``DataProtoFuture`` chunks or output
    ``ObjectRef``s); :meth:`get`, run on the worker, fetches each and unions them in order, as reading the batch
    on the driver would have, then applies ``select`` (see :class:`PendingBatch`). A producer's failure is raised as
    its ``WorkerError``."""

    def __init__(self, known: Any, pieces: Sequence[Any], select: Optional[Callable] = None) -> None:
        self.known, self.pieces, self.select = known, list(pieces), select

    def get(self) -> Any:
        data = materialize(self.known)
        for piece in self.pieces:
            data.union(materialize(piece))
        return data if self.select is None else self.select(data)


def materialize(value: Any) -> Any:
    """``value`` with a future (``DataProtoFuture``, :class:`Joined`) or a nested ``ObjectRef`` fetched; any other
    value as is. Raises what the future's ``get()`` raises."""
    if isinstance(value, ray.ObjectRef):
        return ray.get(value)
    return value.get() if isinstance(value, (DataProtoFuture, Joined)) else value

"""Calls whose output nobody reads: their errors surface anyway, at the next check.

A worker-group call that returns a :class:`~hybridflow.controller.futures.DataProtoFuture` reports a failure where
its output is read. :func:`track` gives each such call a :class:`CallRecord`, shared by the call's future and every
future derived from it (its chunks, ``split_by_rank``). The record is closed, and forgotten, when one of them is

* read on the driver (``get()``, which raises the call's error itself), or
* handed on: pickled into another call's arguments (a ``Joined``, a chunk sent to a rank) or split into the
  producing ranks' output refs for the next group (``chunk`` after ``split_by_rank``); the consumer's read raises
  the error.

The registry holds an open record only weakly while one of its futures lives (a future may still be read; its value
is never fetched here unless a blocking check asks). When the last of its futures is garbage-collected unread, the
record is *abandoned*: the registry keeps it (and with it the call's ``ObjectRef``s, not their values) until
:func:`raise_unread_errors` checks it. That check fetches the outputs of the abandoned calls that have finished
(the small outputs a caller chose not to read, e.g. an update's metrics), raises the first failure as its
``WorkerError`` (the error a read would have raised) and forgets the calls that succeeded. A blocking check also
waits for, and checks, the calls whose futures still live unread.

Knows nothing of RL; ``RayWorkerGroup`` checks (non-blocking) at the start of every call, a train loop after every
step and (blocking) before a checkpoint.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Iterable, Optional, Sequence

import ray

from hybridflow.controller.futures import get_outputs

__all__ = ["CallRecord", "raise_unread_errors", "track", "unread_calls"]

_OPEN, _CLOSED = "open", "closed"


class CallRecord:
    """One tracked call: its ``ObjectRef``s and ranks (those not yet checked), ``group``, ``method``,
    ``timeout_s`` (the group's ``call_timeout_s``), how many of its futures live (``live``) and its ``state``
    (open until read, handed on or checked). Futures call :meth:`attach`, :meth:`release`, :meth:`close`."""

    __slots__ = ("number", "refs", "ranks", "group", "method", "timeout_s", "live", "state", "__weakref__")

    def __init__(self, number: int, refs: Sequence[ray.ObjectRef], ranks: Sequence[int], group: str, method: str,
                 timeout_s: Optional[float]) -> None:
        self.number, self.refs, self.ranks = number, list(refs), list(ranks)
        self.group, self.method, self.timeout_s = group, method, timeout_s
        self.live, self.state = 0, _OPEN

    def attach(self) -> None:
        """A future of this call was made."""
        self.live += 1

    def release(self) -> None:
        """A future of this call was garbage-collected; the last one gone unread abandons the call."""
        self.live -= 1
        if self.live <= 0 and self.state == _OPEN:
            _ABANDONED[self.number] = self

    def close(self) -> None:
        """The call's output was read or handed on (its error surfaces there): stop tracking it."""
        self.state = _CLOSED
        self.refs, self.ranks = [], []
        _ABANDONED.pop(self.number, None)
        _LIVE.pop(self.number, None)

    def __repr__(self) -> str:
        return f"CallRecord({self.group}.{self.method}, ranks={self.ranks}, {self.state}, live={self.live})"


_NUMBERS = itertools.count()
_LIVE: "weakref.WeakValueDictionary[int, CallRecord]" = weakref.WeakValueDictionary()  # open, a future lives
_ABANDONED: dict[int, CallRecord] = {}  # open, every future gone unread


def track(refs: Sequence[ray.ObjectRef], ranks: Sequence[int], group: str, method: str,
          timeout_s: Optional[float] = None) -> CallRecord:
    """A new open record of a call (``refs`` in the order of ``ranks``), tracked until read, handed on or
    checked; hand it to the call's future (``DataProtoFuture(..., call=record)``)."""
    record = CallRecord(next(_NUMBERS), refs, ranks, group, method, timeout_s)
    _LIVE[record.number] = record
    return record


def unread_calls(include_live: bool = False) -> list[CallRecord]:
    """The open records in call order: the abandoned ones (every future gone unread), and with ``include_live``
    those whose futures still live unread too."""
    records = dict(_ABANDONED)
    if include_live:
        records.update({n: r for n, r in list(_LIVE.items()) if r.state == _OPEN})
    return [records[n] for n in sorted(records)]


def forget(groups: Optional[Iterable[str]] = None) -> None:
    """Stop tracking the unread calls of ``groups`` (worker group names; None: every group) without checking them:
    for groups that are gone (shut down, their pool removed), whose calls' errors no step depends on any more."""
    names = None if groups is None else set(groups)
    for record in unread_calls(include_live=True):
        if names is None or record.group in names:
            record.close()


def raise_unread_errors(wait: bool = False, groups: Optional[Iterable[str]] = None) -> None:
    """Check the calls whose output nobody read (see the module docstring), in call order; with ``groups`` (worker
    group names) only the calls of those groups (a checkpoint waits for the groups it saves, not for, say, a
    look-ahead generation on another group).

    ``wait=False``: only abandoned calls, only their ranks that have finished (``ray.wait(..., timeout=0)``); never
    blocks on a running call. ``wait=True``: every unread call, also one whose future still lives, each waited for
    (up to its group's ``call_timeout_s``). A call found successful on every rank is forgotten (a live future's
    value stays readable); a failed one is forgotten too once its error is raised, so it is reported once.

    Raises:
        WorkerError: a checked call failed on a rank (names its group, rank and method, as a read would).
        CallTimeoutError: ``wait=True`` and a call's ranks had not answered within its group's ``call_timeout_s``.
    """
    names = None if groups is None else set(groups)
    for record in unread_calls(include_live=wait):
        if names is not None and record.group not in names:
            continue
        if record.state != _OPEN:
            continue  # closed meanwhile (a finalizer ran)
        if wait:
            refs, ranks = record.refs, record.ranks
        else:
            ready = set(ray.wait(record.refs, num_returns=len(record.refs), timeout=0, fetch_local=False)[0])
            refs = [ref for ref in record.refs if ref in ready]
            ranks = [rank for ref, rank in zip(record.refs, record.ranks) if ref in ready]
        if not refs:
            continue
        try:
            get_outputs(refs, ranks, record.group, record.method, record.timeout_s if wait else None)
        except Exception:
            record.close()
            raise
        checked = set(refs)
        record.ranks = [rank for ref, rank in zip(record.refs, record.ranks) if ref not in checked]
        record.refs = [ref for ref in record.refs if ref not in checked]
        if not record.refs:
            record.close()

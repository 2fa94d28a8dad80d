"""Worker-side timing: each dataflow step reports the seconds it spent inside the worker and the wall-clock
interval it ran over, so the driver can separate worker compute from its own (controller) overhead."""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

from hybridflow.protocol import WORKER_TIME_PREFIX, DataProto
from hybridflow.utils.metrics import Max, Span

__all__ = ["WORKER_SPAN_PREFIX", "WORKER_TIME_PREFIX", "report_time"]

#: ``meta_info`` keys with this prefix hold a worker method's wall-clock interval (a ``Span``: the controller pools
#: the ranks of one call into the earliest start and the latest end, as a list of ``(start, end)`` pairs)
WORKER_SPAN_PREFIX = "worker_span/"


def report_time(fn: Callable[..., DataProto]) -> Callable[..., DataProto]:
    """Decorate a worker method returning a DataProto: adds ``meta_info["worker_s/<method>"]``, its seconds as a
    ``Max`` (the controller keeps the slowest counted rank's: the one the driver waits for), and
    ``meta_info["worker_span/<method>"]``, its ``time.time()`` interval as a ``Span`` (what the controller overhead
    is measured against: step time in which no worker method ran)."""

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> DataProto:
        wall, start = time.time(), time.perf_counter()
        out = fn(self, *args, **kwargs)
        seconds = time.perf_counter() - start
        out.meta_info[WORKER_TIME_PREFIX + fn.__name__] = Max(seconds)
        out.meta_info[WORKER_SPAN_PREFIX + fn.__name__] = Span(wall, wall + seconds)
        return out

    return wrapper

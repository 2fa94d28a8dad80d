"""Worker-side timing: each dataflow step reports the seconds it spent inside the worker, so the driver can
separate worker compute from its own (controller) overhead."""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

from hybridflow.protocol import WORKER_TIME_PREFIX, DataProto
from hybridflow.utils.metrics import Max


def report_time(fn: Callable[..., DataProto]) -> Callable[..., DataProto]:
    """Decorate a worker method returning a DataProto: adds ``meta_info["worker_s/<method>"]``, its seconds as a
    ``Max`` (the controller keeps the slowest counted rank's: the one the driver waits for)."""

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> DataProto:
        start = time.perf_counter()
        out = fn(self, *args, **kwargs)
        out.meta_info[WORKER_TIME_PREFIX + fn.__name__] = Max(time.perf_counter() - start)
        return out

    return wrapper

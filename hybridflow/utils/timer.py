"""Wall-clock timing as a context manager, so drivers read as the algorithm, not as bookkeeping."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def timer(name: str, timings: dict[str, float]) -> Iterator[None]:
    """Add the seconds spent in the block to ``timings[name]`` (accumulates if the name repeats)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start

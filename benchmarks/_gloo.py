"""Local multi-process launches for the benchmarks that time collectives (``reshard.py``, ``tp_collectives.py``):
:func:`hybridflow.distributed.launch.spawn_ranks`, with rank 0's JSON result handed back.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Callable

from hybridflow.distributed.launch import spawn_ranks


def run_gloo_ranks(fn: Callable[..., None], world: int, *args: Any, threads: int = 1) -> dict:
    """Run ``fn(rank, *args, out_path)`` on ``world`` spawned processes that form one gloo group (``threads`` torch
    threads each) and return the JSON object rank 0 wrote to ``out_path``. ``fn`` must be a module-level function
    (spawn pickles it by name); a rank that raises fails the call."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        spawn_ranks(fn, *args, out, world=world, threads=threads)
        with open(out) as f:
            return json.load(f)

"""``model.dtype=auto`` for training: bf16 compute over fp32 master weights where bf16 is faster, else fp32.

On GPU ``auto`` is bf16 (unchanged, :func:`hybridflow.distributed.resolve_dtype`). On CPU the answer depends on the
chip and on the model: without bf16 matrix units a bf16 matmul can be hundreds of times slower than fp32, with them
(e.g. AMX) several times faster, yet a small model's step may still be no faster in bf16 (kernel builds per shape,
casts around small ops). The engines' probe times the model's own matmul shapes in both dtypes
(:mod:`hybridflow.training.dtype_probe`); bf16 is chosen only when it is at least :data:`MIN_SPEEDUP` faster.
Without a model, :func:`time_matmul` times one square matmul. Then the weights, gradients and optimizer state stay
fp32 (the *master* copy) and FSDP2 casts the gathered parameters to bf16 for the forward/backward
(``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``); the workers take logits ``.float()`` before any
logprob, entropy or loss math, so those stay fp32.

All ranks of a group must agree (their collectives carry one dtype): :func:`agree_across_ranks` keeps bf16 only if
every rank's probe chose it. ``HYBRIDFLOW_AUTO_DTYPE_PROBE=0`` turns the probe off (auto is then fp32 on CPU, as
before); the test suite sets it so tests stay fp32 on every machine.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing as mp
import os
import time
from typing import Callable

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

MIN_SPEEDUP = 1.2  # bf16 must beat fp32 by this factor (timing noise and cast overheads eat small gains)
PROBE_ENV = "HYBRIDFLOW_AUTO_DTYPE_PROBE"


def time_matmul(dtype: torch.dtype, size: int = 512, repeats: int = 8) -> float:
    """Seconds per ``size`` x ``size`` matmul in ``dtype`` on this process's torch threads (best of ``repeats``,
    after one warm-up). Draws its operands from a generator of its own, so the probe leaves torch's global RNG
    where it was (a value head initialised after it is the same with and without the probe)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(dtype)
    b = torch.randn(size, size, generator=gen).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return best


def bf16_is_faster(timer: Callable[[torch.dtype], float] = time_matmul, min_speedup: float = MIN_SPEEDUP) -> bool:
    """Whether ``timer(fp32) / timer(bf16)`` >= ``min_speedup`` (``timer(dtype)``: seconds of the probe's work in
    that dtype: one square matmul by default, the model's MLP matmuls with the engines' timer)."""
    fp32, bf16 = timer(torch.float32), timer(torch.bfloat16)
    speedup = fp32 / bf16 if bf16 > 0 else 0.0
    logger.info("dtype=auto probe: fp32 %.2e s, bf16 %.2e s (bf16 speedup %.2fx, needs %.2fx)", fp32, bf16,
                speedup, min_speedup)
    return speedup >= min_speedup


@functools.lru_cache(maxsize=1)
def _probe_once() -> bool:
    return bf16_is_faster()


def agree_across_ranks(choice: bool) -> bool:
    """True only if ``choice`` is True on every rank of the default process group (one all-reduce; the choice
    itself without a process group)."""
    if not dist.is_initialized():
        return choice
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([int(choice)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def training_dtypes(name: str, device: str, probe: Callable[[], bool] | None = None,
                    timer: Callable[[torch.dtype], float] | None = None) -> tuple[torch.dtype, torch.dtype | None]:
    """``(weight dtype, compute dtype or None)`` of a training model for config dtype ``name`` on ``device``.

    ``auto`` on CPU: ``(float32, bfloat16)`` when ``probe()`` says bf16 is faster on every rank, else
    ``(float32, None)``. Without ``probe``, and unless ``HYBRIDFLOW_AUTO_DTYPE_PROBE=0``: :func:`bf16_is_faster`
    with ``timer`` (the engines pass one at the model's matmul shapes,
    :func:`hybridflow.training.dtype_probe.model_step_timer`), or the cached square-matmul probe without one.
    Anything else: ``(resolve_dtype(name, device), None)`` (no mixed precision). A collective when ``name`` is auto
    on CPU and a process group is up: every rank must call it.

    Raises:
        ValueError: unknown ``name`` (from :func:`hybridflow.distributed.resolve_dtype`).
    """
    from hybridflow.distributed.init import resolve_dtype

    weights = resolve_dtype(name, device)
    if name != "auto" or device == "cuda":
        return weights, None
    if probe is None and os.environ.get(PROBE_ENV, "1") == "0":
        probe = lambda: False  # noqa: E731
    elif probe is None:
        probe = _probe_once if timer is None else functools.partial(bf16_is_faster, timer)
    return (torch.float32, torch.bfloat16) if agree_across_ranks(probe()) else (torch.float32, None)


def mixed_precision_policy(compute: torch.dtype | None):
    """FSDP2's ``MixedPrecisionPolicy`` computing in ``compute`` with fp32 gradient reduction (None: no policy)."""
    if compute is None:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)


def _matmul_loop(seconds: float, size: int, queue) -> None:
    torch.set_num_threads(1)
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm-up
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        n += 1
    queue.put(2 * size ** 3 * n / (time.perf_counter() - start))


def matmul_rate(processes: int, seconds: float = 2.0, size: int = 1024) -> float:
    """FLOP/s of ``processes`` one-thread processes multiplying fp32 ``size`` x ``size`` matrices at once (summed):
    the best rate ranks with that process/thread layout can reach (benchmarks/step_profile.py's reference)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_matmul_loop, args=(seconds, size, queue)) for _ in range(processes)]
    for p in procs:
        p.start()
    rates = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    return float(sum(rates))

"""The ``model.dtype=auto`` probe at the model's own matmul shapes: is bf16 faster for *this* model on this CPU?

A square 512 x 512 matmul (:func:`hybridflow.distributed.precision.time_matmul`) answers for large GEMMs only. On a
CPU with bf16 matrix units (AMX Xeon, 1 thread) it found bf16 7x faster and put every model in bf16, yet the
tiny-arith actor's packed update (the async recipe's trainer, 2 mini-batches of 32 sequences) took 0.146 s in bf16
against 0.117 s in fp32 (loads 1.1 / 1.4; 0.20-0.22 s against 0.12-0.13 s in runs whose load was not recorded):
py-spy put ~10 % of it in oneDNN building (JIT) bf16 kernels, one set for every new token count (packed rows and
response lengths change at every step), and the bf16 backward matmuls took ~10x the time of fp32's. At the ~25M
medium preset the same CPU ran the actor update 1.4x faster in bf16 (1.14 against 1.63 s) and its no-grad forwards
2.3x.

So the probe times the model's MLP matmuls (hidden x intermediate, both directions, plus the two weight-gradient
products of a trained model) at a token count not seen before in this process at every call, as training meets
them, fp32 and bf16 alternating, the fastest of :data:`_TIMED_CALLS` calls per dtype. Measured on that CPU: 0.35x
for the tiny-arith shape (128 x 384: fp32) and 2.9x for the medium preset (512 x 1536: bf16). It takes milliseconds.
Elementwise work and casts are not in it; :data:`hybridflow.distributed.precision.MIN_SPEEDUP` leaves room for them.
A probe running the model's whole training forward + backward was tried first and dropped: its timings differed 2x
between ranks while the other roles' workers started on the same cores, and the decision changed from run to run.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Callable, Optional

import torch

PROBE_TOKENS = 512  # about the tokens of a micro-batch
_TIMED_CALLS = 3  # timed calls per dtype, after one warm-up; the fastest counts (drops calls another process slowed)
_CALLS = itertools.count()  # every call gets a token count not used before in this process (a new shape)


def mlp_shape(module: Any) -> Optional[tuple[int, int]]:
    """``(hidden_size, intermediate_size)`` from ``module.config`` (a Hugging Face model, LoRA-wrapped or not;
    intermediate 4 x hidden when the config has none); None without a hidden size."""
    config = getattr(module, "config", None)
    hidden = getattr(config, "hidden_size", None)
    if not isinstance(hidden, int) or hidden <= 0:
        return None
    intermediate = getattr(config, "intermediate_size", None)
    return hidden, intermediate if isinstance(intermediate, int) and intermediate > 0 else 4 * hidden


def _mlp_matmuls(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, trained: bool) -> float:
    """Seconds of an MLP's matmuls on ``x`` (M, hidden): up (M, I), down (M, H); ``trained`` adds the backward's
    weight-gradient products (I, H) and (H, I) with the same operands."""
    start = time.perf_counter()
    y = x @ up.t()
    z = y @ down.t()
    if trained:
        z.t() @ y
        y.t() @ x
    return time.perf_counter() - start


def gemm_step_timer(hidden: int, intermediate: int, trained: bool,
                    tokens: int = PROBE_TOKENS) -> Callable[[torch.dtype], float]:
    """A timer for :func:`hybridflow.distributed.precision.bf16_is_faster`: ``timer(dtype)`` (fp32 or bf16) is the
    fastest of :data:`_TIMED_CALLS` runs of :func:`_mlp_matmuls` at (about ``tokens``, ``hidden``) x
    (``hidden``, ``intermediate``) in that dtype, each run at a token count new to this process. Both dtypes are
    measured at the first call, alternating; operands come from a generator of its own (torch's global RNG is left
    alone)."""
    measured: dict[torch.dtype, float] = {}

    def timer(dtype: torch.dtype) -> float:
        if not measured:
            measured.update(_measure(hidden, intermediate, trained, tokens))
        return measured[torch.float32 if dtype == torch.float32 else torch.bfloat16]

    return timer


def _measure(hidden: int, intermediate: int, trained: bool, tokens: int) -> dict[torch.dtype, float]:
    gen = torch.Generator().manual_seed(0)
    weights = {dtype: (torch.randn(intermediate, hidden, generator=gen).to(dtype),
                       torch.randn(hidden, intermediate, generator=gen).to(dtype))
               for dtype in (torch.float32, torch.bfloat16)}
    seconds = {dtype: float("inf") for dtype in weights}
    for call in range(1 + _TIMED_CALLS):  # call 0 warms up
        rows = max(1, tokens - 64 + 37 * next(_CALLS) % 128)
        x = torch.randn(rows, hidden, generator=gen)
        for dtype, (up, down) in weights.items():
            took = _mlp_matmuls(x.to(dtype), up, down, trained)
            if call:
                seconds[dtype] = min(seconds[dtype], took)
    return seconds


def model_step_timer(module: Any, trained: bool) -> Optional[Callable[[torch.dtype], float]]:
    """:func:`gemm_step_timer` at ``module``'s MLP shape (:func:`mlp_shape`); None when it has none (the caller
    then falls back to the square-matmul probe)."""
    shape = mlp_shape(module)
    return gemm_step_timer(*shape, trained=trained) if shape is not None else None

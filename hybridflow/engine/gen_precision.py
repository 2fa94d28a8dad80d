"""The 3D-HybridEngine's generation computes in the trainer's compute dtype.

With ``model.dtype=auto`` on CPU the fsdp2 engine may keep fp32 weights and compute in bf16 (a replicated model
forwards under ``torch.autocast``; a sharded one casts its parameters through FSDP2's mixed-precision policy;
:mod:`hybridflow.distributed.precision`). The generation model receives the fp32 weights, so without this it would
sample from the fp32 policy while the trainer takes logprobs (old, reference, and the update's) under the bf16 one:
``rollout/logprob_diff_max`` then measures the bf16-vs-fp32 gap of a whole forward (0.02-0.21 per step on
``vlm_grpo_quickstart``), not the rounding of one decode step against one forward.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, ContextManager

import torch


def generation_autocast(engine: Any) -> ContextManager:
    """A context for the generation forwards of ``engine`` (a :class:`~hybridflow.engine.HybridEngine`, or None
    for a rollout with its own copy of the weights): ``torch.autocast`` to the training engine's
    ``compute_dtype`` when that is a 16-bit dtype and the generation weights (``engine.dtype``) are not in it,
    else a no-op context."""
    if engine is None:
        return nullcontext()
    compute = getattr(engine.train_engine, "compute_dtype", None)
    if compute not in (torch.bfloat16, torch.float16) or compute == engine.dtype:
        return nullcontext()
    return torch.autocast(torch.device(engine.device).type, dtype=compute)

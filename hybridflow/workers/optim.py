"""Compatibility import: AdamW and the lr schedule moved to :mod:`hybridflow.training.optim` (the engines own the
optimizer)."""

from hybridflow.training.optim import build_lr_scheduler, build_optimizer, warmup_steps

__all__ = ["build_lr_scheduler", "build_optimizer", "warmup_steps"]

"""The learning-rate schedule of the actor and critic: linear warmup (first step above 0), then constant or cosine.
Expected values are worked out by hand from the documented formula, factor(s) = (s + 1) / (W + 1) for s < W."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from hybridflow.config.schema import OptimConfig
from hybridflow.workers.optim import build_lr_scheduler, build_optimizer


def _optim(**kwargs):
    return OmegaConf.structured(OptimConfig(**kwargs))


def _lrs(cfg, total, steps):
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=cfg.lr)
    sched = build_lr_scheduler(opt, cfg, total)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def test_first_warmup_step_has_a_positive_learning_rate():
    # W = 4 warmup steps, lr 1e-3: 1/5, 2/5, 3/5, 4/5 of the peak, then the peak
    lrs = _lrs(_optim(lr=1e-3, lr_warmup_steps=4), total=10, steps=6)
    assert lrs == pytest.approx([2e-4, 4e-4, 6e-4, 8e-4, 1e-3, 1e-3])


def test_first_adamw_step_under_warmup_moves_the_weights_by_the_warmup_lr():
    # AdamW's first step moves a parameter by lr * m_hat / sqrt(v_hat) = lr * g / |g| = lr (eps aside)
    module = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        module.weight.fill_(1.0)
    cfg = _optim(lr=1e-2, lr_warmup_steps_ratio=0.1)  # W = int(0.1 * 30) = 3: first lr = 1e-2 / 4
    opt = build_optimizer(module, cfg)
    build_lr_scheduler(opt, cfg, total_steps=30)
    module(torch.ones(1, 1)).sum().backward()  # d/dw (w * 1) = 1
    opt.step()
    assert module.weight.item() == pytest.approx(1.0 - 2.5e-3, abs=1e-8)


def test_cosine_after_warmup_by_hand():
    # W = 2, total 6, floor 0.1: warmup 1/3, 2/3; then 0.1 + 0.9 * 0.5 * (1 + cos(pi * (s - 2) / 4)) for s = 2..5
    lrs = _lrs(_optim(lr=1.0, lr_warmup_steps=2, lr_scheduler_type="cosine", min_lr_ratio=0.1), total=6, steps=6)
    cosine = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)]
    assert lrs == pytest.approx([1 / 3, 2 / 3, *cosine])
    assert cosine == pytest.approx([1.0, 0.1 + 0.45 * (1 + math.sqrt(0.5)), 0.55, 0.1 + 0.45 * (1 - math.sqrt(0.5))])


def test_no_warmup_starts_at_the_peak():
    assert _lrs(_optim(lr=3e-4), total=5, steps=2) == pytest.approx([3e-4, 3e-4])

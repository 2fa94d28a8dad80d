"""Checkpoints load without unpickling code: per-rank extra state (lr schedule, RNG), the driver's trainer state
and the export's full weights all load with ``torch.load(weights_only=True)``, and the package never calls
``torch.load`` any other way."""

import ast
import os
import random
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import hybridflow
from hybridflow.algorithms.kl import AdaptiveKLController
from hybridflow.distributed.checkpoint import load_sharded, save_sharded
from hybridflow.trainer.checkpoint import STATE_FILE, CheckpointManager, load_trainer_state
from hybridflow.workers.optim import build_lr_scheduler

PACKAGE = Path(hybridflow.__file__).resolve().parent


class _Optim:  # the fields build_lr_scheduler reads
    lr_warmup_steps, lr_warmup_steps_ratio, lr_scheduler_type, min_lr_ratio = 2, 0.0, "cosine", 0.1


def _trained(seed: int):
    torch.manual_seed(seed)
    module = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    scheduler = build_lr_scheduler(optimizer, _Optim, total_steps=10)
    module(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    return module, optimizer, scheduler


def _draws():
    return random.random(), float(np.random.rand()), torch.rand(3).tolist(), float(np.random.randn())


def test_sharded_extra_state_loads_weights_only_and_restores_rng(tmp_path):
    module, optimizer, scheduler = _trained(0)
    np.random.randn()  # leave a cached gaussian in numpy's legacy state (has_gauss=1)
    save_sharded(str(tmp_path), module, optimizer, {"lr_scheduler": scheduler.state_dict(), "skipped_steps": 3})
    expected = _draws()  # what the RNGs give right after the save
    extra = torch.load(tmp_path / "extra_rank_0.pt", weights_only=True)  # no pickled code, no numpy objects
    assert extra["skipped_steps"] == 3
    random.seed(7), np.random.seed(7), torch.manual_seed(7)  # move every RNG elsewhere
    fresh, fresh_opt, fresh_sched = _trained(1)
    loaded = load_sharded(str(tmp_path), fresh, fresh_opt)
    assert _draws() == expected
    fresh_sched.load_state_dict(loaded["lr_scheduler"])
    assert fresh_sched.get_last_lr() == scheduler.get_last_lr()
    for a, b in zip(module.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    # the export path: the whole checkpoint as one torch file, read back weights-only
    full = tmp_path / "full.pt"
    dcp_to_torch_save(str(tmp_path), str(full))
    assert torch.equal(torch.load(full, weights_only=True)["model"]["weight"], module.weight)


def test_trainer_state_loads_weights_only(tmp_path):
    kl = AdaptiveKLController(init_kl_coef=0.2, target_kl=0.1, horizon=100)
    kl.update(0.3, n_steps=8)
    state = {"global_step": 5, "kl_ctrl": kl.state_dict(), "lagrange": {"log_lambda": -0.5, "costs": [1.0, 0.0]}}
    path = CheckpointManager(str(tmp_path)).save(5, {"actor": os.makedirs}, state)
    assert torch.load(os.path.join(path, STATE_FILE), weights_only=True) == state
    assert load_trainer_state(path) == state


def _torch_load_calls(source: str):
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load" \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch":
            yield node


def test_package_loads_torch_files_weights_only():
    unsafe = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for call in _torch_load_calls(path.read_text()):
            flag = {k.arg: k.value for k in call.keywords}.get("weights_only")
            if not (isinstance(flag, ast.Constant) and flag.value is True):
                unsafe.append(f"{path.relative_to(PACKAGE.parent)}:{call.lineno}")
    assert not unsafe, f"torch.load without weights_only=True: {unsafe}"

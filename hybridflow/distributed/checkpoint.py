"""Sharded checkpoints of an FSDP2 module + optimizer (``torch.distributed.checkpoint``), plus per-rank state
(lr scheduler, RNG). Every rank of the group calls these together; each writes only its own shards.

The per-rank file holds only tensors, dicts, lists, tuples and primitive values, so it loads with
``torch.load(weights_only=True)``: a checkpoint from someone else cannot run code when it is loaded."""

from __future__ import annotations

import os
import random
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def rng_state() -> dict[str, Any]:
    """The RNG states of this process (python, numpy, torch CPU, and CUDA when present), in types that
    ``torch.load(weights_only=True)`` accepts: numpy's MT19937 key (624 uint32) becomes an int64 tensor."""
    kind, key, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = {"kind": str(kind), "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
                   "has_gauss": int(has_gauss), "gauss": float(gauss)}
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_sharded(path: str, module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer],
                 extra: dict[str, Any]) -> None:
    """Write ``module`` (and ``optimizer``) shards under ``path`` and this rank's ``extra`` to
    ``path/extra_rank_<r>.pt`` (``extra`` should hold the lr scheduler state; the RNG state is added)."""
    os.makedirs(path, exist_ok=True)
    if optimizer is None:
        state = {"model": get_state_dict(module, [])[0]}
    else:
        model_sd, optim_sd = get_state_dict(module, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    dcp.save(state, checkpoint_id=path)
    torch.save({**extra, "rng": rng_state()}, os.path.join(path, f"extra_rank_{_rank()}.pt"))


def load_sharded(path: str, module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> dict[str, Any]:
    """Load what :func:`save_sharded` wrote into ``module``/``optimizer`` (same world size) and restore this
    rank's RNG; returns this rank's ``extra`` dict.

    Raises:
        FileNotFoundError: ``path`` holds no checkpoint for this rank.
    """
    extra_path = os.path.join(path, f"extra_rank_{_rank()}.pt")
    if not os.path.exists(extra_path):
        raise FileNotFoundError(f"no checkpoint for rank {_rank()} under {path!r} (missing {extra_path})")
    if optimizer is None:
        state = {"model": get_state_dict(module, [])[0]}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(module, [], model_state_dict=state["model"], optim_state_dict={})
    else:
        model_sd, optim_sd = get_state_dict(module, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    extra = torch.load(extra_path, weights_only=True)
    set_rng_state(extra.pop("rng"))
    return extra

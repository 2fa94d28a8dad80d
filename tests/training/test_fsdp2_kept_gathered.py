"""``fsdp_config.reshard_after_forward=false`` on 2 gloo ranks: a no-grad forward leaves each unit's gathered
weights in place (plain, unsharded parameters until the next reshard); a checkpoint saved and loaded in that state
must still be the sharded weights, and the forward after the load must see the loaded weights, not a stale gathered
copy. Checked against the forward of the weights that were saved."""

from __future__ import annotations

import os

import torch

from hybridflow.distributed.launch import spawn_ranks
from hybridflow.config.schema import OptimConfig
from hybridflow.distributed import apply_fsdp2, build_mesh
from hybridflow.training import FSDP2Engine
from hybridflow.training.optim import build_optimizer
from test_engine_contract import _micro, _model


def _logprobs(engine: FSDP2Engine) -> torch.Tensor:
    with torch.no_grad():
        return engine.forward(_micro())["log_probs"]


def _rank(rank: int, out: str) -> None:
    model = apply_fsdp2(_model(), build_mesh(dp=2), reshard_after_forward=False)
    engine = FSDP2Engine.from_module(model, build_optimizer(model, OptimConfig(lr=0.05)), mesh=build_mesh(dp=2))
    saved = _logprobs(engine)  # leaves the gathered weights in place
    engine.save_checkpoint(os.path.join(out, "ckpt"))
    engine.zero_grad()
    engine.forward_backward(_micro(), lambda o: -o["log_probs"].mean())
    engine.optimizer_step()
    moved = _logprobs(engine)  # gathered again, from the updated shards
    engine.load_checkpoint(os.path.join(out, "ckpt"))
    restored = _logprobs(engine)
    if rank == 0:
        torch.save({"saved": saved, "moved": moved, "restored": restored}, os.path.join(out, "result.pt"))


def test_checkpoint_load_is_seen_by_the_next_forward(tmp_path):
    spawn_ranks(_rank, str(tmp_path))
    res = torch.load(tmp_path / "result.pt")
    assert (res["moved"] - res["saved"]).abs().max() > 1e-4  # the update changed the policy
    torch.testing.assert_close(res["restored"], res["saved"], rtol=0, atol=0)

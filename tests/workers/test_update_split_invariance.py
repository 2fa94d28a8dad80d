"""The applied gradient of a PPO mini-batch does not depend on how it is split: not over micro-batches, not
over data-parallel ranks (2 gloo ranks with FSDP2), for every loss aggregation mode.

Reference: one process, no FSDP, the whole mini-batch in one micro-batch. Optimizer: SGD with lr 1 and no
clipping, so the weight change IS the gradient (Adam would hide differences by normalising them).
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf
from transformers import LlamaConfig, LlamaForCausalLM

from hybridflow.config.schema import ActorConfig
from hybridflow.distributed import apply_fsdp2, build_mesh, iter_full_state
from hybridflow.algorithms.sampling import SamplingSpec
from hybridflow.protocol import DataProto
from hybridflow.workers.ppo_actor import PPOActor

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
B, P, R, V = 8, 3, 5, 32


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg)


def _batch() -> DataProto:
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([1, 5, 3, 2, 4, 5, 1, 3])  # different valid lengths per row
    response_mask = (torch.arange(R)[None, :] < lengths[:, None]).long()
    input_ids = torch.randint(0, V, (B, P + R), generator=g)
    attention_mask = torch.cat([torch.ones(B, P, dtype=torch.long), response_mask], dim=1)
    return DataProto.from_dict(tensors={
        "input_ids": input_ids, "responses": input_ids[:, P:], "attention_mask": attention_mask,
        "position_ids": torch.arange(P + R).expand(B, -1).clone(), "response_mask": response_mask,
        # old logprobs shifted away from the current ones so some tokens are clipped
        "old_log_probs": -torch.rand(B, R, generator=g) * 4, "advantages": torch.randn(B, R, generator=g),
    })


def _config(mode: str, micro: int):
    cfg = OmegaConf.structured(ActorConfig)
    cfg.loss_agg_mode, cfg.ppo_micro_batch_size_per_gpu, cfg.grad_clip = mode, micro, 1e9
    cfg.entropy_coeff = 0.01  # the entropy term is aggregated with the same normalisers
    return cfg


def _delta(actor: PPOActor, data: DataProto, mini: int) -> dict[str, torch.Tensor]:
    before = {k: v.clone() for k, v in iter_full_state(actor.module)}
    actor.update_policy(data, mini_batch_size=mini)
    return {k: before[k] - v for k, v in iter_full_state(actor.module)}


def _reference(mode: str) -> dict[str, torch.Tensor]:
    model = _model()
    actor = PPOActor(model, torch.optim.SGD(model.parameters(), lr=1.0), _config(mode, B), SamplingSpec())
    return _delta(actor, _batch(), B)


MICROS = (1, 4)


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = build_mesh(dp=2)
    deltas = {}
    for mode in MODES:
        for micro in MICROS:
            model = apply_fsdp2(_model(), mesh)
            optim = torch.optim.SGD(model.parameters(), lr=1.0)
            actor = PPOActor(model, optim, _config(mode, micro), SamplingSpec())
            deltas[mode, micro] = _delta(actor, _batch().chunk(2)[rank], B // 2)
    if rank == 0:
        torch.save(deltas, out)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def dp_deltas(tmp_path_factory):
    """Weight changes from 2 gloo ranks (FSDP2), for every mode and micro-batch size, in one spawn."""
    out = str(tmp_path_factory.mktemp("dp") / "deltas.pt")
    mp.spawn(_worker, args=(_free_port(), out), nprocs=2, join=True)
    return torch.load(out)


@pytest.mark.parametrize("mode", MODES)
def test_gradient_independent_of_micro_and_dp_split(mode, dp_deltas):
    ref = _reference(mode)
    single_micro = _model()
    actor = PPOActor(single_micro, torch.optim.SGD(single_micro.parameters(), lr=1.0), _config(mode, 3), SamplingSpec())
    micro_split = _delta(actor, _batch(), B)  # micro-batches of 3, 3, 2 in one process
    for name in ref:
        torch.testing.assert_close(micro_split[name], ref[name], atol=1e-6, rtol=0)
    assert max(v.abs().max() for v in ref.values()) > 1e-4  # the test is not vacuous
    for micro in MICROS:
        dist_delta = dp_deltas[mode, micro]
        for name in ref:
            torch.testing.assert_close(dist_delta[name], ref[name], atol=1e-6, rtol=0, msg=f"{mode} micro={micro} {name}")

"""The runs the packed-path equality tests compare on 2 gloo ranks: one actor or critic forward and one SGD update
of an FSDP2 model, padded or packed, with fixed or token-budget micro-batches; and the check that every packed
variant equals the padded, fixed-size one."""

from __future__ import annotations

from typing import Callable

import torch
from omegaconf import OmegaConf

from hybridflow.algorithms.sampling import SamplingSpec
from hybridflow.config.schema import ActorConfig, CriticConfig
from hybridflow.distributed import apply_fsdp2, build_mesh, iter_full_state
from hybridflow.protocol import DataProto
from hybridflow.workers.ppo_actor import PPOActor
from hybridflow.workers.ppo_critic import PPOCritic

Key = tuple[str, bool, bool]  # (role, packed, dynamic)


def forward_and_update(model, role: str, data: DataProto, packed: bool, dynamic: bool, micro: int,
                       forward_micro: int, max_token_len: int, entropy_coeff: float = 0.0):
    """(logprobs or values (B, R) before the update, the weight change of one SGD step at lr 1 over ``data``)."""
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    cfg = OmegaConf.structured(ActorConfig if role == "actor" else CriticConfig)
    cfg.ppo_micro_batch_size_per_gpu, cfg.grad_clip = micro, 1e9
    cfg.use_dynamic_bsz, cfg.ppo_max_token_len_per_gpu = dynamic, max_token_len
    if role == "actor":
        cfg.entropy_coeff = entropy_coeff
        worker = PPOActor(model, opt, cfg, SamplingSpec(), use_remove_padding=packed)
        out = worker.compute_log_prob(data, forward_micro, max_token_len=max_token_len)[0]
        update = worker.update_policy
    else:
        worker = PPOCritic(model, opt, cfg, use_remove_padding=packed)
        out = worker.compute_values(data, forward_micro, max_token_len=max_token_len)
        update = worker.update_critic
    before = {k: v.clone() for k, v in iter_full_state(model)}
    update(data, mini_batch_size=len(data))
    return out, {k: before[k] - v for k, v in iter_full_state(model)}


def all_variants(rank: int, makers: dict[str, Callable], batch: DataProto, **run_kw) -> dict[Key, tuple]:
    """This rank's half of ``batch`` through :func:`forward_and_update` for every (role, packed, dynamic), each on
    a fresh FSDP2 model over dp=2 (``makers``: role -> a model factory with a fixed seed)."""
    mesh = build_mesh(dp=2)
    return {(role, packed, dynamic): forward_and_update(apply_fsdp2(make(), mesh), role, batch.chunk(2)[rank],
                                                        packed, dynamic, **run_kw)
            for role, make in makers.items() for packed in (False, True) for dynamic in (False, True)}


def assert_variants_equal_padded(per_rank: list[dict[Key, tuple]], mask: torch.Tensor,
                                 variants: list[tuple[bool, bool]]) -> None:
    """Each (packed, dynamic) variant's outputs (under ``mask``, 1e-5) and weight changes (1e-6) equal the padded,
    fixed-size run's, for both roles; the padded update must change the weights (not vacuous)."""
    for role in ("actor", "critic"):
        ref_out = torch.cat([r[role, False, False][0] for r in per_rank])
        ref_delta = per_rank[0][role, False, False][1]
        assert max(d.abs().max() for d in ref_delta.values()) > 1e-4  # not vacuous
        for packed, dynamic in variants:
            tag = f"{role} packed={packed} dynamic={dynamic}"
            got = torch.cat([r[role, packed, dynamic][0] for r in per_rank])
            torch.testing.assert_close(got[mask], ref_out[mask], atol=1e-5, rtol=0, msg=tag)
            for r in per_rank:
                for name, d in r[role, packed, dynamic][1].items():
                    torch.testing.assert_close(d, ref_delta[name], atol=1e-6, rtol=0, msg=f"{tag} {name}")

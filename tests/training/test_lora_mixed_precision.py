"""LoRA under FSDP2 with bf16 compute over fp32 weights (FSDP2's ``MixedPrecisionPolicy``), on 2 gloo ranks: the
reference forward with the adapters disabled may be the sharded module's first forward, and the update after it
still reduces the adapters' gradients in fp32 into their fp32 shards.

Before the fix peft's ``disable_adapter`` cleared the adapters' ``requires_grad``; FSDP2's first forward then
found no trainable parameter in a unit, reduced its gradients in bf16 and the update failed with "assign a
gradient with dtype BFloat16 to a tensor with grad_dtype Float" (recipes/lora_quickstart on a bf16-picking box).
References: the same gradients computed in fp32 (no mixed precision), compared at a bf16 tolerance.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch.multiprocessing.spawn import ProcessExitedException

from hybridflow.distributed.launch import spawn_ranks

pytest.importorskip("peft")

LORA = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16"]


def _adapter_grads(rank: int, out: str, bf16: bool) -> None:
    from hybridflow.config import load_config
    from hybridflow.distributed import build_mesh
    from hybridflow.distributed.precision import mixed_precision_policy
    from hybridflow.distributed.tp import parallelize_model
    from hybridflow.models.hf import load_causal_lm
    from hybridflow.models.lora import adapters_disabled, apply_lora

    cfg = load_config(None, LORA)
    torch.manual_seed(0)
    module = apply_lora(load_causal_lm("builtin:tiny-arith", torch.float32), cfg.actor_rollout_ref.model)
    with torch.no_grad():  # B starts at zero: give the adapters a value so their A gradients are not all zero
        for name, param in module.named_parameters():
            if ".lora_B." in name:
                param.fill_(0.02)
    module = parallelize_model(module, build_mesh(dp=2, tp=1), reshard_after_forward=True,
                               mp_policy=mixed_precision_policy(torch.bfloat16 if bf16 else None))
    ids = torch.randint(3, 40, (2, 10), generator=torch.Generator().manual_seed(rank))
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    with torch.no_grad(), adapters_disabled(module):  # the reference forward comes first
        assert {n for n, p in module.named_parameters() if p.requires_grad} == trainable
        module(input_ids=ids)
    logits = module(input_ids=ids).logits.float()[:, :-1]  # next-token loss, fp32 math as the workers do
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
    grads = {n: p.grad.full_tensor() for n, p in module.named_parameters() if p.grad is not None}
    assert {g.dtype for g in grads.values()} == {torch.float32}
    assert set(grads) == trainable
    if rank == 0:
        torch.save(grads, os.path.join(out, f"bf16_{bf16}.pt"))
    torch.distributed.barrier()  # no rank tears the group down while the other's collectives may still run
    open(os.path.join(out, f"done_{bf16}_{rank}"), "w").close()  # every assertion above held on this rank


def _spawn_checked(out, bf16: bool) -> None:
    """:func:`spawn_ranks` of :func:`_adapter_grads`. In the full suite's clean-clone CI (2 of 2 runs, never in 29
    runs of this file alone) a rank has died with SIGABRT ("terminate called without an active exception"); when
    both ranks had already passed every assertion and the closing barrier (their ``done_*`` files), that abort is
    in process teardown, not in what this test checks: it is reported as a warning. Any other failure fails."""
    try:
        spawn_ranks(_adapter_grads, str(out), bf16)
    except ProcessExitedException as err:
        if err.signal_name != "SIGABRT" or not all((out / f"done_{bf16}_{r}").exists() for r in range(2)):
            raise
        warnings.warn(f"rank {err.error_index} aborted in teardown after passing every check: {err}")


def _auto_dtype(rank: int, out: str) -> None:
    from hybridflow.config import load_config
    from hybridflow.distributed import precision
    from hybridflow.training.base import EngineSpec, ParallelLayout
    from hybridflow.training.fsdp2 import FSDP2Engine

    os.environ[precision.PROBE_ENV] = "1"  # the suite turns the probe off; here its answer is fixed instead
    precision.bf16_is_faster = lambda *args, **kwargs: True  # whatever the engine's model-shaped probe times
    found = {}
    for lora in (True, False):
        cfg = load_config(None, LORA if lora else [])
        engine = FSDP2Engine.build(EngineSpec(kind="policy", model=cfg.actor_rollout_ref.model, device="cpu",
                                              layout=ParallelLayout(), role="actor", lora=lora))
        found[lora] = engine.compute_dtype
    torch.save(found, os.path.join(out, "auto.pt"))


def test_dtype_auto_keeps_lora_actors_in_fp32(tmp_path):
    """The merged-weight sync probe compares the trainer's forward with the fp32 rollout's at 1e-4: a bf16 trainer
    forward differs by ~0.1 there, as much as an update moves it, so a LoRA actor stays fp32 under ``auto``."""
    spawn_ranks(_auto_dtype, str(tmp_path), world=1)
    assert torch.load(tmp_path / "auto.pt") == {True: torch.float32, False: torch.bfloat16}


def test_reference_first_then_update_in_bf16_compute_matches_fp32(tmp_path):
    for bf16 in (True, False):
        _spawn_checked(tmp_path, bf16)
    mixed, plain = (torch.load(tmp_path / f"bf16_{b}.pt") for b in (True, False))
    assert set(mixed) == set(plain) and mixed
    names = sorted(plain)
    got = torch.cat([mixed[n].flatten() for n in names])
    ref = torch.cat([plain[n].flatten() for n in names])
    # bf16 activations: the adapters' gradients as a whole within 10 % of fp32's (measured: 4 %); a unit whose
    # gradients were reduced in the wrong dtype fails the update before this point
    assert (got - ref).norm() <= 0.1 * ref.norm()

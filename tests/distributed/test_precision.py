"""model.dtype=auto (hybridflow/distributed/precision.py): the probe's decision from stubbed timings, the dtypes it
leads to, the env switch the suite uses, agreement across 2 gloo ranks, and an FSDP2 mixed-precision model that
keeps fp32 weights and gradients while computing in bf16."""


import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hybridflow.distributed import apply_fsdp2, build_mesh
from hybridflow.distributed import precision
from hybridflow.distributed.launch import spawn_ranks
from hybridflow.distributed.precision import (agree_across_ranks, bf16_is_faster, mixed_precision_policy,
                                              training_dtypes)


def _timer(fp32: float, bf16: float):
    return lambda dtype: {torch.float32: fp32, torch.bfloat16: bf16}[dtype]


@pytest.mark.parametrize("fp32, bf16, expected", [
    (1.0, 0.25, True),  # 4x faster (an AMX chip)
    (1.0, 1 / 1.2, True),  # exactly the minimum speedup
    (1.0, 0.9, False),  # 1.11x: within noise and cast costs
    (1.0, 400.0, False),  # no bf16 units: ~400x slower
])
def test_probe_decision_from_stubbed_timings(fp32, bf16, expected):
    assert bf16_is_faster(_timer(fp32, bf16)) is expected


def test_probe_leaves_the_global_rng_alone():
    """The probe runs inside an engine's build, after the role's seed and before a fresh value head is
    initialised: drawing from torch's global RNG there would change the critic's initial weights (and the run)."""
    torch.manual_seed(123)
    expected = torch.randn(4)
    torch.manual_seed(123)
    precision.time_matmul(torch.float32, size=16, repeats=1)
    assert torch.equal(torch.randn(4), expected)


def test_auto_dtypes_follow_the_probe_and_explicit_dtypes_never_probe(monkeypatch):
    assert training_dtypes("auto", "cpu", probe=lambda: True) == (torch.float32, torch.bfloat16)
    assert training_dtypes("auto", "cpu", probe=lambda: False) == (torch.float32, None)

    def no_probe():
        raise AssertionError("probed")

    assert training_dtypes("float32", "cpu", probe=no_probe) == (torch.float32, None)
    assert training_dtypes("bfloat16", "cpu", probe=no_probe) == (torch.bfloat16, None)
    assert training_dtypes("auto", "cuda", probe=no_probe) == (torch.bfloat16, None)
    monkeypatch.setenv(precision.PROBE_ENV, "0")
    monkeypatch.setattr(precision, "_probe_once", no_probe)
    assert training_dtypes("auto", "cpu") == (torch.float32, None)
    assert mixed_precision_policy(None) is None
    assert mixed_precision_policy(torch.bfloat16).param_dtype == torch.bfloat16


def _worker(rank: int, out: str) -> None:
    result = {"agree_mixed": agree_across_ranks(rank == 0), "agree_all": agree_across_ranks(True),
              "dtypes": training_dtypes("auto", "cpu", probe=lambda: rank == 1)}
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    model = apply_fsdp2(model, build_mesh(dp=2), mp_policy=mixed_precision_policy(torch.bfloat16))
    logits = model(input_ids=torch.randint(0, 32, (2, 5)), use_cache=False).logits
    logits.float().logsumexp(-1).mean().backward()
    result["logits_dtype"] = logits.dtype
    result["param_dtypes"] = {p.dtype for p in model.parameters()}
    result["grad_dtypes"] = {p.grad.dtype for p in model.parameters() if p.grad is not None}
    torch.save(result, f"{out}.{rank}")


def test_ranks_agree_and_mixed_precision_keeps_fp32_master_weights(tmp_path):
    out = str(tmp_path / "res")
    spawn_ranks(_worker, out)
    for rank in range(2):
        res = torch.load(f"{out}.{rank}")
        assert res["agree_mixed"] is False and res["agree_all"] is True
        assert res["dtypes"] == (torch.float32, None)  # rank 1's probe chose bf16, rank 0's did not: fp32 on both
        assert res["logits_dtype"] == torch.bfloat16
        assert res["param_dtypes"] == {torch.float32} and res["grad_dtypes"] == {torch.float32}

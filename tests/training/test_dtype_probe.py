"""The model-shaped ``dtype=auto`` probe (hybridflow/training/dtype_probe.py): the MLP shape it reads from a model,
the matmuls it times (shapes and count checked by hand with a stub), a new token count at every call, the fastest
call per dtype, the global RNG left alone, and ``training_dtypes`` using it unless the suite's env switch turns
probing off."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hybridflow.distributed import precision
from hybridflow.distributed.precision import training_dtypes
from hybridflow.training import dtype_probe
from hybridflow.training.dtype_probe import gemm_step_timer, mlp_shape, model_step_timer


def _lm(intermediate: int = 96) -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=intermediate,
                                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))


def test_the_mlp_shape_comes_from_the_config():
    assert mlp_shape(_lm(96)) == (32, 96)
    assert mlp_shape(SimpleNamespace(config=SimpleNamespace(hidden_size=32))) == (32, 128)  # none: 4 x hidden
    assert mlp_shape(torch.nn.Linear(2, 2)) is None and model_step_timer(torch.nn.Linear(2, 2), True) is None
    assert model_step_timer(_lm(96), trained=True) is not None


def test_the_timer_times_the_mlp_matmuls_at_new_shapes_and_keeps_the_fastest(monkeypatch):
    seen = []
    times = {torch.float32: iter([9.0, 0.050, 0.040, 0.045]), torch.bfloat16: iter([9.0, 0.500, 0.030, 0.035])}

    def fake(x, up, down, trained):
        seen.append((x.dtype, tuple(x.shape), tuple(up.shape), tuple(down.shape), up.dtype, trained))
        return next(times[x.dtype])

    monkeypatch.setattr(dtype_probe, "_mlp_matmuls", fake)
    timer = gemm_step_timer(64, 192, trained=True, tokens=512)
    assert not seen  # nothing runs until the timer is asked
    assert timer(torch.float32) == 0.040 and timer(torch.bfloat16) == 0.030  # the warm-up (9.0) and 0.5 are dropped
    assert len(seen) == 2 * (1 + dtype_probe._TIMED_CALLS)
    assert [s[0] for s in seen] == [torch.float32, torch.bfloat16] * 4  # alternating, same rows for both
    assert all(s[2] == (192, 64) and s[3] == (64, 192) and s[4] == s[0] and s[5] for s in seen)
    rows = [s[1][0] for s in seen[::2]]
    assert all(s[1] == (r, 64) for s, r in zip(seen[1::2], rows)) and len(set(rows)) == len(rows)
    assert all(448 <= r < 576 for r in rows)  # about the token budget
    later = gemm_step_timer(64, 192, trained=True, tokens=512)
    times.update({d: iter([1.0] * 4) for d in times})
    later(torch.float32)
    assert not set(s[1][0] for s in seen[8::2]) & set(rows)  # the next probe in the process: other shapes again
    assert precision.bf16_is_faster(timer) is True  # 0.040 / 0.030 = 1.33x >= 1.2x


def test_the_mlp_matmuls_run_on_their_operands():
    x, up, down = torch.randn(5, 4), torch.randn(6, 4), torch.randn(4, 6)
    assert dtype_probe._mlp_matmuls(x, up, down, trained=True) > 0
    assert dtype_probe._mlp_matmuls(x, up, down, trained=False) > 0
    with pytest.raises(RuntimeError):  # (5, 4) @ (4, 6)^T: the operands are really multiplied
        dtype_probe._mlp_matmuls(x, up.t(), down, trained=False)


def test_a_real_probe_leaves_the_global_rng_alone():
    torch.manual_seed(7)
    expected = torch.randn(3)
    torch.manual_seed(7)
    timer = gemm_step_timer(32, 64, trained=False, tokens=128)
    assert timer(torch.float32) > 0 and timer(torch.bfloat16) > 0
    assert torch.equal(torch.randn(3), expected)


def test_training_dtypes_uses_the_timer_unless_probing_is_off(monkeypatch):
    fast = {torch.float32: 2.0, torch.bfloat16: 1.0}
    slow = {torch.float32: 1.0, torch.bfloat16: 1.0}
    monkeypatch.setenv(precision.PROBE_ENV, "1")
    assert training_dtypes("auto", "cpu", timer=fast.__getitem__) == (torch.float32, torch.bfloat16)
    assert training_dtypes("auto", "cpu", timer=slow.__getitem__) == (torch.float32, None)

    def never(dtype):
        raise AssertionError("timed")

    assert training_dtypes("float32", "cpu", timer=never) == (torch.float32, None)
    assert training_dtypes("auto", "cpu", probe=lambda: False, timer=never) == (torch.float32, None)
    monkeypatch.setenv(precision.PROBE_ENV, "0")
    assert training_dtypes("auto", "cpu", timer=never) == (torch.float32, None)

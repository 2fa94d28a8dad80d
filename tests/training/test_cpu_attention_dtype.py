"""bf16 training attention on CPU runs in fp32 when autograd will differentiate it (hybridflow/training/packing.py
``upcast_for_cpu_backward``): torch's CPU flash-attention backward is several times slower in bf16 than in fp32.

Checked here: which dtype SDPA receives (fp32 with grad, the autocast dtype without: reference/old-logprob forwards
and generation are untouched); the gradients stay those of the model (against an fp32 reference, within bf16
rounding, no worse than plain bf16 sdpa); modules on other attention implementations are left alone; the fsdp2
engine switches a bf16 model on CPU, and not an fp32 one (1 gloo rank)."""

from __future__ import annotations

import os

import torch
from omegaconf import OmegaConf
from transformers import LlamaConfig, LlamaForCausalLM

from hybridflow.distributed.launch import spawn_ranks
from hybridflow.training.packing import VARLEN_ATTENTION, use_fp32_attention_backward

V = 64


def _lm(attn: str = "sdpa") -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation=attn)
    return LlamaForCausalLM(config)


def _ids() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, :4] = 0  # a left-padded row: the masked path
    return torch.randint(1, V, (3, 12), generator=g), mask


def _loss(model, autocast: bool) -> torch.Tensor:
    ids, mask = _ids()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    return torch.log_softmax(logits.float(), -1)[mask.bool()].gather(-1, ids[mask.bool()][:, None]).mean()


def _sdpa_dtypes(monkeypatch) -> list[torch.dtype]:
    """The dtype each SDPA call computes in: its query's, or autocast's when autocast is on (it casts inside)."""
    seen: list[torch.dtype] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, *args, **kwargs):
        seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else q.dtype)
        return real(q, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return seen


def test_grad_forwards_attend_in_fp32_and_no_grad_forwards_keep_bf16(monkeypatch):
    model = _lm()
    assert use_fp32_attention_backward(model) and model.config._attn_implementation == VARLEN_ATTENTION
    seen = _sdpa_dtypes(monkeypatch)
    _loss(model, autocast=True)
    assert seen == [torch.float32] * 2  # one call per layer, computed in fp32
    seen.clear()
    with torch.no_grad():
        _loss(model, autocast=True)
    assert seen == [torch.bfloat16] * 2  # nothing to differentiate: autocast's bf16 as before
    seen.clear()
    plain = _lm()
    _loss(plain, autocast=True)
    assert seen == [torch.bfloat16] * 2  # a module that was not switched: plain sdpa under autocast
    seen.clear()
    _loss(model.to(torch.bfloat16), autocast=False)  # bf16 weights, no autocast
    assert seen == [torch.float32] * 2


def test_gradients_match_fp32_within_bf16_rounding():
    reference = _lm()
    _loss(reference, autocast=False).backward()
    plain, switched = _lm(), _lm()
    use_fp32_attention_backward(switched)
    _loss(plain, autocast=True).backward()
    _loss(switched, autocast=True).backward()
    for (name, ref), p, s in zip(reference.named_parameters(), plain.parameters(), switched.parameters()):
        scale = ref.grad.abs().max().item() + 1e-12
        err_switched = (s.grad - ref.grad).abs().max().item() / scale
        err_plain = (p.grad - ref.grad).abs().max().item() / scale
        assert err_switched < 0.05, name  # bf16 has 8 mantissa bits: a few % of the largest entry
        assert err_switched <= err_plain * 1.5 + 1e-3, name  # fp32 attention is no less exact than bf16


def test_other_attention_implementations_are_left_alone():
    model = _lm("eager")
    assert not use_fp32_attention_backward(model)
    assert model.config._attn_implementation == "eager"


def _build(rank: int, out: str) -> None:
    from hybridflow.training import FSDP2Engine
    from hybridflow.training.base import EngineSpec, ParallelLayout

    found = {}
    for dtype in ("bfloat16", "float32"):
        model = OmegaConf.create({"path": "builtin:tiny-arith", "dtype": dtype, "trust_remote_code": False,
                                  "enable_gradient_checkpointing": False})
        engine = FSDP2Engine.build(EngineSpec(kind="policy", model=model, layout=ParallelLayout(), device="cpu",
                                              optim=None, role="actor"))
        found[dtype] = engine.module.config._attn_implementation
    torch.save(found, os.path.join(out, "attn.pt"))


def test_fsdp2_engine_switches_bf16_models_on_cpu_only(tmp_path):
    spawn_ranks(_build, str(tmp_path), world=1)
    found = torch.load(tmp_path / "attn.pt")
    assert found == {"bfloat16": VARLEN_ATTENTION, "float32": "sdpa"}

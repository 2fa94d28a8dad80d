"""Checks shared by the Megatron model tests (they need the ``megatron_1rank`` fixture's process group)."""

from __future__ import annotations

import torch


def assert_gpt_logits_equal_hf(hf: torch.nn.Module, kind: str) -> None:
    """Build a one-rank megatron-core GPTModel of ``kind`` ("policy" / "value") from ``hf``'s config, load ``hf``'s
    weights into it and assert its logits on a fixed (2, 7) batch equal ``hf``'s (fp32, <= 1e-5)."""
    from hybridflow.models.megatron_model import build_gpt_model, load_local_state, local_state_from_hf
    from hybridflow.training.megatron_cpu import cpu_adapter

    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    with cpu_adapter("cpu"), torch.no_grad():
        mg = build_gpt_model(hf.config, kind, tp=1, pp=1, pp_rank=0, dtype=torch.float32, device="cpu")
        load_local_state(mg, local_state_from_hf(dict(hf.named_parameters()), hf.config, kind, tp=1,
                                                 tp_rank=0, pp=1, pp_rank=0))
        mg.eval()
        got = mg(ids, torch.arange(7).expand(2, 7), None)
        want = hf(input_ids=ids).logits
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)

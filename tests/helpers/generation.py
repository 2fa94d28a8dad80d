"""Greedy generation fixtures shared by the 3D-HybridEngine tests (tests/engine/test_hybrid_engine.py,
tests/engine/test_reshard_3d.py): one left-padded prompt batch and a greedy hf rollout over a given module."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from hybridflow.protocol import DataProto
from hybridflow.rollout import HFRollout

LENGTHS = (6, 3, 5, 2, 4, 6, 1, 5)  # prompt lengths: padding in most rows, one row of a single token


def left_padded_prompts(prompt_len: int, vocab: int, seed: int = 3) -> DataProto:
    """``len(LENGTHS)`` prompts of ``prompt_len`` tokens, left-padded with id 0 (ids drawn from [1, vocab))."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(LENGTHS)
    mask = (torch.arange(prompt_len)[None, :] >= (prompt_len - lengths)[:, None]).long()
    ids = torch.randint(1, vocab, (len(LENGTHS), prompt_len), generator=g) * mask
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask,
                                        "position_ids": (mask.cumsum(1) - 1).clamp(min=0)})


def greedy_rollout(module: torch.nn.Module, response_len: int, vocab: int) -> HFRollout:
    """A greedy hf rollout over ``module`` (eos = the last id, pad 0), micro-batches of 3: several decode loops per
    chunk."""
    cfg = SimpleNamespace(response_length=response_len, n=1, do_sample=False, temperature=1.0, top_p=1.0, top_k=-1,
                          micro_batch_size=3)
    return HFRollout(module, cfg, eos_token_id=[vocab - 1], pad_token_id=0)

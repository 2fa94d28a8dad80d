"""The hf rollout records an MoE model's routing (``record_routing``) and the trainer's forward replays it.

* same weights, fp32 both sides: the recorded routing of every column the trainer reads equals the trainer's own
  routing, and replaying it reproduces the rollout's logprobs;
* a rollout whose weights differ slightly from the trainer's (N(0, 3e-4^2) noise: a stand-in for another dtype or
  kernel): without replay the trainer's top-k differs from the rollout's on near ties and those tokens' logprobs
  jump; with replay the MoE gap is at the level the same perturbation gives the dense model it was upcycled from.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch

from helpers.generation import left_padded_prompts
from helpers.moe import tiny_moe
from hybridflow.models.hf import load_causal_lm
from hybridflow.models.moe import ROUTING_KEY, route
from hybridflow.rollout import HFRollout
from hybridflow.training import FSDP2Engine
from hybridflow.training.routing_replay import routing_rectangle

V, R = 64, 8
EPS = 3e-4  # the rollout's weight perturbation in the mismatch test


def _rollout(module, record: bool = True) -> HFRollout:
    cfg = SimpleNamespace(response_length=R, n=2, do_sample=True, temperature=1.0, top_p=1.0, top_k=-1,
                          micro_batch_size=3, record_routing=record)
    return HFRollout(module, cfg, eos_token_id=[V - 1], pad_token_id=0)


def _generate(module, record: bool = True, vocab: int = V):
    prompts = left_padded_prompts(6, vocab)
    prompts.meta_info["seed"] = 5
    return _rollout(module, record).generate_sequences(prompts)


def _gap(trainer, batch) -> float:
    """max |rollout logprob - trainer logprob| over the generated tokens."""
    with torch.no_grad():
        lp = FSDP2Engine.from_module(trainer).forward(batch)["log_probs"]
    valid = batch.batch["response_mask"].bool()
    return (lp - batch.batch["rollout_log_probs"])[valid].abs().max().item()


def test_recorded_routing_is_the_trainer_s_and_replay_reproduces_the_rollout():
    model = tiny_moe(eval=True)
    out = _generate(model)
    routing = out.batch[ROUTING_KEY]
    p = out.batch["prompts"].shape[1]
    assert routing.dtype == torch.int16 and routing.shape == (len(out), p + R, 2, 2)
    assert ROUTING_KEY not in _generate(model, record=False).batch.keys()
    plain = out.select(batch_keys=[k for k in out.batch.keys() if k != ROUTING_KEY])
    with route(model) as record:
        FSDP2Engine.from_module(model).forward(plain)
    own = routing_rectangle(model, plain, "policy", False, record)
    mask = out.batch["attention_mask"].bool().clone()
    mask[:, -1] = False  # the last column is never fed back to the rollout (its output predicts nothing)
    # top-2 as a set: the order of two equal probabilities may differ between a decode step and a full forward
    assert torch.equal(own[mask].sort(-1).values, routing[mask].sort(-1).values)
    assert _gap(model, out) < 1e-5


def _perturbed(model: torch.nn.Module, eps: float) -> torch.nn.Module:
    """A copy of ``model`` with N(0, eps^2) noise added to every weight (seeded): a rollout whose forward differs
    slightly from the trainer's, as another dtype or kernel would."""
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(eps * torch.randn(p.shape, generator=gen))
    return other


def test_replay_brings_the_rollout_gap_to_the_dense_level():
    # the shipped tiny-moe (trained experts: a flipped expert choice moves the output; a random model's experts
    # barely differ) and the dense tiny-arith it was upcycled from, the same perturbation on both
    gaps = {}
    for name in ("tiny-moe", "tiny-arith"):
        trainer = load_causal_lm(f"builtin:{name}", torch.float32).eval()
        out = _generate(_perturbed(trainer, EPS), vocab=trainer.config.vocab_size)
        plain = out.select(batch_keys=[k for k in out.batch.keys() if k != ROUTING_KEY])
        gaps[name] = (_gap(trainer, plain), _gap(trainer, out))
    (off, on), (dense, _) = gaps["tiny-moe"], gaps["tiny-arith"]
    print(f"rollout weights + N(0, {EPS}^2), max |rollout - trainer logprob|: MoE replay off {off:.4f}, "
          f"replay on {on:.4f}; dense {dense:.4f}")
    assert off > 3 * on  # flipped expert choices dominate the MoE gap without replay
    assert on <= dense  # with replay the MoE gap is at the dense model's level

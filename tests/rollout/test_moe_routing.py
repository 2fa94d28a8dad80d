"""The hf rollout records an MoE model's routing (``record_routing``) and the trainer's forward replays it.

* same weights, fp32 both sides: the recorded routing of every column the trainer reads equals the trainer's own
  routing, and replaying it reproduces the rollout's logprobs;
* bf16 rollout vs fp32 trainer (the usual mismatch): without replay the trainer's top-k differs from the rollout's
  on near ties, and those tokens' logprobs move by far more than bf16 rounding; with replay the gap falls to that of
  the same bf16-vs-fp32 pair with its routing fixed, i.e. what a dense model shows.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch

from helpers.generation import left_padded_prompts
from helpers.moe import tiny_moe
from hybridflow.models.moe import ROUTING_KEY, route
from hybridflow.rollout import HFRollout
from hybridflow.training import FSDP2Engine
from hybridflow.training.routing_replay import routing_rectangle

V, R = 64, 8


def _rollout(module, record: bool = True) -> HFRollout:
    cfg = SimpleNamespace(response_length=R, n=2, do_sample=True, temperature=1.0, top_p=1.0, top_k=-1,
                          micro_batch_size=3, record_routing=record)
    return HFRollout(module, cfg, eos_token_id=[V - 1], pad_token_id=0)


def _generate(module, record: bool = True):
    prompts = left_padded_prompts(6, V)
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


def test_replay_closes_the_bf16_rollout_gap():
    trainer = tiny_moe(eval=True)
    rollout_model = copy.deepcopy(trainer).to(torch.bfloat16)
    out = _generate(rollout_model)
    plain = out.select(batch_keys=[k for k in out.batch.keys() if k != ROUTING_KEY])
    off, on = _gap(trainer, plain), _gap(trainer, out)
    # the dense level: the same bf16 weights in fp32 arithmetic with the rollout's routing; what is left of the gap
    # is bf16 rounding of weights and activations
    fp32_of_bf16 = copy.deepcopy(rollout_model).float()
    rounding = _gap(fp32_of_bf16, out)
    print(f"bf16 rollout vs fp32 trainer, max |logprob diff|: replay off {off:.4f}, replay on {on:.4f}; "
          f"bf16 weights in fp32 with replay {rounding:.4f}")
    assert on < off / 2
    assert on < 0.1

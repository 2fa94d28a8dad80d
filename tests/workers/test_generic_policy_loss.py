"""A policy loss written as ``def my_loss(*args, **kwargs)`` registers and the actor calls it with the arguments of
the common signature: the micro-batch's tensors positionally, the aggregation mode and the actor config, then
``rollout_log_probs`` and the mini-batch normalisers by keyword. The expected values are hand counts of the batch
built here, and the loss (delegating to ``vanilla``) trains exactly like ``vanilla`` itself."""

import pytest
import torch

from helpers.actor_update import actor_update
from hybridflow.algorithms import compute_policy_loss_vanilla, register_policy_loss
from hybridflow.algorithms.policy_loss_registry import POLICY_LOSSES

B, P, R, V = 4, 3, 4, 32
LENGTHS = torch.tensor([1, 4, 2, 3])  # 10 response tokens; micro-batches of 2 rows


def _update(policy_loss: str) -> tuple[dict[str, float], torch.Tensor, torch.nn.Module]:
    advantages = torch.tensor([[1.0], [-1.0], [0.5], [2.0]]).expand(B, R).clone()
    metrics, data, model = actor_update(LENGTHS, advantages, lambda old: old - 0.25, prompt_len=P, vocab_size=V,
                                        policy_loss=policy_loss)
    return metrics, data.batch["rollout_log_probs"], model


@pytest.fixture
def star_loss():
    calls = []

    @register_policy_loss("test_generic_star")
    def loss(*args, **kwargs):
        calls.append((args, kwargs))
        return compute_policy_loss_vanilla(*args, **kwargs)

    yield calls
    POLICY_LOSSES.unregister("test_generic_star")


def test_a_star_args_loss_gets_the_common_call(star_loss):
    metrics, rollout_log_probs, model = _update("test_generic_star")
    assert len(star_loss) == 2  # one mini-batch of 4 rows, two micro-batches of 2
    for i, (args, kwargs) in enumerate(star_loss):
        rows = slice(2 * i, 2 * i + 2)
        old_log_prob, log_prob, advantages, response_mask, mode, config = args
        assert old_log_prob.shape == log_prob.shape == advantages.shape == response_mask.shape == (2, R)
        assert response_mask.sum(dim=1).tolist() == LENGTHS[rows].tolist()
        assert advantages[:, 0].tolist() == [[1.0, -1.0], [0.5, 2.0]][i]
        assert mode == "token-mean" and config.policy_loss == "test_generic_star"
        assert set(kwargs) == {"rollout_log_probs", "num_tokens", "num_seqs", "loss_scale_factor"}
        assert torch.equal(kwargs["rollout_log_probs"], rollout_log_probs[rows])
        # normalisers of the whole mini-batch (one rank): its 10 response tokens, its 4 rows, R as the constant
        assert (kwargs["num_tokens"], kwargs["num_seqs"], kwargs["loss_scale_factor"]) == (10.0, 4.0, float(R))
    vanilla, _, vanilla_model = _update("vanilla")
    assert metrics["actor/pg_loss"] == pytest.approx(vanilla["actor/pg_loss"], abs=1e-7)
    for (name, p), (_, q) in zip(model.named_parameters(), vanilla_model.named_parameters()):
        assert torch.equal(p, q), name

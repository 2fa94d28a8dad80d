"""The actor logs the share of the valid tokens a rollout/trainer mismatch mask took out of the policy loss
(``actor/mis_masked_frac`` for actor.rollout_rs, ``actor/icepop_masked_frac`` for policy_loss=icepop), counted over
the whole mini-batch across its micro-batches; the expected shares are hand counts."""

import pytest
import torch

from helpers.actor_update import actor_update

B, P, R, V = 4, 3, 4, 32
LENGTHS = torch.tensor([1, 4, 2, 3])  # 10 valid tokens, micro-batches of 2 rows: 5 + 5
# pi_old / mu per token (padded slots hold 50, which would be masked if they counted)
RHO = torch.tensor([[1.0, 50.0, 50.0, 50.0],
                    [3.0, 1.0, 1.2, 0.9],
                    [1.0, 10.0, 50.0, 50.0],
                    [1.0, 1.0, 0.1, 50.0]])


def _update(**actor_keys) -> dict[str, float]:
    return actor_update(LENGTHS, torch.ones(B, R), lambda old: old - torch.log(RHO), prompt_len=P, vocab_size=V,
                        **actor_keys)[0]


def test_masked_fractions_are_hand_counts_over_the_mini_batch():
    # token MIS, band [1/2, 2]: 3.0 (row 1), 10.0 (row 2), 0.1 (row 3) leave it: 3 of 10
    metrics = _update(rollout_rs="token")
    assert metrics["actor/mis_masked_frac"] == pytest.approx(0.3, abs=1e-6)
    assert "actor/icepop_masked_frac" not in metrics
    # IcePop, band [0.5, 5]: 10.0 and 0.1: 2 of 10
    metrics = _update(policy_loss="icepop")
    assert metrics["actor/icepop_masked_frac"] == pytest.approx(0.2, abs=1e-6)
    assert "actor/mis_masked_frac" not in metrics
    # sequence MIS: rows 1 (prod 3.24), 2 (10) and 3 (0.1) are rejected whole: 4 + 2 + 3 of 10 tokens
    assert _update(rollout_rs="sequence")["actor/mis_masked_frac"] == pytest.approx(0.9, abs=1e-6)

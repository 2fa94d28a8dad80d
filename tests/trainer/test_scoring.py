"""Rule + model score combination on the driver (sum, or model only), with stub groups returning fixed scores."""

import torch

from hybridflow.protocol import DataProto
from hybridflow.trainer.scoring import CostScorer, RewardScorer

RULE = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
MODEL = torch.tensor([[0.0, 0.25], [-0.5, 0.0]])


class Rule:
    def compute_rm_score(self, data):
        return DataProto.from_dict(tensors={"token_level_scores": RULE.clone(),
                                            "reward_error": torch.zeros(2, dtype=torch.bool)})

    def compute_rule_cost(self, data):
        return DataProto.from_dict(tensors={"token_level_cost_scores": RULE.clone()})


class Model:
    def compute_rm_score(self, data):
        return DataProto.from_dict(tensors={"rm_scores": MODEL.clone()})


DATA = DataProto.from_dict(tensors={"response_mask": torch.ones(2, 2)})


def test_reward_sum_and_model_only():
    out = RewardScorer(Rule(), Model(), "sum").compute_rm_score(DATA).batch
    assert torch.equal(out["token_level_scores"], torch.tensor([[0.0, 1.25], [-0.5, 0.0]]))
    assert torch.equal(out["rm_scores"], MODEL)
    out = RewardScorer(Rule(), Model(), "model").compute_rm_score(DATA).batch
    assert torch.equal(out["token_level_scores"], MODEL) and not out["reward_error"].any()


def test_cost_rule_model_or_both():
    assert torch.equal(CostScorer(Rule(), None).compute_cost(DATA), RULE)
    assert torch.equal(CostScorer(None, Model()).compute_cost(DATA), MODEL)
    assert torch.equal(CostScorer(Rule(), Model()).compute_cost(DATA), torch.tensor([[0.0, 1.25], [-0.5, 0.0]]))

"""Driver-side combination of rule scores and model scores (rewards and Safe-RLHF costs).

Rule scores come from the rule-reward group (:class:`~hybridflow.workers.reward_worker.RuleRewardWorker`), model
scores from a score-model group (:class:`~hybridflow.workers.rm_worker.RewardModelWorker`). Combination rule:
the **sum** of the rule score and the model score of each response (both placed on its last valid response
token), or the model score alone with ``reward_model.combine=model``. Costs are always summed.

Shapes: (B, R) = sequences, response tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from hybridflow.protocol import DataProto

if TYPE_CHECKING:
    from omegaconf import DictConfig


class RewardScorer:
    """The reward of a run whose ``reward_model.enable`` is set; same contract as the rule-reward group's
    ``compute_rm_score``, so the drivers and validation take either.

    Args:
        rule: the rule-reward group.
        model: the reward-model group.
        combine: ``sum`` (rule + model) or ``model`` (model only; the rule reward is not computed).
    """

    def __init__(self, rule: Any, model: Any, combine: str = "sum") -> None:
        if combine not in ("sum", "model"):
            raise ValueError(f"reward_model.combine must be sum or model, got {combine!r}")
        self.rule, self.model, self.combine = rule, model, combine

    def compute_rm_score(self, data: DataProto) -> DataProto:
        """``token_level_scores`` (B, R) fp32 (combined), ``rm_scores`` (B, R) (the model's part) and
        ``reward_error`` (B,) bool (rule failures scored with ``reward_model.error_score``) and ``reward_timeout``
        (B,) bool (those of them that timed out)."""
        rm_scores = self.model.compute_rm_score(data).batch["rm_scores"]
        if self.combine == "model":
            errors = torch.zeros(len(data), dtype=torch.bool)
            return DataProto.from_dict(tensors={"token_level_scores": rm_scores, "rm_scores": rm_scores,
                                                "reward_error": errors, "reward_timeout": errors.clone()})
        out = self.rule.compute_rm_score(data)
        out.batch["token_level_scores"] = out.batch["token_level_scores"] + rm_scores
        out.batch["rm_scores"] = rm_scores
        return out


class CostScorer:
    """The cost of each response for Safe-RLHF: rule cost (``cost_model.rule``) + cost model, whichever are set.

    Args:
        rule: the rule-reward group, when ``cost_model.rule`` is set (it computes the rule cost), else None.
        model: the cost-model group, when ``cost_model.enable``, else None.

    Raises:
        ValueError: both are None.
    """

    def __init__(self, rule: Any = None, model: Any = None) -> None:
        if rule is None and model is None:
            raise ValueError("CostScorer needs a rule cost (cost_model.rule) or a cost model (cost_model.enable)")
        self.rule, self.model = rule, model

    def compute_cost(self, data: DataProto) -> torch.Tensor:
        """(B, R) fp32: each response's cost on its last valid response token, 0 elsewhere."""
        parts: list[torch.Tensor] = []
        if self.rule is not None:
            parts.append(self.rule.compute_rule_cost(data).batch["token_level_cost_scores"])
        if self.model is not None:
            parts.append(self.model.compute_rm_score(data).batch["rm_scores"])
        return torch.stack(parts).sum(0)


def build_reward(groups: dict[str, Any], config: DictConfig) -> Any:
    """The reward a driver uses: the rule-reward group, or a :class:`RewardScorer` with ``reward_model.enable``."""
    if not config.reward_model.enable:
        return groups["reward"]
    return RewardScorer(groups["reward"], groups["reward_model"], config.reward_model.combine)


def build_cost(groups: dict[str, Any], config: DictConfig) -> Optional[CostScorer]:
    """The Safe-RLHF cost from ``cost_model``: None when neither a rule cost nor a cost model is configured."""
    rule = groups["reward"] if config.cost_model.rule is not None else None
    model = groups.get("cost_model") if config.cost_model.enable else None
    return CostScorer(rule, model) if (rule is not None or model is not None) else None

"""Pure tensor math of RL fine-tuning: advantages, losses, KL. No Ray, no torch.distributed, no models.

Shapes in docstrings: ``(B, T)`` = batch, response tokens; ``V`` = vocabulary.
"""

from hybridflow.algorithms.advantage import (
    ADV_ESTIMATORS,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    get_adv_estimator_fn,
    need_critic_for,
    needs_critic,
    needs_reward_baselines,
    register_adv_est,
)
from hybridflow.algorithms.advantage_reinforce import (  # importing registers rloo, reinforce++(-baseline), remax
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
)
from hybridflow.algorithms.dapo import informative_groups, overlong_filter_mask, overlong_reward_penalty
from hybridflow.algorithms.kl import (
    KL_PENALTY_TYPES,
    AdaptiveKLController,
    FixedKLController,
    get_kl_controller,
    kl_penalty,
)
from hybridflow.algorithms.losses import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    agg_loss,
    compute_policy_loss,
    compute_policy_loss_aipo,
    compute_policy_loss_gspo,
    compute_policy_loss_vanilla,
    compute_value_loss,
    entropy_from_logits,
    get_policy_loss_fn,
    importance_weight_cap,
    logprobs_from_logits,
    policy_loss_meta,
    register_policy_loss,
)
from hybridflow.algorithms.losses_icepop import compute_policy_loss_icepop
from hybridflow.algorithms.rollout_correction import correction_weights, masked_token_fractions, tis_weights
from hybridflow.algorithms.safe_rlhf import LagrangeMultiplier, compute_safe_rlhf_advantage
from hybridflow.algorithms.sampling import SamplingSpec, sampling_logits, truncation_mask
from hybridflow.algorithms.utils import masked_mean, masked_sum, masked_var, masked_whiten
from hybridflow.registry import UnknownNameError

__all__ = [
    "ADV_ESTIMATORS",
    "KL_PENALTY_TYPES",
    "LOSS_AGG_MODES",
    "AdaptiveKLController",
    "FixedKLController",
    "LagrangeMultiplier",
    "POLICY_LOSSES",
    "SamplingSpec",
    "UnknownNameError",
    "agg_loss",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_policy_loss",
    "compute_policy_loss_aipo",
    "compute_policy_loss_gspo",
    "compute_policy_loss_icepop",
    "compute_policy_loss_vanilla",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_safe_rlhf_advantage",
    "compute_value_loss",
    "correction_weights",
    "entropy_from_logits",
    "get_adv_estimator_fn",
    "get_kl_controller",
    "get_policy_loss_fn",
    "importance_weight_cap",
    "informative_groups",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_token_fractions",
    "masked_var",
    "masked_whiten",
    "need_critic_for",
    "needs_critic",
    "needs_reward_baselines",
    "overlong_filter_mask",
    "overlong_reward_penalty",
    "policy_loss_meta",
    "register_adv_est",
    "register_policy_loss",
    "sampling_logits",
    "tis_weights",
    "truncation_mask",
]

"""A new advantage estimator registered from user code, then trained with through the normal config.

``median_baseline``: the outcome score of a response minus the median score of its prompt's group (the n
samples that share a ``uid``), on every valid token; a baseline that one outlier sample cannot move. Selected
with ``algorithm.adv_estimator=median_baseline`` on the GRPO recipe (group size 4, no critic).
Run: ``python examples/custom_estimator.py [key=value ...]``.
"""

import sys

import numpy as np
import torch

from hybridflow.algorithms import register_adv_est
from hybridflow.config import load_config
from hybridflow.trainer.main import run_ppo


@register_adv_est("median_baseline")
def compute_median_baseline_advantage(token_level_rewards, response_mask, index):
    """token_level_rewards, response_mask: (B, T); index: (B,) group id per response. Returns (B, T) twice."""
    scores = (token_level_rewards * response_mask).sum(-1)
    _, group = np.unique(np.asarray(index), return_inverse=True)
    group = torch.as_tensor(group.reshape(-1))
    medians = torch.stack([scores[group == g].median() for g in range(int(group.max()) + 1)])
    advantages = (scores - medians[group])[:, None] * response_mask
    return advantages, advantages


def main(overrides=()):
    config = load_config("grpo_quickstart", ["algorithm.adv_estimator=median_baseline", *overrides])
    return run_ppo(config)


if __name__ == "__main__":
    print(main(sys.argv[1:]))

"""Validation's k-sample metrics: pass@k (Chen et al. 2021, eq. 1), best@k (exact expected best of k), maj@n
(majority vote over extracted answers), on hand-made score tables whose values are worked out by hand in the
comments; and validate() reporting them per data source with a fake actor and reward."""

import itertools
import math

import numpy as np
import pytest
import torch

from hybridflow.config.loader import load_config
from hybridflow.protocol import DataProto
from hybridflow.rewards import extract_answer
from hybridflow.rewards.sample_metrics import best_at_k, k_values, majority_score, pass_at_k, sampled_metrics
from hybridflow.trainer.validate import validate


def test_pass_at_k_closed_forms():
    # 1 - C(n-c, k) / C(n, k) by hand
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # C(3,2)=3, C(4,2)=6
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # C(3,2)=3, C(5,2)=10
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # C(3,3)=1, C(5,3)=10
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)  # pass@1 is the share correct
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 3, 2) == 1.0
    # large n: the product form stays exact where C(1000, 500) would overflow a float
    assert pass_at_k(1000, 1, 500) == pytest.approx(0.5)  # one correct in half the draws
    assert pass_at_k(1000, 2, 500) == pytest.approx(1 - (500 * 499) / (1000 * 999))
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 2)


def test_best_at_k_is_the_expected_best_of_k_without_replacement():
    scores = [0.0, 0.5, 1.0, 1.0]
    # the 6 pairs' maxima: (0,.5)->.5, (0,1)->1 twice, (.5,1)->1 twice, (1,1)->1: (0.5 + 5) / 6
    assert best_at_k(scores, 2) == pytest.approx(5.5 / 6)
    assert best_at_k(scores, 1) == pytest.approx(np.mean(scores)) and best_at_k(scores, 4) == 1.0
    odd = [0.3, -1.0, 2.0, 0.7, 0.1]
    for k in range(1, 6):  # a slow reference: every k-subset
        subsets = list(itertools.combinations(odd, k))
        assert best_at_k(odd, k) == pytest.approx(sum(max(s) for s in subsets) / len(subsets))
    binary = [1.0, 0.0, 0.0, 1.0, 0.0]  # on 0/1 scores best@k is pass@k
    for k in range(1, 6):
        assert best_at_k(binary, k) == pytest.approx(pass_at_k(5, 2, k))


def test_majority_score_by_hand():
    # "7" has 2 votes, "8" 1, None does not vote; the winners' scores are 1 and 1
    assert majority_score([1.0, 0.0, 1.0, 0.0], ["7", "8", "7", None]) == 1.0
    # "8" wins 3 to 1 over the right "7": the prompt scores 0
    assert majority_score([0.0, 1.0, 0.0, 0.0], ["8", "7", "8", "8"]) == 0.0
    # a tie 2-2: the answer seen first ("8") wins
    assert majority_score([0.0, 1.0, 0.0, 1.0], ["8", "7", "8", "7"]) == 0.0
    # no answer at all: the mean of the scores
    assert majority_score([0.0, 0.5], [None, None]) == 0.25
    assert k_values(1) == [1] and k_values(4) == [1, 2, 4] and k_values(6) == [1, 2, 4, 6]


# two prompts of source "a" and one of "b", n = 4 each (prompt-major rows)
SCORES = [[1, 0, 0, 0], [1, 1, 0, 1], [0, 0, 0, 0]]
ANSWERS = [["7", "8", "8", None], ["3", "3", "4", "3"], [None, None, None, None]]
SOURCES = ["a", "a", "b"]


def test_sampled_metrics_on_a_hand_table():
    scores = [float(s) for row in SCORES for s in row]
    sources = [src for src in SOURCES for _ in range(4)]
    answers = [a for row in ANSWERS for a in row]
    m = sampled_metrics("val", scores, sources, answers, 4, threshold=1.0)
    # pass@2 per prompt: c=1: 1 - C(3,2)/C(4,2) = 0.5; c=3: 1; c=0: 0
    assert m["val/pass@2/a"] == pytest.approx((0.5 + 1.0) / 2) and m["val/pass@2/b"] == 0.0
    assert m["val/pass@2"] == pytest.approx(1.5 / 3)
    assert m["val/pass@1"] == pytest.approx((1 / 4 + 3 / 4 + 0) / 3)
    assert m["val/pass@4/a"] == 1.0 and m["val/best@4/a"] == 1.0 and m["val/best@2/a"] == pytest.approx(0.75)
    # maj@4: prompt 0 votes "8" (2 of 3 votes) -> 0; prompt 1 votes "3" -> 1; source b has no answers: no maj
    assert m["val/maj@4/a"] == 0.5 and m["val/maj@4"] == 0.5 and "val/maj@4/b" not in m
    assert "val/best@1" not in m
    # a threshold of 0.5 counts the same here; without answers no maj at all
    assert "val/maj@4" not in sampled_metrics("val", scores, sources, None, 4, 1.0)
    with pytest.raises(ValueError, match="one prompt"):
        sampled_metrics("val", scores, sources[1:] + ["b"], answers, 4, 1.0)


def test_extract_answer_of_the_built_in_rewards():
    assert extract_answer("openai/gsm8k", "so #### $1,000.50") == "1000.5"
    assert extract_answer("hybridflow/arith", "#### 12") == extract_answer("openai/gsm8k", "#### 12.0") == "12"
    assert extract_answer("openai/gsm8k", "no marker 12") is None
    assert extract_answer("HuggingFaceH4/MATH-500", "thus \\boxed{ \\frac{1}{2} }") == "\\frac{1}{2}"
    assert extract_answer("no/such-source", "#### 3") is None


class _Actor:
    """Generates response token p * 10 + j for sample j of the prompt whose first token is p."""

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        n = prompts.meta_info["n"]
        first = prompts.batch["input_ids"][:, 0].repeat_interleave(n)
        sample = torch.arange(len(first)) % n
        return DataProto.from_dict(tensors={"responses": (first * 10 + sample)[:, None],
                                            "response_mask": torch.ones(len(first), 1, dtype=torch.long)})


class _Reward:
    """SCORES / ANSWERS of the response token; greedy (n = 1) responses are sample 0."""

    def compute_rm_score(self, rows: DataProto) -> DataProto:
        code = rows.batch["responses"][:, 0].tolist()
        out = DataProto.from_dict(tensors={"token_level_scores": torch.tensor(
            [[float(SCORES[c // 10][c % 10])] for c in code])})
        if rows.meta_info.get("extract_answers"):
            out.non_tensor_batch["answer"] = np.array([ANSWERS[c // 10][c % 10] for c in code], dtype=object)
        return out


def test_validate_reports_them_per_data_source():
    cfg = load_config(None, ["actor_rollout_ref.rollout.val_kwargs.do_sample=true",
                             "actor_rollout_ref.rollout.val_kwargs.n=4",
                             "actor_rollout_ref.rollout.val_kwargs.temperature=1.0", "data.val_batch_size=2"])
    ids = torch.tensor([[0, 5], [1, 5], [2, 5]])
    val = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                       "position_ids": torch.arange(2).expand(3, -1).clone()},
                              non_tensors={"data_source": np.array(SOURCES, dtype=object)})
    m = validate(cfg, _Actor(), _Reward(), val)
    assert m["val/score"] == pytest.approx(2 / 3) and m["val/score/a"] == 1.0  # the greedy pass: sample 0
    assert m["val/mean@4"] == pytest.approx(4 / 12) and m["val/mean@4/a"] == pytest.approx(4 / 8)
    assert m["val/pass@2/a"] == pytest.approx(0.75) and m["val/pass@4"] == pytest.approx(2 / 3)
    assert m["val/best@2/b"] == 0.0 and math.isclose(m["val/maj@4/a"], 0.5) and "val/maj@4/b" not in m
    assert not any(k.startswith("val/pass@") for k in validate(load_config(None, []), _Actor(), _Reward(), val))

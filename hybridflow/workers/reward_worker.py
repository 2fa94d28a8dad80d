"""The rule-reward role: decode each response and score it against its ground truth.

The scalar score of a sequence is placed on its last valid response token (``token_level_scores``), which is
how outcome rewards enter GAE and the other estimators.
"""

from __future__ import annotations

import numpy as np
import torch

from hybridflow.controller import Dispatch, Worker, register
from hybridflow.models.hf import load_tokenizer
from hybridflow.protocol import DataProto
from hybridflow.workers import columns
from hybridflow.workers.timing import report_time
from hybridflow.rewards import extract_answer, load_compute_score
from hybridflow.rewards.batch import cost_batch, decode_responses, score_batch
from hybridflow.rewards.cost import get_cost_fn
from hybridflow.workers.inputs import ConfigSection, RuleRewardInputs, expect, expect_section


def place_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Scatter per-sequence ``scores`` (B,) onto the last token of ``response_mask`` (B, R) that is 1 -> (B, R) fp32.
    A sequence with no valid token gets no reward.

    The last 1 of the mask, not ``mask.sum() - 1``: in a multi-turn response the mask has holes (observation
    tokens are 0), so the count of model tokens is not the position of the last one."""
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    valid = response_mask.cpu() != 0
    positions = torch.arange(valid.shape[-1])
    last = torch.where(valid, positions, torch.full_like(positions, -1)).max(dim=-1).values
    rows = torch.nonzero(last >= 0).squeeze(-1)
    out[rows, last[rows]] = scores[rows].float().cpu()
    return out


class RuleRewardWorker(Worker):
    """Scores responses with ``reward_model.compute_score``: :func:`hybridflow.rewards.default_compute_score` (by
    ``data_source``) or a user function (:func:`hybridflow.rewards.load_compute_score`), and with the rule cost
    ``cost_model.rule`` (:mod:`hybridflow.rewards.cost`) for Safe-RLHF.

    Args:
        config: the ``reward_model`` section (``compute_score``, ``error_score``, ``timeout_s``), a schema dataclass
            object.
        inputs: the actor's tokenizer and the rule cost (``cost_model.rule``).

    Built by :func:`hybridflow.trainer.worker_inputs.rule_reward_args`.

    Raises:
        TypeError: ``config`` is not the ``reward_model`` section or ``inputs`` not a
            :class:`~hybridflow.workers.inputs.RuleRewardInputs`.
    """

    def __init__(self, config: ConfigSection, inputs: RuleRewardInputs) -> None:
        super().__init__()
        self.config = expect_section(config, "reward_model", ("compute_score", "error_score", "timeout_s"))
        self.inputs = expect(inputs, RuleRewardInputs, "RuleRewardWorker: inputs")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Load the actor's tokenizer and the scoring function."""
        tok = self.inputs.tokenizer
        self.tokenizer = load_tokenizer(tok.path, tok.trust_remote_code)
        spec = self.config.compute_score
        self.compute_score = None if spec == "default" else load_compute_score(spec)  # None: the registry

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, batch_keys=columns.RESPONSES)
    @report_time
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """``token_level_scores`` (B, R) fp32 from ``responses``/``response_mask`` and the non-tensor columns
        ``data_source``, ``ground_truth`` (and ``extra_info`` if present), ``reward_error`` (B,) bool and
        ``reward_timeout`` (B,) bool.

        A scoring function that raises, or whose call does not return within ``reward_model.timeout_s`` seconds
        (abandoned in its thread: :func:`hybridflow.rewards.batch.call_bounded`), stops the run with an error naming
        the sample, unless ``reward_model.error_score`` is set: then that score is used, ``reward_error`` marks the
        sample and, for a call that timed out, ``reward_timeout`` too (one warning names it).

        With ``meta_info["extract_answers"]`` (validation's ``maj@n``) also the non-tensor column ``answer`` (B,):
        each response's final answer per :func:`hybridflow.rewards.extract_answer`, None where there is none."""
        texts = decode_responses(self.tokenizer, data)
        scores, errors, timeouts = score_batch(self.tokenizer, data, texts=texts, error_score=self.config.error_score,
                                               return_errors=True, compute_score=self.compute_score,
                                               timeout_s=self.config.timeout_s)
        mask = data.batch["response_mask"]
        out = DataProto.from_dict(tensors={"token_level_scores": place_scores(torch.tensor(scores), mask),
                                           "reward_error": torch.tensor(errors, dtype=torch.bool),
                                           "reward_timeout": torch.tensor(timeouts, dtype=torch.bool)})
        if data.meta_info.get("extract_answers"):
            sources = data.non_tensor_batch["data_source"]
            out.non_tensor_batch["answer"] = np.array([extract_answer(src, text) for src, text in zip(sources, texts)],
                                                      dtype=object)
        return out

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, batch_keys=columns.RESPONSES)
    @report_time
    def compute_rule_cost(self, data: DataProto) -> DataProto:
        """``token_level_cost_scores`` (B, R) fp32: the rule cost ``cost_model.rule`` of each decoded response
        (``responses``/``response_mask``; ``data_source``, ``ground_truth`` and ``extra_info`` columns when
        present) on its last valid token. Each call is bounded by ``reward_model.timeout_s``: one that does not
        return in time stops the run with one line naming the sample
        (:class:`~hybridflow.rewards.batch.RewardTimeoutError`)."""
        fn = get_cost_fn(self.inputs.cost_rule)
        costs = cost_batch(fn, self.inputs.cost_rule, data, decode_responses(self.tokenizer, data),
                           self.config.timeout_s)
        mask = data.batch["response_mask"]
        return DataProto.from_dict(tensors={"token_level_cost_scores": place_scores(torch.tensor(costs), mask)})

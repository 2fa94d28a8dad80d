"""Reward and cost models as a worker role: a Hugging Face scorer read at the last valid token of each sequence.

The model is a sequence-classification (``*ForSequenceClassification``) or token-classification
(``*ForTokenClassification``) checkpoint with one label. It is always run as a token classifier, so it returns a
score for every position, and the sequence score is the one at the *last valid token*: the last position where
``attention_mask`` is 1. That index comes from the mask, never from comparing tokens with the pad id, so it is
right with left-padded prompts, with right-padded responses and when the pad token equals the eos token (where
Hugging Face's own sequence-classification pooling picks the wrong token).

The same class serves the ``reward_model`` and ``cost_model`` roles (their config sections have the same keys).
The model must use the actor's tokenizer (same token ids); ``init_model`` checks the vocabularies.

Shapes: (B, L) = sequences, prompt + response tokens; (B, R) = sequences, response tokens.
"""

from __future__ import annotations

import torch

from hybridflow.controller import Dispatch, Worker, register
from hybridflow.distributed import init_distributed
from hybridflow.models.hf import load_score_model, load_tokenizer  # noqa: F401 (load_score_model re-exported)
from hybridflow.protocol import DataProto
from hybridflow.training import EngineSpec, ParallelLayout, get_engine_class
from hybridflow.workers.actor_worker import setup_worker_process
from hybridflow.workers.inputs import ConfigSection, ScoreModelInputs, expect, expect_section
from hybridflow.workers.reward_worker import place_scores
from hybridflow.workers.timing import report_time

ROLES = ("reward_model", "cost_model")
MESH = "score_model"


def last_valid_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) long: the index of the last position whose ``attention_mask`` (B, L) is nonzero (0 for an all-zero
    row). Correct for left padding, right padding and both, whatever token the padding holds."""
    positions = torch.arange(attention_mask.shape[-1], device=attention_mask.device)
    return ((attention_mask != 0).long() * positions).argmax(dim=-1)


def last_token_scores(token_scores: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) fp32: each row of ``token_scores`` (B, L) read at :func:`last_valid_index` of ``attention_mask``."""
    rows = torch.arange(token_scores.shape[0], device=token_scores.device)
    return token_scores[rows, last_valid_index(attention_mask)].float()


class RewardModelWorker(Worker):
    """Args:
        config: the ``role`` section (``reward_model`` or ``cost_model``: ``model``, ``strategy``,
            ``micro_batch_size_per_gpu``), a schema dataclass object.
        inputs: the actor's tokenizer (for the vocabulary check).
        role: ``reward_model`` or ``cost_model``: which section ``config`` is.

    Built by :func:`hybridflow.trainer.worker_inputs.score_model_args`.

    Raises:
        ValueError: unknown ``role``.
        TypeError: ``config`` is not a score-model section or ``inputs`` not a
            :class:`~hybridflow.workers.inputs.ScoreModelInputs`.
    """

    def __init__(self, config: ConfigSection, inputs: ScoreModelInputs,
                 role: str = "reward_model") -> None:
        super().__init__()
        if role not in ROLES:
            raise ValueError(f"unknown score-model role {role!r}; expected one of {ROLES}")
        self.config = expect_section(config, role, ("model", "strategy", "micro_batch_size_per_gpu"))
        self.inputs = expect(inputs, ScoreModelInputs, "RewardModelWorker: inputs")
        self.role = role

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Join the process group, build the scorer (``<role>.model``, frozen) with the ``<role>.strategy``
        engine over the group.

        Raises:
            ValueError: its tokenizer's vocabulary differs from the actor's (token ids would not match).
        """
        setup_worker_process()
        init_distributed()
        section, actor = self.config, self.inputs.actor_tokenizer
        actor_tok = load_tokenizer(actor.path, actor.trust_remote_code)
        own_tok = load_tokenizer(section.model.tokenizer_path or section.model.path, section.model.trust_remote_code)
        if own_tok.get_vocab() != actor_tok.get_vocab():
            raise ValueError(f"{self.role}.model.path={section.model.path!r} uses a different tokenizer than the "
                             f"actor ({actor.path!r}); the scorer reads the actor's token ids, so it must "
                             "share the actor's vocabulary")
        self._register_dispatch_collect_info(MESH, dp_rank=self.rank, is_collect=True)
        self.engine = get_engine_class(section.strategy).build(EngineSpec(
            kind="score", model=section.model, layout=ParallelLayout(dp=self.world_size), device=self.device_name,
            role=self.role, remove_padding=section.model.use_remove_padding))
        self.engine.set_train(False)

    @torch.no_grad()
    def _scores(self, micro: DataProto) -> torch.Tensor:
        return last_token_scores(self.engine.forward(micro)["token_scores"], micro.batch["attention_mask"])

    @register(dispatch_mode=Dispatch.MESH_COMPUTE_PROTO, mesh_name=MESH)
    @report_time
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """``rm_scores`` (B, R) fp32: the model's score of each whole sequence (``input_ids``,
        ``attention_mask``, ``position_ids`` (B, L)) on its last valid response token (``response_mask``
        (B, R)), 0 elsewhere; a row without response tokens gets no score."""
        micro = self.config.micro_batch_size_per_gpu
        scores = torch.cat([self._scores(m) for m in data.split(micro)]).cpu()
        return DataProto.from_dict(tensors={"rm_scores": place_scores(scores, data.batch["response_mask"].cpu())})

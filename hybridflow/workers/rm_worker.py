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

import os

import torch
from transformers import AutoConfig, AutoModelForTokenClassification

from hybridflow.controller import Dispatch, Worker, register
from hybridflow.distributed import apply_fsdp2, build_mesh, init_distributed, resolve_dtype
from hybridflow.models.hf import load_tokenizer
from hybridflow.models.builtin import resolve_model_path
from hybridflow.protocol import DataProto
from hybridflow.workers.packing import packed_forward
from hybridflow.workers.actor_worker import setup_worker_process
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


def load_score_model(path: str, dtype: torch.dtype, trust_remote_code: bool = False) -> torch.nn.Module:
    """A one-label scorer from a local directory, as ``AutoModelForTokenClassification`` (a score per token).

    A ``*ForSequenceClassification`` checkpoint loads into the token-classification class of the same
    architecture: both keep their head in ``score``; the head is built without bias to match. Dropout is off.

    Raises:
        FileNotFoundError: ``path`` is not a local directory.
        ValueError: the checkpoint has no trained ``score`` head (e.g. a plain causal LM), or has more than one
            label.
    """
    local = resolve_model_path(path)
    if not os.path.isdir(local):
        raise FileNotFoundError(f"score model path {path!r} is not a local directory; hybridflow never downloads "
                                "weights, so pass a local Hugging Face model directory")
    config = AutoConfig.from_pretrained(local, trust_remote_code=trust_remote_code)
    architectures = config.architectures or []
    if not any(a.endswith(("ForSequenceClassification", "ForTokenClassification")) for a in architectures):
        raise ValueError(f"score model at {path!r} has no trained score head (architectures {architectures}); "
                         "expected a *ForSequenceClassification or *ForTokenClassification checkpoint")
    if config.num_labels != 1:
        raise ValueError(f"score model at {path!r} has num_labels={config.num_labels}; a reward or cost model "
                         "must have exactly one label")
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        config.token_classification_bias = False  # sequence-classification heads have no bias
    model, info = AutoModelForTokenClassification.from_pretrained(
        local, config=config, dtype=dtype, trust_remote_code=trust_remote_code, output_loading_info=True
    )
    missing = [k for k in info["missing_keys"] if k.split(".")[0] == "score"]
    if missing:
        raise ValueError(f"score model at {path!r} has no trained score head (missing {missing}); expected a "
                         "*ForSequenceClassification or *ForTokenClassification checkpoint with num_labels=1")
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    model.requires_grad_(False)
    return model.eval()


class RewardModelWorker(Worker):
    """Args:
        config: the full run config (reads the ``role`` section and ``actor_rollout_ref.model``).
        role: ``reward_model`` or ``cost_model``: which config section holds the model.

    Raises:
        ValueError: unknown ``role``.
    """

    def __init__(self, config, role: str = "reward_model") -> None:
        super().__init__()
        if role not in ROLES:
            raise ValueError(f"unknown score-model role {role!r}; expected one of {ROLES}")
        self.config = config
        self.role = role

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Join the process group, load the scorer (``<role>.model``), shard it with FSDP2 over the group.

        Raises:
            ValueError: its tokenizer's vocabulary differs from the actor's (token ids would not match).
        """
        setup_worker_process()
        init_distributed()
        section = self.config[self.role]
        actor_model = self.config.actor_rollout_ref.model
        actor_tok = load_tokenizer(actor_model.tokenizer_path or actor_model.path, actor_model.trust_remote_code)
        own_tok = load_tokenizer(section.model.tokenizer_path or section.model.path, section.model.trust_remote_code)
        if own_tok.get_vocab() != actor_tok.get_vocab():
            raise ValueError(f"{self.role}.model.path={section.model.path!r} uses a different tokenizer than the "
                             f"actor ({actor_model.path!r}); the scorer reads the actor's token ids, so it must "
                             "share the actor's vocabulary")
        self._register_dispatch_collect_info(MESH, dp_rank=self.rank, is_collect=True)
        mesh = build_mesh(dp=self.world_size)
        dtype = resolve_dtype(section.model.dtype, self.device_name)
        module = load_score_model(section.model.path, dtype, section.model.trust_remote_code)
        self.module = apply_fsdp2(module.to(self.device_name), mesh)

    @torch.no_grad()
    def _scores(self, micro: DataProto) -> torch.Tensor:
        b = micro.batch
        if self.config[self.role].model.use_remove_padding:  # one packed row of the valid tokens
            return last_token_scores(packed_forward(self.module, micro).squeeze(-1), b["attention_mask"])
        out = self.module(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                          position_ids=b["position_ids"], use_cache=False)
        return last_token_scores(out.logits.squeeze(-1), b["attention_mask"])

    @register(dispatch_mode=Dispatch.MESH_COMPUTE_PROTO, mesh_name=MESH)
    @report_time
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """``rm_scores`` (B, R) fp32: the model's score of each whole sequence (``input_ids``,
        ``attention_mask``, ``position_ids`` (B, L)) on its last valid response token (``response_mask``
        (B, R)), 0 elsewhere; a row without response tokens gets no score."""
        micro = self.config[self.role].micro_batch_size_per_gpu
        scores = torch.cat([self._scores(m) for m in data.split(micro)]).cpu()
        return DataProto.from_dict(tensors={"rm_scores": place_scores(scores, data.batch["response_mask"].cpu())})

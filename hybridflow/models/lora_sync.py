"""What a LoRA actor sends to its rollout after an update, and the check that it arrived (docs/how-to/lora.md).

Two payloads (``actor_rollout_ref.rollout.lora_sync``): ``merged``, the base model's names with
W + (alpha / r) B A (Hu et al. 2021, Eq. 3), which every backend loads like a full fine-tune's weights; or
``adapter``, only A (r, in) and B (out, r) under peft's names, which a backend takes when it holds the base plus
adapters itself: the ``hf`` rollout (a peft-wrapped copy) and ``vllm`` (a LoRA adapter of the engine). The async
driver's generators take adapters on the same terms, except an int8-quantized generator (it re-quantizes merged
weights on load), which gets merged weights.

The check: the trainer's and the rollout's greedy next-token logprobs on a fixed probe sequence
(:func:`hybridflow.models.lora.probe_ids`) must agree; the rollout computes them through its in-process module
(``hf``) or its ``probe_logprobs`` method (``vllm``). For the async push the trainer's probe travels with the
weights as one extra tensor (:data:`PROBE_NAME`), and each generator checks it after loading them.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Iterator, Optional

import torch

from hybridflow.models import lora as lora_lib
from hybridflow.utils.metrics import Max, Metric, Min

logger = logging.getLogger(__name__)

PROBE_NAME = "hybridflow.lora_sync_probe"  # the trainer's probe logprobs (1, PROBE_LENGTH) fp32 in an async push


def rollout_takes_adapters(config: Any, backend_takes_adapters: bool, int8_generators: bool) -> bool:
    """Whether the rollout (colocated, or the async driver's generators) receives adapters rather than merged
    weights: LoRA on, ``rollout.lora_sync=adapter``, a backend that takes adapters (``backend_takes_adapters``: its
    registration's ``lora_adapter_sync``) and generators not quantized to int8 (``int8_generators``). A pure function
    of the run config and those registry facts, so the trainer and the generators agree on the payload."""
    cfg = config.actor_rollout_ref
    if not lora_lib.lora_enabled(cfg.model) or cfg.rollout.lora_sync != "adapter":
        return False
    return backend_takes_adapters and not int8_generators


def rollout_lora_options(model: Any, adapters: bool) -> dict[str, Any]:
    """The rollout config entries of the adapter payload, from the actor's ``model`` section and whether the rollout
    takes adapters (:func:`rollout_takes_adapters`): ``lora_rank`` (0: the rollout gets merged or full weights) and
    ``lora_alpha``, read by backends with their own engine (vllm)."""
    return {"lora_rank": int(model.lora_rank) if adapters else 0, "lora_alpha": float(model.lora_alpha)}


def rollout_stream(adapters: bool, module: torch.nn.Module,
                   state: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    """The sync payload of a peft-wrapped actor ``module`` from its full ``state`` (``iter_full_state``): the
    adapters (peft names) when ``adapters`` (:func:`rollout_takes_adapters` of the run config), else the merged
    base-named weights. Consumes ``state`` fully (every rank in lockstep)."""
    if adapters:
        return lora_lib.adapter_items(state)
    return lora_lib.merge_lora_stream(state, lora_lib.lora_scaling(module.peft_config["default"]))


def rollout_layout_items(adapters: bool, items: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` in the order and with the shapes :func:`rollout_stream` yields for ``adapters``, from a
    peft model's ``state_dict().items()`` (no data read: for the transfer layout)."""
    if adapters:
        return lora_lib.adapter_items(items)
    return lora_lib.merged_names(items)


def rollout_probe(rollout: Any, vocab_size: int) -> Optional[torch.Tensor]:
    """The rollout's greedy logprobs (1, PROBE_LENGTH) fp32 on the probe, or None for a backend that cannot say
    (no in-process module and no ``probe_logprobs``)."""
    if hasattr(rollout, "probe_logprobs"):
        return rollout.probe_logprobs(lora_lib.probe_ids(vocab_size, "cpu")[0].tolist()).float()
    module = getattr(rollout, "module", None)
    if isinstance(module, torch.nn.Module):
        device = next(module.parameters()).device
        return lora_lib.greedy_logprobs(module, lora_lib.probe_ids(vocab_size, device))[1]
    return None


def rollout_dtype(rollout: Any) -> str:
    """The dtype name the rollout computes in (fp32 probes are held to the tight tolerance)."""
    module = getattr(rollout, "module", None)
    if isinstance(module, torch.nn.Module):
        return str(next(module.parameters()).dtype).removeprefix("torch.")
    llm = getattr(rollout, "llm", None)
    if llm is not None:
        return str(llm.llm_engine.vllm_config.model_config.dtype).removeprefix("torch.")
    return "unknown"


def check_probe(expected: torch.Tensor, got: torch.Tensor, dtype: str, where: str = "rollout") -> dict[str, float]:
    """Compare the trainer's probe logprobs ``expected`` (1, L) fp32 with the rollout's ``got`` (1, L') fp32,
    L' <= L (a rollout whose context is shorter than the probe answers for its prefix; positions are causal).

    Returns:
        ``sync/verified`` (1.0), ``sync/probe_max_abs_diff``, ``sync/probe_logprob_sum`` (the trainer's).

    Raises:
        RuntimeError: they differ by more than :data:`hybridflow.models.lora.PROBE_ATOL` (fp32) or
            ``PROBE_ATOL_LOW``: the ``where`` is not generating from the trainer's current policy.
    """
    expected = expected[:, : got.shape[1]]
    diff = float((expected.float().cpu() - got.float().cpu()).abs().max())
    atol = lora_lib.PROBE_ATOL.get(dtype, lora_lib.PROBE_ATOL_LOW)
    if not diff <= atol:
        raise RuntimeError(f"LoRA weight sync failed: the {where}'s greedy logprobs on the probe differ from the "
                           f"trainer's by {diff:.3g} (> {atol:g}); the {where} is not generating from the updated "
                           "policy")
    return {"sync/verified": 1.0, "sync/probe_max_abs_diff": diff, "sync/probe_logprob_sum": float(expected.sum())}


def probe_metric_kinds(metrics: dict[str, float]) -> dict[str, Metric]:
    """:func:`check_probe`'s metrics as the kinds they pool by over the ranks of a call: ``sync/verified`` ``Min``
    (1.0 only if every rank verified), ``sync/probe_max_abs_diff`` ``Max``, ``sync/probe_logprob_sum`` ``Max`` (the
    trainer's, the same on every rank)."""
    kinds = {"sync/verified": Min, "sync/probe_max_abs_diff": Max, "sync/probe_logprob_sum": Max}
    return {key: kinds[key](value) for key, value in metrics.items()}


def verify_rollout_sync(trainer: torch.nn.Module, rollout: Any, vocab_size: int) -> dict[str, float]:
    """After a sync, check the colocated ``rollout`` against the ``trainer`` (every rank of the trainer's mesh
    calls this: its forward is sharded). Returns :func:`check_probe`'s metrics, or ``{}`` for a rollout that
    cannot be probed (:func:`rollout_probe` None). Raises RuntimeError as :func:`check_probe` does."""
    got = rollout_probe(rollout, vocab_size)
    if got is None:
        return {}
    device = next(trainer.parameters()).device
    expected = lora_lib.greedy_logprobs(trainer, lora_lib.probe_ids(vocab_size, device))[1]
    return check_probe(expected, got, rollout_dtype(rollout))


def probe_entry(trainer: torch.nn.Module) -> tuple[str, torch.Tensor]:
    """The trainer's probe as one more tensor of an async weight push: ``(PROBE_NAME, (1, L) fp32)``. Every
    rank of the trainer's mesh calls this (sharded forward)."""
    vocab_size = trainer.config.get_text_config().vocab_size  # a VLM's is its text config's
    device = next(trainer.parameters()).device
    return PROBE_NAME, lora_lib.greedy_logprobs(trainer, lora_lib.probe_ids(vocab_size, device))[1]


def probe_layout_entry() -> tuple[str, torch.Tensor]:
    """A stand-in of :func:`probe_entry` with the right name, shape and dtype (for the transfer layout)."""
    return PROBE_NAME, torch.empty(1, lora_lib.PROBE_LENGTH, dtype=torch.float32)


def split_probe(tensors: list[tuple[str, torch.Tensor]]) -> tuple[list[tuple[str, torch.Tensor]],
                                                                   Optional[torch.Tensor]]:
    """Separate a received push into the weights and the trainer's probe (None when the push has none)."""
    probe = [t for name, t in tensors if name == PROBE_NAME]
    return [(n, t) for n, t in tensors if n != PROBE_NAME], (probe[0].clone() if probe else None)


def can_probe(rollout: Any) -> bool:
    """Whether :func:`rollout_probe` can check this rollout (an in-process module or ``probe_logprobs``)."""
    return hasattr(rollout, "probe_logprobs") or isinstance(getattr(rollout, "module", None), torch.nn.Module)


def rollout_vocab_size(rollout: Any) -> int:
    """The vocabulary size of the rollout's model (the probe ids are spread over it)."""
    module = getattr(rollout, "module", None)
    if isinstance(module, torch.nn.Module):
        return int(module.config.get_text_config().vocab_size)
    return int(rollout.llm.llm_engine.vllm_config.model_config.get_vocab_size())

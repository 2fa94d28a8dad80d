"""LoRA on the actor through peft (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models").

A LoRA layer replaces a frozen linear weight ``W`` (out, in) by ``W + s * B A`` with trainable ``A`` (r, in) and
``B`` (out, r), ``B`` initialised to zero, and the scale ``s = lora_alpha / r`` (Hu et al. 2021, Eq. 3 and
Sec. 4.1). Only ``A`` and ``B`` get gradients and optimizer state. Opt-in: ``actor_rollout_ref.model.lora_rank``
> 0 (0, the default, is full fine-tuning and none of this module runs).

What the rest of hybridflow gets from here:

* :func:`apply_lora` wraps the freshly loaded actor (before FSDP2) in a ``peft.PeftModel``; its base weights are
  frozen in ``model.dtype``.
* The reference policy is the same module with its adapters disabled (:func:`adapters_disabled`: no second copy
  of the weights).
* :func:`merge_lora_stream` turns the peft-named full state (``iter_full_state`` of the wrapped actor) into the
  base model's names with merged weights ``W + s * B A``: what the rollout receives (``rollout.lora_sync=merged``)
  and what ``hybridflow export`` writes.
* :func:`lora_problems` checks the ``lora_*`` keys once at config load.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional

if TYPE_CHECKING:  # torch loads lazily: lora_problems runs at config load, before torch is needed
    import torch

PEFT_PREFIX = "base_model.model."  # what peft's PeftModel puts in front of the wrapped model's names
ADAPTER_CONFIG = "adapter_config.json"  # peft's adapter config file (written next to a LoRA checkpoint's hf/)
LORA_SYNC_MODES = ("merged", "adapter")
ROLES_WITHOUT_LORA = ("reward_model", "cost_model")
VALUE_HEADS = ("score", "classifier")  # the scalar head of a token-classification value model (trained in full)


def lora_enabled(model_config: Any) -> bool:
    """Whether a ``ModelConfig`` asks for LoRA (``lora_rank`` > 0)."""
    return int(getattr(model_config, "lora_rank", 0) or 0) > 0


def make_lora_config(model_config: Any, task_type: str = "CAUSAL_LM", modules_to_save: Optional[list[str]] = None):
    """The ``peft.LoraConfig`` of a ``ModelConfig`` (``lora_rank``, ``lora_alpha``, ``target_modules``,
    ``exclude_modules``, ``lora_dropout``); bias terms stay frozen; ``modules_to_save`` train in full."""
    from peft import LoraConfig

    target = model_config.target_modules
    exclude = model_config.exclude_modules
    return LoraConfig(
        r=int(model_config.lora_rank), lora_alpha=float(model_config.lora_alpha),
        target_modules=target if isinstance(target, str) else list(target),
        exclude_modules=None if exclude is None else list(exclude),
        lora_dropout=float(model_config.lora_dropout), bias="none", task_type=task_type,
        modules_to_save=modules_to_save,
    )


def apply_lora(module: torch.nn.Module, model_config: Any) -> torch.nn.Module:
    """Wrap a Hugging Face causal LM in a ``peft.PeftModel`` with LoRA adapters per ``model_config``.

    Call before FSDP2 (``parallelize_model``): FSDP2 then shards the frozen base and the adapters alike, and only
    the adapters have ``requires_grad`` (so :func:`hybridflow.training.optim.build_optimizer` keeps state for them
    only). The base weights keep their dtype (``model.dtype``); the adapters are created in the same dtype.
    """
    from peft import get_peft_model

    dtype = next(module.parameters()).dtype
    wrapped = get_peft_model(module, make_lora_config(model_config))
    for name, param in wrapped.named_parameters():
        if "lora_" in name:
            param.data = param.data.to(dtype)
    return wrapped


def apply_critic_lora(module: torch.nn.Module, model_config: Any) -> torch.nn.Module:
    """Wrap a value model (``AutoModelForTokenClassification``, ``logits`` (B, L, 1)) in a ``peft.PeftModel``:
    LoRA adapters on the backbone per ``model_config`` (``critic.model``), and the freshly initialised scalar head
    (``score`` or ``classifier``) trained in full (peft's ``modules_to_save``). Call before FSDP2, as
    :func:`apply_lora`.

    Raises:
        ValueError: the value model has no ``score``/``classifier`` head.
    """
    import torch
    from peft import get_peft_model

    head = next((name for name in VALUE_HEADS if isinstance(getattr(module, name, None), torch.nn.Module)), None)
    if head is None:
        raise ValueError(f"critic LoRA: the value model {type(module).__name__} has none of the heads {VALUE_HEADS}")
    dtype = next(module.parameters()).dtype
    config = make_lora_config(model_config, task_type="TOKEN_CLS", modules_to_save=[head])
    wrapped = get_peft_model(module, config)
    for name, param in wrapped.named_parameters():
        if "lora_" in name:
            param.data = param.data.to(dtype)
    return wrapped


@contextlib.contextmanager
def adapters_disabled(module: torch.nn.Module) -> Iterator[None]:
    """``module`` (a ``peft.PeftModel``) as its base model: peft's ``disable_adapter()``, with the adapters'
    ``requires_grad`` kept. (peft clears it while disabled. When FSDP2's first forward, which fixes a unit's
    dtypes from its trainable parameters, ran in there, a unit saw none: with bf16 compute over fp32 weights its
    gradients were then reduced in bf16 and the update failed with "assign a gradient with dtype BFloat16 to a
    tensor with grad_dtype Float". Use it under ``torch.no_grad()``: the flags then change nothing else.)"""
    trainable = [param for param in module.parameters() if param.requires_grad]
    with module.disable_adapter():
        for param in trainable:
            param.requires_grad_(True)
        yield


def lora_scaling(lora_config) -> float:
    """``s = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA), the factor of ``B A`` in the merged weight."""
    r = lora_config.r
    return lora_config.lora_alpha / (r ** 0.5 if getattr(lora_config, "use_rslora", False) else r)


def merge_lora_stream(items: Iterable[tuple[str, torch.Tensor]], scaling: float,
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Turn a peft-named full state into the base model's names with merged weights.

    Args:
        items: ``(name, full tensor)`` in ``state_dict`` order of a LoRA ``PeftModel`` (e.g. ``iter_full_state``):
            ``...q_proj.base_layer.weight`` W (out, in), then ``...q_proj.lora_A.default.weight`` A (r, in),
            then ``...q_proj.lora_B.default.weight`` B (out, r).
        scaling: ``s`` of :func:`lora_scaling`.

    Yields:
        ``(base name, tensor)``: ``...q_proj.weight`` = W + s * B A (computed in fp32, cast back to W's dtype), all
        other tensors unchanged under their names without the peft prefix. Every rank consuming ``items`` in
        lockstep (DTensor gathers) consumes this in lockstep too.

    Raises:
        NotImplementedError: an adapter kind other than linear LoRA (embedding LoRA, DoRA magnitudes).
    """
    import torch

    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in items:
        name = name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else name
        if ".base_layer." in name:
            prefix, leaf = name.split(".base_layer.")
            if leaf == "weight":
                pending[prefix] = {"W": tensor}
                continue
            yield f"{prefix}.{leaf}", tensor
        elif ".lora_A." in name:
            pending[name.split(".lora_A.")[0]]["A"] = tensor
        elif ".lora_B." in name:
            prefix = name.split(".lora_B.")[0]
            part = pending.pop(prefix)
            weight = part["W"]
            delta = scaling * (tensor.to(torch.float32) @ part["A"].to(torch.float32))
            yield f"{prefix}.weight", (weight.to(torch.float32) + delta).to(weight.dtype)
        elif "lora_" in name:
            raise NotImplementedError(f"LoRA weight {name!r}: only linear-layer LoRA is merged; leave embeddings "
                                      "out of actor_rollout_ref.model.target_modules")
        else:
            yield name, tensor
    if pending:
        raise ValueError(f"LoRA base weights without adapters in the state: {sorted(pending)[:3]}")


def merged_names(items: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The ``(base name, tensor)`` entries :func:`merge_lora_stream` yields, in its order, without computing a merge
    (shapes and dtypes only are meaningful: the base weight stands for its merged weight; no data is read)."""
    for name, tensor in items:
        if "lora_" in name:
            continue
        name = name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else name
        yield name.replace(".base_layer.", "."), tensor


def adapter_items(items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Only the adapter tensors (``lora_A`` / ``lora_B``) of a peft-named full state, names unchanged.

    Every item is still consumed (DTensor gathers are collectives every rank takes part in)."""
    for name, tensor in items:
        if ".lora_A." in name or ".lora_B." in name:
            yield name, tensor


def save_adapter_config(module: torch.nn.Module, hf_dir: str, base_path: str) -> None:
    """Write peft's ``adapter_config.json`` of a wrapped actor to ``hf_dir`` (marks a LoRA checkpoint for
    ``hybridflow export``); ``base_path`` is recorded as the adapter's base model."""
    config = module.peft_config["default"]
    config.base_model_name_or_path = base_path
    config.save_pretrained(hf_dir)


def is_lora_checkpoint(hf_dir: str) -> bool:
    """Whether an actor checkpoint's ``hf/`` directory holds a LoRA adapter config."""
    return os.path.exists(os.path.join(hf_dir, ADAPTER_CONFIG))


def lora_problems(get: Callable[[str], Any]) -> list[str]:
    """Config-load checks of the LoRA keys (one line per problem); empty when LoRA is off and keys are sane."""
    problems = []
    model = "actor_rollout_ref.model"
    sync = get("actor_rollout_ref.rollout.lora_sync")
    if sync not in LORA_SYNC_MODES:
        problems.append(f"actor_rollout_ref.rollout.lora_sync must be one of {' | '.join(LORA_SYNC_MODES)}, "
                        f"got {sync!r}")
    for role in ROLES_WITHOUT_LORA:
        if (get(f"{role}.model.lora_rank") or 0) > 0:
            problems.append(f"{role}.model.lora_rank: LoRA is implemented for the actor and the "
                            f"critic (actor_rollout_ref.model.lora_rank, critic.model.lora_rank); set {role}.model.lora_rank=0")
    critic_rank = get("critic.model.lora_rank") or 0
    if critic_rank < 0:
        problems.append(f"critic.model.lora_rank must be >= 0 (0: full fine-tuning), got {critic_rank}")
    elif critic_rank > 0:
        problems += _key_problems(get, "critic.model")
    rank = get(f"{model}.lora_rank")
    if rank < 0:
        problems.append(f"{model}.lora_rank must be >= 0 (0: full fine-tuning), got {rank}")
    if rank <= 0:
        return problems
    problems += _key_problems(get, model)  # what the rollout backend takes: config.checks.lora_rollout_problems
    if get("actor_rollout_ref.actor.tensor_model_parallel_size") > 1:
        problems.append(f"{model}.lora_rank > 0 with actor_rollout_ref.actor.tensor_model_parallel_size > 1 is not "
                        "implemented (tensor-parallel plans do not cover peft's LoRA layers): use tp 1")
    return problems


def _key_problems(get: Callable[[str], Any], model: str) -> list[str]:
    """The checks of one model's ``lora_*`` keys (``model``: ``actor_rollout_ref.model`` or ``critic.model``),
    with its ``lora_rank`` > 0."""
    problems = []
    if importlib.util.find_spec("peft") is None:
        problems.append(f"{model}.lora_rank > 0 needs the peft package (pip install -e \".[lora]\" or pip install "
                        "peft)")
    if get(f"{model}.lora_alpha") <= 0:
        problems.append(f"{model}.lora_alpha must be > 0, got {get(f'{model}.lora_alpha')}")
    if not 0.0 <= get(f"{model}.lora_dropout") < 1.0:
        problems.append(f"{model}.lora_dropout must be in [0, 1), got {get(f'{model}.lora_dropout')}")
    target = get(f"{model}.target_modules")
    if not (target == "all-linear" or (isinstance(target, Sequence) and target
                                       and all(isinstance(t, str) for t in target))):
        problems.append(f"{model}.target_modules must be 'all-linear' or a non-empty list of module names, "
                        f"got {target!r}")
    exclude = get(f"{model}.exclude_modules")
    if exclude is not None and not (isinstance(exclude, Sequence) and all(isinstance(e, str) for e in exclude)):
        problems.append(f"{model}.exclude_modules must be null or a list of module names, got {exclude!r}")
    return problems


PROBE_LENGTH = 16  # tokens of the fixed sync probe
# max |trainer - rollout| greedy logprob on the probe; other dtypes: PROBE_ATOL_LOW. The trainer's W x + s B A x and
# the rollout's merged weights round differently, and each side rounds its logits to the dtype: bf16 (8 significant
# bits) steps a logit in [16, 32) by 2**-3, so two steps, 0.25 (the built-in tiny models' probe logits reach ~16:
# 0.065 seen).
PROBE_ATOL = {"float32": 1e-4, "bfloat16": 2 * 2**-3}
PROBE_ATOL_LOW = 5e-2  # fp16 (11 significant bits: a logit in [16, 32) steps by 2**-6)


def probe_ids(vocab_size: int, device: Any) -> "torch.Tensor":
    """The fixed sync probe: (1, PROBE_LENGTH) int64 token ids spread over the vocabulary."""
    import torch

    return (torch.arange(PROBE_LENGTH, device=device) * 7919 + 3).remainder(vocab_size).unsqueeze(0)


def greedy_logprobs(module: "torch.nn.Module", ids: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
    """Next-token argmax ids (1, L) int64 and their logprobs (1, L) fp32 of ``module`` on ``ids`` (eval mode,
    no grad). A sharded (FSDP2) module must be called on every rank of its mesh."""
    import torch

    was_training = module.training
    module.eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(module(input_ids=ids).logits.float(), dim=-1)
    module.train(was_training)
    best, tokens = logprobs.max(dim=-1)
    return tokens, best


def verify_sync(trainer: "torch.nn.Module", rollout: "torch.nn.Module", vocab_size: int) -> dict[str, float]:
    """Check that ``rollout`` generates from the trainer's current policy: the greedy logprobs of both on the fixed
    probe agree within :data:`PROBE_ATOL` (fp32) or :data:`PROBE_ATOL_LOW`. Every rank of the trainer's mesh
    calls this (the trainer's forward is sharded).

    Returns:
        ``sync/verified`` (1.0), ``sync/probe_max_abs_diff`` and ``sync/probe_logprob_sum`` (the trainer's probe
        value, which moves with every update).

    Raises:
        RuntimeError: the rollout's probe differs from the trainer's (its weights did not arrive).
    """
    device = next(rollout.parameters()).device
    ids = probe_ids(vocab_size, device)
    trainer_tokens, trainer_lp = greedy_logprobs(trainer, ids)
    rollout_tokens, rollout_lp = greedy_logprobs(rollout, ids)
    diff = float((trainer_lp - rollout_lp.to(trainer_lp.device)).abs().max())
    dtype = str(next(rollout.parameters()).dtype).removeprefix("torch.")
    atol = PROBE_ATOL.get(dtype, PROBE_ATOL_LOW)
    if not diff <= atol:
        raise RuntimeError(f"LoRA weight sync failed: the rollout's greedy logprobs on the probe differ from the "
                           f"trainer's by {diff:.3g} (> {atol:g}); the rollout is not generating from the updated "
                           "policy")
    return {"sync/verified": 1.0, "sync/probe_max_abs_diff": diff,
            "sync/probe_logprob_sum": float(trainer_lp.sum())}

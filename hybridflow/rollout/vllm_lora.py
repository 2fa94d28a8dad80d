"""LoRA adapters in the ``vllm`` rollout backend (``rollout.lora_sync=adapter``; Hu et al. 2021, "LoRA").

The engine is started with LoRA enabled (``enable_lora``, one adapter slot, ``max_lora_rank`` the smallest rank
vLLM accepts that holds the actor's ``lora_rank``). A sync writes the trainer's ``A`` (r, in) and ``B`` (out, r)
as a peft adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``, under a temporary directory
of this process) and loads it into the engine under one fixed adapter id with ``load_inplace``, which replaces the
engine's copy of that adapter; every later generation request carries that adapter. vLLM 0.32 has no public
in-memory adapter load, so the adapter goes through a file (its size is the adapters', not the model's).

vLLM scales ``B A`` by ``lora_alpha / r`` from the adapter config and packs q/k/v and gate/up adapters into its
fused layers itself, so the peft names of the trainer are written unchanged (minus peft's adapter name).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from typing import Any, Iterable, Optional

import torch

logger = logging.getLogger(__name__)

__all__ = ["VLLMAdapter", "engine_lora_kwargs", "vllm_max_lora_rank", "write_peft_adapter"]

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed max_lora_rank values (LoRAConfig)
ADAPTER_NAME = "hybridflow-actor"
ADAPTER_ID = 1  # one adapter per engine: the actor's, replaced in place at every sync


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds adapters of rank ``rank``.

    Raises:
        ValueError: ``rank`` is larger than vLLM's largest LoRA rank.
    """
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"actor_rollout_ref.model.lora_rank={rank} is above vLLM's largest LoRA rank "
                     f"{VLLM_LORA_RANKS[-1]}: use lora_sync=merged or a smaller rank")


def engine_lora_kwargs(rank: int) -> dict[str, Any]:
    """Engine arguments that enable one LoRA adapter of rank ``rank`` (``LLM(**kwargs)``)."""
    return {"enable_lora": True, "max_loras": 1, "max_cpu_loras": 1, "max_lora_rank": vllm_max_lora_rank(rank)}


def write_peft_adapter(weights: Iterable[tuple[str, torch.Tensor]], rank: int, alpha: float, directory: str) -> int:
    """Write ``(peft name, tensor)`` adapter pairs as a peft adapter directory that vLLM (and peft) load.

    Args:
        weights: ``...<module>.lora_A.<adapter>.weight`` (r, in) and ``...lora_B.<adapter>.weight`` (out, r)
            under peft's names (``base_model.model.`` prefix), as :func:`hybridflow.models.lora.adapter_items`
            yields them; any dtype.
        rank, alpha: the adapters' ``r`` and ``lora_alpha`` (the scale ``alpha / r``).
        directory: written (created if missing); existing adapter files are replaced.

    Returns:
        The number of tensors written.

    Raises:
        ValueError: no adapter tensors, or a name that is not a peft LoRA A/B weight.
    """
    from peft import LoraConfig
    from safetensors.torch import save_file

    tensors, modules = {}, set()
    for name, tensor in weights:
        for kind in ("lora_A", "lora_B"):
            if f".{kind}." in name:
                prefix, _, rest = name.partition(f".{kind}.")
                leaf = rest.split(".")[-1]  # "default.weight" -> "weight"
                tensors[f"{prefix}.{kind}.{leaf}"] = tensor.detach().to("cpu").contiguous()
                modules.add(prefix.rsplit(".", 1)[-1])
                break
        else:
            raise ValueError(f"vllm adapter sync: {name!r} is not a LoRA A/B weight")
    if not tensors:
        raise ValueError("vllm adapter sync: no adapter tensors were given")
    os.makedirs(directory, exist_ok=True)
    config = LoraConfig(r=int(rank), lora_alpha=float(alpha), target_modules=sorted(modules), lora_dropout=0.0,
                        bias="none", task_type="CAUSAL_LM")
    config.save_pretrained(directory)
    save_file(tensors, os.path.join(directory, "adapter_model.safetensors"))
    return len(tensors)


class VLLMAdapter:
    """The actor's adapter in one vLLM engine: its directory, and the request generation passes.

    Args:
        rank, alpha: the actor's ``lora_rank`` and ``lora_alpha``.
    """

    def __init__(self, rank: int, alpha: float) -> None:
        self.rank, self.alpha = int(rank), float(alpha)
        self._dir: Optional[str] = None
        self.request = None  # vllm LoRARequest once an adapter was loaded; None: the base model generates
        self.version = 0  # adapters loaded so far

    def load(self, llm, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Write ``weights`` (see :func:`write_peft_adapter`) and load them into ``llm`` in place of the previous
        adapter. Raises whatever vLLM raises for an adapter it cannot load (wrong names, rank too large)."""
        from vllm.lora.request import LoRARequest

        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="hybridflow-vllm-lora-")
        count = write_peft_adapter(weights, self.rank, self.alpha, self._dir)
        request = LoRARequest(ADAPTER_NAME, ADAPTER_ID, self._dir, load_inplace=True)
        if not llm.llm_engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the LoRA adapter written to {self._dir}")
        self.request = LoRARequest(ADAPTER_NAME, ADAPTER_ID, self._dir)  # generation: use the loaded copy
        self.version += 1
        logger.debug("vllm adapter %d loaded: %d tensors", self.version, count)

    def close(self) -> None:
        """Delete the adapter directory (idempotent)."""
        directory, self._dir = self._dir, None
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)

"""The ``fsdp2`` training engine: FSDP2 (``fully_shard``) over dp, DTensor tensor parallelism over tp inside it
(:func:`hybridflow.distributed.tp.parallelize_model`), AdamW, host offload, ``torch.distributed.checkpoint``. A model
small enough to hold whole on every rank is replicated instead (``fsdp_config.fsdp_size``:
:mod:`hybridflow.distributed.replicate`): plain tensors, gradients averaged once per optimizer step.

Shapes: (B, R) = sequences of the micro-batch, response tokens; (B, L) = prompt + response tokens; V vocabulary.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator, Optional

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from hybridflow.algorithms import entropy_from_logits, logprobs_from_logits
from hybridflow.algorithms.sampling import SamplingSpec, sampling_logits
from hybridflow.distributed import (build_mesh, iter_full_state, offload_module, offload_optimizer, onload_module,
                                    onload_optimizer, parallelize_model, resolve_dtype,
                                    resolve_reshard_after_forward)
from hybridflow.distributed.checkpoint import load_sharded, save_sharded
from hybridflow.distributed.precision import mixed_precision_policy, training_dtypes
from hybridflow.distributed.replicate import GradientBuckets, resolve_fsdp_size
from hybridflow.distributed.tp import tp_dims
from hybridflow.models.vlm import freeze_vision_tower, install_dummy_vision
from hybridflow.protocol import DataProto
from hybridflow.training.base import EngineSpec, ParallelLayout, TrainEngine, WeightSpec
from hybridflow.training.dtype_probe import model_step_timer
from hybridflow.training.micro import apply_gradients, response_forward
from hybridflow.training.packing import packed_forward, use_fp32_attention_backward
from hybridflow.training.optim import build_lr_scheduler, build_optimizer
from hybridflow.training.routing_replay import moe_forward, moe_outputs
from hybridflow.training.ulysses import check_ulysses_attention, ulysses_forward
from hybridflow.distributed.sequence_parallel import new_sp_group

logger = logging.getLogger(__name__)

__all__ = ["FSDP2Engine"]


def _load_module(spec: EngineSpec, dtype: torch.dtype) -> torch.nn.Module:
    """The Hugging Face module of ``spec.kind`` on CPU (LoRA-wrapped and checkpointed as ``spec`` says)."""
    from hybridflow.models import hf
    from hybridflow.models import lora as lora_lib

    model = spec.model
    if spec.kind == "score":
        return hf.load_score_model(model.path, dtype, model.trust_remote_code)
    load = hf.load_causal_lm if spec.kind == "policy" else hf.load_value_model
    module = load(model.path, dtype, model.trust_remote_code)
    if spec.optim is None:
        return module.requires_grad_(False)
    if spec.lora:  # before FSDP2: only the adapters require grad, so only they get optimizer state
        # a value model keeps its head in full (trained) with adapters on the backbone
        module = (lora_lib.apply_critic_lora if spec.kind == "value" else lora_lib.apply_lora)(
            module, spec.lora_config or model)
    if getattr(model, "freeze_vision_tower", False):
        freeze_vision_tower(module)  # a VLM's vision tower: no gradients, no optimizer state
    if model.enable_gradient_checkpointing:
        module.gradient_checkpointing_enable()
    return module


def _reshard(module: torch.nn.Module) -> None:
    """Make FSDP2 modules expose their sharded parameters (the root may stay unsharded after a forward)."""
    from torch.distributed.fsdp import FSDPModule

    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


# registered (lazily, with its config section, checks and abilities) by hybridflow.training.fsdp2_config
class FSDP2Engine(TrainEngine):
    """FSDP2 + DTensor tp (see the module docstring). Build with :meth:`build`, or wrap a module that is already
    laid out (or plain, single process) with :meth:`from_module`.

    Raises (build):
        ValueError: ``layout.pp > 1`` (this engine has no pipeline parallelism), or a layout that does not match
            the world size.
    """

    def __init__(self, spec: EngineSpec, module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                 lr_scheduler: Any = None, mesh: Optional[DeviceMesh] = None, replicated: bool = False,
                 autocast_dtype: Optional[torch.dtype] = None, compute_dtype: Optional[torch.dtype] = None,
                 sp_group: Any = None) -> None:
        self.spec = spec
        self.replicated = replicated  # plain full tensors on every dp rank (not FSDP2 shards)
        self.autocast_dtype = autocast_dtype  # replicated mixed precision: forwards under torch.autocast
        self._grads: Optional[GradientBuckets] = None  # replicated: the gradients' flat buffers (first use)
        self.layout = spec.layout
        self.module = module
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.mesh = mesh
        self.skipped_steps = 0
        self.applied_update = False  # an optimizer update went through since the last lr_scheduler_step
        self.compute_dtype = compute_dtype  # the forwards' dtype (None: not known, e.g. from_module)
        self.sp_group = sp_group  # Ulysses: the ranks sharing this rank's micro-batches (None: sp=1)

    @classmethod
    def build(cls, spec: EngineSpec) -> "FSDP2Engine":
        if spec.layout.pp != 1:
            raise ValueError(f"strategy fsdp2 has no pipeline parallelism; got pp={spec.layout.pp} for the {spec.role}")
        mesh = build_mesh(dp=spec.layout.dp * spec.layout.sp, tp=spec.layout.tp)  # FSDP over dp x sp (data: dp)
        sp_group = new_sp_group(spec.layout.sp, spec.layout.tp)
        module = _load_module(spec, resolve_dtype(spec.model.dtype, spec.device))
        check_ulysses_attention(module, spec.layout.sp, spec.role)  # sp > 1: sdpa only (one line otherwise)
        # dtype auto on CPU: bf16 compute over the fp32 weights where the model's matmul shapes run faster in bf16
        # (a collective); a LoRA actor computes in fp32, so the rollout-sync probe can tell a stale rollout
        # (a reference follows its actor's answer: spec.auto_bf16)
        lora_actor = bool(spec.lora) and spec.kind == "policy"
        given = False if lora_actor else spec.auto_bf16
        weights, compute = training_dtypes(spec.model.dtype, spec.device,
                                           probe=None if given is None else (lambda: given),
                                           timer=model_step_timer(module, trained=spec.optim is not None))
        if lora_actor and spec.model.dtype == "auto" and spec.device == "cpu":
            logger.info("dtype=auto with LoRA: the %s computes in fp32 (the merged-weight sync probe needs fp32 "
                        "on both sides)", spec.role)
        if spec.device == "cpu" and (compute or weights) in (torch.bfloat16, torch.float16):
            use_fp32_attention_backward(module)  # torch's bf16 CPU attention backward is the slow kernel
        replicated = resolve_fsdp_size(spec.fsdp_size, module, spec.device, trained=spec.optim is not None,
                                       param_offload=spec.param_offload, lora=spec.lora, tp=spec.layout.tp,
                                       dp=spec.layout.dp * spec.layout.sp)
        autocast = compute if replicated and compute not in (None, weights) else None
        if replicated:
            module = module.to(spec.device)
        else:
            reshard = resolve_reshard_after_forward(spec.reshard_after_forward, module, spec.device,
                                                    spec.param_offload, spec.lora)
            module = parallelize_model(module.to(spec.device), mesh, reshard_after_forward=reshard,
                                       mp_policy=mixed_precision_policy(compute))
            install_dummy_vision(module)  # a VLM: image-less micro-batches still run the sharded vision tower
        optimizer = scheduler = None
        if spec.optim is not None:
            optimizer = build_optimizer(module, spec.optim)
            scheduler = build_lr_scheduler(optimizer, spec.optim, spec.total_steps)
        return cls(spec, module, optimizer, scheduler, mesh, replicated, autocast, compute or weights, sp_group)

    @classmethod
    def from_module(cls, module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
                    kind: str = "policy", mesh: Optional[DeviceMesh] = None, grad_clip: float = 1.0,
                    nonfinite_grad: str = "skip", role: str = "actor", param_offload: bool = False,
                    optimizer_offload: bool = False, lr_scheduler: Any = None,
                    remove_padding: bool = False, replicated: bool = False, sp: int = 1) -> "FSDP2Engine":
        """An engine over an existing module (FSDP2-sharded on ``mesh``, or plain when ``mesh`` is None;
        ``replicated``: plain on every rank of ``mesh``, gradients averaged over it in :meth:`optimizer_step`;
        ``sp``: Ulysses sequence-parallel ranks per dp group, adjacent ranks of ``mesh``'s dp axis)."""
        tp = mesh["tp"].size() if mesh is not None and mesh.ndim == 2 else 1
        world = mesh.size() if mesh is not None else 1
        spec = EngineSpec(kind=kind, model=None, layout=ParallelLayout(dp=world // (tp * sp), tp=tp, sp=sp),
                          device=next(module.parameters()).device.type, grad_clip=grad_clip,
                          nonfinite_grad=nonfinite_grad, param_offload=param_offload,
                          optimizer_offload=optimizer_offload, role=role, remove_padding=remove_padding)
        return cls(spec, module, optimizer, lr_scheduler, mesh, replicated, sp_group=new_sp_group(sp, tp))

    # ------------------------------------------------------------------ compute
    def set_train(self, mode: bool) -> None:
        if mode:  # training starts from the shards (a no-grad forward may have left them gathered:
            _reshard(self.module)  # reshard_after_forward false), so its forwards gather with autograd on
        self.module.train(mode)

    def forward(self, micro: DataProto, *, sampling: Optional[SamplingSpec] = None,
                entropy: bool = False) -> dict[str, torch.Tensor]:
        # an MoE model: replays the micro-batch's routed_experts and adds router_aux_loss / expert_load
        with moe_forward(self.module, micro, self.spec.kind, self.spec.remove_padding, self.sp_group) as routing:
            if self.autocast_dtype is None:
                out = self._forward(micro, sampling, entropy)
            else:  # replicated with bf16 compute over fp32 weights: autocast does the cast FSDP2's policy does
                with torch.autocast(self.spec.device, dtype=self.autocast_dtype):  # when sharded
                    out = self._forward(micro, sampling, entropy)
        return {**out, **moe_outputs(self.module, routing, micro, self.spec.kind, self.spec.remove_padding,
                                     self.sp_group)}

    def _forward(self, micro: DataProto, sampling: Optional[SamplingSpec], entropy: bool) -> dict[str, torch.Tensor]:
        if self.sp_group is not None:  # Ulysses: the sequence split over the sp group
            return ulysses_forward(self.module, micro, self.spec.kind, self.spec.remove_padding, self.sp_group,
                                   sampling, entropy)
        b = micro.batch
        if self.spec.kind == "score":
            if self.spec.remove_padding:  # one packed row of the valid tokens
                return {"token_scores": packed_forward(self.module, micro).squeeze(-1).float()}
            out = self.module(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                              position_ids=b["position_ids"], use_cache=False)
            return {"token_scores": out.logits.squeeze(-1).float()}
        responses = b["responses"]
        out = response_forward(self.module, micro, responses.shape[1], self.spec.remove_padding)
        if self.spec.kind == "value":
            return {"values": out.squeeze(-1).float()}
        logits = sampling_logits(out.float(), sampling or SamplingSpec(), keep=responses)
        result = {"log_probs": logprobs_from_logits(logits, responses)}
        if entropy:
            result["entropy"] = entropy_from_logits(logits)
        return result

    def zero_grad(self) -> None:
        if self.replicated:  # gradients live in flat buffers, zeroed in place
            self._gradient_buckets().zero()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def _gradient_buckets(self) -> GradientBuckets:
        """The replicated model's gradient buffers, built on first use (keeping any gradients already there)."""
        if self._grads is None:
            self._grads = GradientBuckets(self.module.parameters())
        return self._grads

    def optimizer_step(self) -> tuple[float, bool]:
        if self.replicated:  # the dp mean FSDP2's reduce-scatter would have taken
            self._gradient_buckets().all_reduce(self.mesh.get_group() if self.mesh is not None else None)
        grad_norm, skipped = apply_gradients(self.module, self.optimizer, self.spec.grad_clip,
                                             self.spec.nonfinite_grad, self.spec.role)
        self.skipped_steps += int(skipped)
        self.applied_update = self.applied_update or not skipped
        return grad_norm, skipped

    def lr_scheduler_step(self) -> float:
        lr = self.lr_scheduler.get_last_lr()[0]
        if self.applied_update:  # the schedule counts applied updates (a fully skipped step leaves it)
            self.lr_scheduler.step()
        self.applied_update = False
        return lr

    # ------------------------------------------------------------------ weights
    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter_full_state(self.module)

    def iter_shards(self) -> Iterator[tuple[str, torch.Tensor]]:
        _reshard(self.module)
        for name, param in self.module.named_parameters():
            yield name, (param.to_local() if isinstance(param, DTensor) else param.detach())

    def weight_specs(self) -> dict[str, WeightSpec]:
        dims = tp_dims(self.module, "train") if self.layout.tp > 1 else {}
        dp_dim = None if self.replicated else 0  # replicated: every dp rank holds the whole tensor
        return {name: WeightSpec(tuple(p.shape), p.element_size(), dims.get(name), dp_dim)
                for name, p in self.module.named_parameters()}

    # ------------------------------------------------------------------ state
    def save_checkpoint(self, path: str, extra: Optional[dict[str, Any]] = None) -> None:
        _reshard(self.module)  # reshard_after_forward=false may have left gathered weights after a forward
        state = dict(extra or {})
        if self.lr_scheduler is not None:
            state["lr_scheduler"] = self.lr_scheduler.state_dict()
        state["skipped_steps"] = self.skipped_steps
        save_sharded(path, self.module, self.optimizer, state)

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        # a gathered copy left by a forward would be stale once the shards are loaded (DCP's state_dict path
        # reshards too; the engine does not rely on it)
        _reshard(self.module)
        extra = load_sharded(path, self.module, self.optimizer)
        self._grads = None  # rebuilt on the module's (possibly new) parameters at the next zero_grad
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(extra.pop("lr_scheduler"))
        self.skipped_steps = int(extra.pop("skipped_steps", 0))
        return extra

    def offload(self) -> None:
        if self.spec.param_offload:
            _reshard(self.module)  # only the shards are moved: free any gathered copy first
            offload_module(self.module)
        if self.spec.optimizer_offload and self.optimizer is not None:
            offload_optimizer(self.optimizer)

    def onload(self, optimizer: bool = True) -> None:
        if self.spec.param_offload:
            onload_module(self.module, self.spec.device)
        if optimizer and self.spec.optimizer_offload and self.optimizer is not None:
            onload_optimizer(self.optimizer, self.spec.device)

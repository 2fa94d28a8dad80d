"""Build and checkpoint helpers of the ``megatron`` engine (:mod:`hybridflow.training.megatron`): parallel state on
the worker group's ``torch.distributed`` world, the stage's ``GPTModel`` loaded from the HF checkpoint, Megatron
DDP + distributed optimizer, the lr schedule, and the per-rank checkpoint state.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from hybridflow.errors import UserError
from hybridflow.training.base import EngineSpec, ParallelLayout
from hybridflow.training.megatron_cpu import cpu_adapter

__all__ = ["ExpertLayoutError", "build_megatron_model", "check_experts", "gather_experts", "checkpoint_state", "ep_rank_of", "restore_state", "stage_of"]

MEGATRON_INSTALL = 'strategy megatron needs megatron-core: pip install -e ".[megatron]"'


def stage_of(layout: ParallelLayout) -> int:
    """This rank's pipeline stage."""
    return layout.coords(dist.get_rank())[2]


class ExpertLayoutError(UserError, ValueError):
    """``expert_model_parallel_size`` does not fit the model (a dense model, or experts not divisible by it)."""


def check_experts(hf_config: Any, ep: int, role: str) -> None:
    """Refuse expert parallelism the model cannot take.

    Raises:
        ExpertLayoutError: ``ep > 1`` for a model without experts, or its experts per layer not divisible by ``ep``.
    """
    from hybridflow.models.megatron_moe import is_moe, num_experts

    if ep == 1:
        return
    key = f"{role}.megatron.expert_model_parallel_size={ep}"
    if not is_moe(hf_config):
        raise ExpertLayoutError(f"{key} needs a mixture-of-experts model (qwen3_moe, qwen2_moe, mixtral); "
                                f"{getattr(hf_config, 'model_type', '?')} has no experts")
    if num_experts(hf_config) % ep:
        raise ExpertLayoutError(f"{key} must divide the model's {num_experts(hf_config)} experts per layer")


def gather_experts(shard: torch.Tensor, ep_dim: Optional[int], ep: int) -> torch.Tensor:
    """The whole expert tensor (E, ...) from each EP rank's ``shard`` (E/ep, ...): all-gather over Megatron's
    expert-parallel group, concatenated along ``ep_dim`` in EP-rank order; ``shard`` itself when ``ep_dim`` is None
    or ``ep == 1``. Collective: every rank of the group calls it for the same tensor."""
    if ep_dim is None or ep == 1:
        return shard
    from megatron.core import parallel_state as ps

    parts = [torch.empty_like(shard) for _ in range(ep)]
    dist.all_gather(parts, shard.contiguous(), group=ps.get_expert_model_parallel_group())
    return torch.cat(parts, dim=ep_dim)


def ep_rank_of(layout: ParallelLayout, rank: int) -> int:
    """The expert-parallel rank of global ``rank``: Megatron's expert groups (order ``tp-cp-ep-dp-pp``, expert
    tensor parallelism 1) are runs of ``ep`` consecutive ranks of a stage's ``dp * tp`` ranks."""
    dp_rank, tp_rank, _ = layout.coords(rank)
    return (dp_rank * layout.tp + tp_rank) % layout.ep


def init_parallel_state(layout: ParallelLayout, seed: int, device: str) -> None:
    """Megatron's tp/pp/dp groups over the existing world (rank order tp, dp, pp: :class:`ParallelLayout`), and
    its model-parallel RNG tracker seeded with ``seed`` (the torch RNG state is kept). Reuses a state already set
    with the same sizes.

    Raises:
        ImportError: megatron-core is not installed.
        ValueError: the world is not ``layout.world`` ranks, or another (tp, pp) is already set in this process.
    """
    try:
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    except ImportError as err:
        raise ImportError(MEGATRON_INSTALL) from err
    world = dist.get_world_size()
    if world != layout.world:
        raise ValueError(f"megatron layout {layout} needs {layout.world} ranks, the worker group has {world}")
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_expert_model_parallel_world_size())
        if have != (layout.tp, layout.pp, layout.ep):
            raise ValueError(f"megatron parallel state is set to (tp, pp, ep)={have} in this process; all megatron "
                             f"engines of one worker share it, got (tp, pp, ep)=({layout.tp}, {layout.pp}, "
                             f"{layout.ep})")
        return
    ps.initialize_model_parallel(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
                                 expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=1,
                                 order="tp-cp-ep-dp-pp")
    state = torch.get_rng_state()
    with cpu_adapter(device):
        model_parallel_cuda_manual_seed(seed)
    torch.set_rng_state(state)


def _hf_state(spec: EngineSpec, dtype: torch.dtype) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """``(HF module with its parameters on the meta device, full HF state dict on CPU)`` of ``spec.model``: the
    module keeps ``config`` and ``generation_config`` (the engine's ``module``, e.g. for checkpoints' ``hf/``) and
    its buffers (rotary tables) on ``spec.device`` for the 3D-HybridEngine's generation model; no parameter data."""
    from hybridflow.models import hf

    load = hf.load_causal_lm if spec.kind == "policy" else hf.load_value_model
    module = load(spec.model.path, dtype, spec.model.trust_remote_code)
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    buffers = [(name, buf) for name, buf in module.named_buffers()]
    module.to("meta")
    for name, buf in buffers:
        owner, _, leaf = name.rpartition(".")
        module.get_submodule(owner)._buffers[leaf] = buf.to(spec.device)
    return module, state


def _optimizer(spec: EngineSpec, gpt: torch.nn.Module, dtype: torch.dtype) -> tuple[Any, Any, list]:
    """``(DDP model, distributed optimizer, lr schedulers)``: AdamW (weight decay on every parameter, as the
    fsdp2 engine's), grads reduced in fp32, clipping done by :meth:`MegatronEngine.optimizer_step`."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from hybridflow.training.optim import build_lr_scheduler

    optim = spec.optim
    ddp = DistributedDataParallel(gpt.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=False), gpt)
    gpt.config.finalize_model_grads_func = finalize_model_grads
    gpt.config.no_sync_func = ddp.no_sync
    config = OptimizerConfig(optimizer="adam", lr=optim.lr, weight_decay=optim.weight_decay,
                             adam_beta1=float(optim.betas[0]), adam_beta2=float(optim.betas[1]),
                             clip_grad=0.0, use_distributed_optimizer=True, params_dtype=dtype,
                             bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
    optimizer = get_megatron_optimizer(config, [ddp], config_overrides={})
    inner = [opt.optimizer for opt in getattr(optimizer, "chained_optimizers", [optimizer])]
    schedulers = [build_lr_scheduler(opt, optim, spec.total_steps) for opt in inner]
    return ddp, optimizer, schedulers


def build_megatron_model(spec: EngineSpec) -> dict[str, Any]:
    """Everything :class:`MegatronEngine` holds for ``spec`` on this rank (``gpt``, ``model``, ``hf_config``,
    ``hf_module`` (meta device), ``params``, ``optimizer``, ``lr_scheduler``).

    Raises:
        ImportError / ValueError: see :func:`init_parallel_state`; ``ValueError`` for a score model, LoRA, or host
            offload on GPU (not implemented for this engine).
    """
    from hybridflow.distributed.precision import training_dtypes
    from hybridflow.models.megatron_convert import hf_params
    from hybridflow.models.megatron_model import build_gpt_model, load_local_state, local_state_from_hf

    if spec.kind == "score" or spec.lora:
        raise ValueError(f"strategy megatron does not run {'LoRA' if spec.lora else 'score models'} "
                         f"({spec.role}); use strategy fsdp2")
    if (spec.param_offload or spec.optimizer_offload) and spec.device != "cpu":
        raise ValueError(f"strategy megatron does not offload to host memory yet ({spec.role}); set "
                         "fsdp_config.param_offload/optimizer_offload to false")
    layout = spec.layout
    init_parallel_state(layout, torch.initial_seed() % (2**31), spec.device)
    dtype, _ = training_dtypes(spec.model.dtype, spec.device, probe=lambda: False)
    hf_module, hf_state = _hf_state(spec, dtype)
    hf_config = hf_module.config
    check_experts(hf_config, layout.ep, spec.role)
    _, tp_rank, pp_rank = layout.coords(dist.get_rank())
    with cpu_adapter(spec.device):
        gpt = build_gpt_model(hf_config, spec.kind, tp=layout.tp, pp=layout.pp, pp_rank=pp_rank, dtype=dtype,
                              device=spec.device, ep=layout.ep)
        load_local_state(gpt, local_state_from_hf(hf_state, hf_config, spec.kind, tp=layout.tp, tp_rank=tp_rank,
                                                  pp=layout.pp, pp_rank=pp_rank, ep=layout.ep,
                                                  ep_rank=ep_rank_of(layout, dist.get_rank())))
        del hf_state
        parts: dict[str, Any] = {"gpt": gpt, "model": gpt, "hf_config": hf_config, "hf_module": hf_module,
                                 "params": hf_params(hf_config, spec.kind, layout.pp)}
        if spec.optim is None:
            gpt.requires_grad_(False)
        else:
            parts["model"], parts["optimizer"], parts["lr_scheduler"] = _optimizer(spec, gpt, dtype)
    return parts


def checkpoint_state(engine: Any, extra: Optional[dict[str, Any]]) -> dict[str, Any]:
    """This rank's checkpoint: local model parameters, the inner optimizers' states (this rank's dp shard of the
    distributed optimizer: Adam moments and step), the fp32 main copies of bf16/fp16 parameters (that shard; empty
    lists in fp32, where the optimizer steps the parameters themselves), lr schedules, RNG (torch + Megatron's
    tracker), ``skipped_steps`` and ``extra``."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from hybridflow.distributed.checkpoint import rng_state

    state = {"model": {k: v.detach().clone() for k, v in engine.gpt.named_parameters()},
             "rng": rng_state(), "tracker": get_cuda_rng_tracker().get_states(),
             "skipped_steps": engine.skipped_steps, "extra": dict(extra or {}),
             # what hybridflow.models.megatron_export needs to rebuild HF tensors offline
             "layout": (engine.layout.dp, engine.layout.tp, engine.layout.pp), "ep": engine.layout.ep,
             "kind": engine.spec.kind}
    if engine.optimizer is not None:
        opts = getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])
        state["optim"] = [opt.optimizer.state_dict() for opt in opts]
        state["main_params"] = [[p.detach().clone() for p in group] for opt in opts
                                for group in opt.shard_fp32_from_float16_groups]
        state["lr_scheduler"] = [s.state_dict() for s in engine.lr_scheduler]
    return state


def _restore_main_params(opts: list, saved: Optional[list[list[torch.Tensor]]]) -> None:
    """Copy the saved fp32 main copies of bf16/fp16 parameters (this rank's dp shard, one list per parameter group
    of each distributed optimizer) into ``opts``. Without them (a checkpoint written before they were saved) the
    main copies are rebuilt from the just-loaded low-precision weights (a resume, not a bit-exact one).

    Raises:
        ValueError: the saved groups do not match the optimizer's (another model or layout).
    """
    groups = [group for opt in opts for group in opt.shard_fp32_from_float16_groups]
    if saved is None:
        for opt in opts:
            opt.reload_model_params()
        return
    shapes = [[tuple(p.shape) for p in group] for group in groups]
    if shapes != [[tuple(p.shape) for p in group] for group in saved]:
        raise ValueError("the checkpoint's fp32 main parameters do not match this megatron optimizer's shards "
                         "(another model or layout)")
    with torch.no_grad():
        for group, saved_group in zip(groups, saved):
            for param, value in zip(group, saved_group):
                param.copy_(value)


def restore_state(engine: Any, state: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`checkpoint_state` (same layout); returns ``extra``."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from hybridflow.distributed.checkpoint import set_rng_state
    from hybridflow.models.megatron_model import load_local_state

    load_local_state(engine.gpt, state["model"])
    if engine.optimizer is not None:
        opts = getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])
        for opt, saved in zip(opts, state["optim"]):
            opt.optimizer.load_state_dict(saved)
        _restore_main_params(opts, state.get("main_params"))
        for scheduler, saved in zip(engine.lr_scheduler, state["lr_scheduler"]):
            scheduler.load_state_dict(saved)
    set_rng_state(state["rng"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    engine.skipped_steps = int(state["skipped_steps"])
    return state["extra"]

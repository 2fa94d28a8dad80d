"""The ``megatron`` training engine: Megatron-core 0.16 ``GPTModel`` (local layer spec) with tensor parallelism,
pipeline parallelism (its micro-batch schedule) and data parallelism (Megatron DDP + the distributed optimizer),
for the policy (causal LM), the critic (value head) and frozen models (reference). Install with
``pip install -e ".[megatron]"``. On CPU (gloo) megatron-core runs under :mod:`hybridflow.training.megatron_cpu`.

Weights are converted from / to Hugging Face names by :mod:`hybridflow.models.megatron_convert`; the shard
iterator yields HF tp-shards (``dp_dim=None``: replicated over dp; ``pp_stage``: the stage holding the layer).

Megatron's parallel state is process-global: every megatron engine of one process shares one (tp, pp) layout.

Shapes: (B, R) = sequences of the micro-batch, response tokens; (B, L) = prompt + response tokens.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from hybridflow.algorithms.sampling import SamplingSpec
from hybridflow.models.vlm import refuse_vision_model
from hybridflow.protocol import DataProto
from hybridflow.training.base import EngineSpec, TrainEngine, WeightSpec
from hybridflow.training.megatron_cpu import cpu_adapter
from hybridflow.training.megatron_pipeline import broadcast_outputs, make_forward_step
from hybridflow.training.megatron_replay import routing_replay
from hybridflow.training.megatron_setup import build_megatron_model, stage_of

__all__ = ["MegatronEngine"]


# registered (lazily, with its config section, checks and abilities) by hybridflow.training.megatron_config
class MegatronEngine(TrainEngine):
    """Megatron-core tp x pp x dp (see the module docstring); build with :meth:`build`.

    Raises (build):
        ImportError: megatron-core is not installed (names the extra).
        ValueError: the layout does not cover the world, a Megatron layout already set differently in this
            process, dims not divisible by tp / layers not by pp, or host offload asked for on GPU.
    """

    def __init__(self, spec: EngineSpec, parts: dict[str, Any]) -> None:
        self.spec = spec
        self.layout = spec.layout
        self.gpt = parts["gpt"]  # the GPTModel of this rank's stage
        self.model = parts["model"]  # DDP-wrapped (trained) or the GPTModel (frozen)
        self.module = parts["hf_module"]  # the HF module on the meta device: config, generation_config, no data
        self.hf_config = parts["hf_config"]
        self.params = parts["params"]  # HFParam table, HF order
        self.optimizer = parts.get("optimizer")
        self.lr_scheduler = parts.get("lr_scheduler")
        self.skipped_steps = 0
        self.applied_update = False  # an optimizer update went through since the last lr_scheduler_step
        self._adapter = lambda: cpu_adapter(spec.device)
        self.compute_dtype = next(self.gpt.parameters()).dtype  # the forwards' dtype: the weights' (no autocast)
        self._replay = routing_replay(self)  # router_replay=rollout on an MoE model: a before_forward hook

    @classmethod
    def build(cls, spec: EngineSpec) -> "MegatronEngine":
        refuse_vision_model(spec.model.path, "megatron", spec.role)  # VLMs: fsdp2 only (one line)
        return cls(spec, build_megatron_model(spec))

    # ------------------------------------------------------------------ compute
    def set_train(self, mode: bool) -> None:
        self.model.train(mode)

    def _keys(self, entropy: bool) -> list[str]:
        if self.spec.kind == "value":
            return ["values"]
        return ["log_probs", "entropy"] if entropy else ["log_probs"]

    def _run(self, micros: list[DataProto], losses: list[Optional[Callable]], forward_only: bool,
             sampling: Optional[SamplingSpec], entropy: bool) -> list[dict[str, torch.Tensor]]:
        """One pass of Megatron's schedule over ``micros``; every rank gets each micro-batch's outputs."""
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        store: list[dict[str, torch.Tensor]] = []
        step = make_forward_step(self.spec.kind, losses, len(micros), store, sampling, entropy, self._replay)
        seq = max(int(m.batch["attention_mask"].sum(1).max()) for m in micros)
        try:
            with self._adapter():
                get_forward_backward_func()(
                    forward_step_func=step, data_iterator=iter(micros), model=[self.model],
                    num_microbatches=len(micros), seq_length=max(seq, 1),
                    micro_batch_size=max(len(m) for m in micros), forward_only=forward_only)
        finally:
            if self._replay is not None:
                self._replay.clear()
        group = ps.get_pipeline_model_parallel_group()
        return broadcast_outputs(store, micros, self._keys(entropy), ps.is_pipeline_last_stage(),
                                 ps.get_pipeline_model_parallel_last_rank(), group)

    def forward(self, micro: DataProto, *, sampling: Optional[SamplingSpec] = None,
                entropy: bool = False) -> dict[str, torch.Tensor]:
        """The contract's outputs on every rank (the last stage's, broadcast over the pipeline group). They carry
        no autograd graph: training goes through :meth:`forward_backward_micro_batches`.

        Raises:
            ValueError: ``spec.kind`` is ``score`` (not converted for Megatron).
        """
        if self.spec.kind == "score":
            raise ValueError("strategy megatron runs policy and value models; use fsdp2 for a score model")
        return self._run([micro], [None], True, sampling, entropy)[0]

    def forward_backward(self, micro: DataProto, loss_fn: Callable[[dict[str, torch.Tensor]], torch.Tensor], *,
                         sampling: Optional[SamplingSpec] = None, entropy: bool = False) -> torch.Tensor:
        return self.forward_backward_micro_batches([micro], [loss_fn], sampling=sampling, entropy=entropy)[0]

    def forward_backward_micro_batches(self, micros: list[DataProto], loss_fns: list[Callable], *,
                                       sampling: Optional[SamplingSpec] = None,
                                       entropy: bool = False) -> list[torch.Tensor]:
        """All micro-batches of a mini-batch through the pipeline schedule (1F1B), gradients accumulated and
        reduced over dp (and the tied embedding over its stages) at the end.

        ``loss_fns[i]`` runs inside the schedule on the last stage; on the other stages it runs once afterwards,
        under ``no_grad``, on the broadcast outputs, so its side effects (statistics) match on every rank.
        Returns the detached losses (scalars), equal on every rank.
        """
        losses: list[torch.Tensor] = [torch.zeros(())] * len(micros)

        def wrap(i: int) -> Callable:
            def run(outputs: dict[str, torch.Tensor]) -> torch.Tensor:
                losses[i] = loss_fns[i](outputs)
                return losses[i]
            return run

        from megatron.core import parallel_state as ps

        outputs = self._run(micros, [wrap(i) for i in range(len(micros))], False, sampling, entropy)
        if not ps.is_pipeline_last_stage():
            with torch.no_grad():
                losses = [fn(out) for fn, out in zip(loss_fns, outputs)]
        return [loss.detach() for loss in losses]

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def optimizer_step(self) -> tuple[float, bool]:
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        with self._adapter():
            self.optimizer.prepare_grads()
            grad_norm = float(self.optimizer.get_grad_norm())
            if math.isfinite(grad_norm):
                if self.spec.grad_clip > 0:
                    for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                        clip_grad_by_total_norm_fp32(opt.get_parameters(), self.spec.grad_clip, grad_norm)
                self.optimizer.step_with_ready_grads()
                self.applied_update = True
                return grad_norm, False
            self.zero_grad()
        self.skipped_steps += 1
        if self.spec.nonfinite_grad == "error":
            raise FloatingPointError(f"{self.spec.role} gradient norm is {grad_norm} (loss or gradient is NaN/inf); "
                                     "weights left unchanged (trainer.nonfinite_grad=error)")
        return grad_norm, True

    def lr_scheduler_step(self) -> float:
        lr = self.lr_scheduler[0].get_last_lr()[0]
        if self.applied_update:  # the schedule counts applied updates (a fully skipped step leaves it)
            for scheduler in self.lr_scheduler:
                scheduler.step()
        self.applied_update = False
        return lr

    # ------------------------------------------------------------------ weights
    def _local(self) -> dict[str, torch.Tensor]:
        """This rank's Megatron parameters (detached), an MoE layer's local experts stacked (E/ep, out, in)."""
        from hybridflow.models.megatron_moe import stack_experts

        return stack_experts({name: p.detach() for name, p in self.gpt.named_parameters()})

    def iter_shards(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF tp-shards of this rank's stage; an expert tensor is this rank's EP chunk (E/ep, ...) of it, in the
        same order as the HF experts (global expert ``ep_rank * E/ep + j`` is row ``j``)."""
        from hybridflow.models.megatron_convert import hf_shard_from_local

        local, stage = self._local(), stage_of(self.layout)
        for param in self.params:
            if param.pp_stage == stage:
                yield param.name, hf_shard_from_local(param, local[param.mg_name], self.hf_config, self.layout.tp)

    def weight_specs(self) -> dict[str, WeightSpec]:
        size = next(self.gpt.parameters()).element_size()
        ep = self.layout.ep > 1
        return {p.name: WeightSpec(p.shape, size, p.tp_dim if self.layout.tp > 1 else None, dp_dim=None,
                                   pp_stage=p.pp_stage if self.layout.pp > 1 else None,
                                   ep_dim=p.ep_dim if ep else None) for p in self.params}

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF tensors on every rank: gathered over tp on the owning stage, then broadcast over pp (a tied
        model also yields ``lm_head.weight``, as its HF state dict has it)."""
        from megatron.core import parallel_state as ps

        from hybridflow.models.megatron_convert import hf_shard_from_local, merge_tp_shards
        from hybridflow.training.megatron_setup import gather_experts

        local, stage = self._local(), stage_of(self.layout)
        tp_group, pp_group = ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()
        pp_ranks = dist.get_process_group_ranks(pp_group)
        dtype, device = next(self.gpt.parameters()).dtype, next(self.gpt.parameters()).device
        for param in self.params:
            if param.pp_stage == stage:
                shard = hf_shard_from_local(param, local[param.mg_name], self.hf_config, self.layout.tp)
                shard = gather_experts(shard, param.ep_dim, self.layout.ep).contiguous()  # over the EP group
                if param.tp_dim is not None and self.layout.tp > 1:
                    parts = [torch.empty_like(shard) for _ in range(self.layout.tp)]
                    dist.all_gather(parts, shard, group=tp_group)
                    shard = merge_tp_shards(parts, param.tp_dim)
                full = shard.clone()
            else:
                full = torch.empty(param.shape, dtype=dtype, device=device)
            if self.layout.pp > 1:
                dist.broadcast(full, src=pp_ranks[param.pp_stage], group=pp_group)
            yield param.name, full
            if param.name == "model.embed_tokens.weight":
                embedding = full
        if self.spec.kind == "policy" and self.hf_config.tie_word_embeddings:
            yield "lm_head.weight", embedding

    # ------------------------------------------------------------------ state
    def _path(self, path: str) -> str:
        return os.path.join(path, f"megatron_rank_{dist.get_rank()}.pt")

    def save_checkpoint(self, path: str, extra: Optional[dict[str, Any]] = None) -> None:
        from hybridflow.training.megatron_setup import checkpoint_state

        os.makedirs(path, exist_ok=True)
        torch.save(checkpoint_state(self, extra), self._path(path))

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        from hybridflow.training.megatron_setup import restore_state

        file = self._path(path)
        if not os.path.exists(file):
            raise FileNotFoundError(f"no megatron checkpoint for rank {dist.get_rank()} under {path!r} "
                                    f"(missing {file})")
        return restore_state(self, torch.load(file, weights_only=True))

    def offload(self) -> None:
        """A no-op: the build refuses host offload on GPU (not implemented for Megatron's grad buffers)."""

    def onload(self, optimizer: bool = True) -> None:
        """A no-op (see :meth:`offload`)."""

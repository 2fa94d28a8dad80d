"""The training-engine contract: one model of one role (policy, value or score model) trained or evaluated on the
ranks of a worker group, whatever does the parallelism underneath (FSDP2 + DTensor tp today; Megatron-core next).

Workers (actor, reference, critic, reward and cost models) and the 3D-HybridEngine talk to a model only through
this contract; none of them touches FSDP, DTensor or an optimizer directly. Engines register by name with
:func:`~hybridflow.training.engine_registry.register_engine` (re-exported here) and are chosen by the ``strategy``
key of a role's config section
(``actor_rollout_ref.actor.strategy``, ``critic.strategy``, ``reward_model.strategy``, ``cost_model.strategy``).

Lifecycle (every rank of the group calls these together, in the same order: most of them are collectives):

1. ``Engine.build(spec)`` once, in the worker's ``init_model``, after ``torch.distributed`` is initialised and the
   role's seed is set: load the model named by ``spec.model``, lay it out on ``spec.layout``, build the optimizer
   and lr schedule when ``spec.optim`` is given (else the model is frozen). If ``spec.param_offload`` /
   ``spec.optimizer_offload`` are set, the engine starts onloaded; the worker decides when to :meth:`offload`.
2. Per training step, for each mini-batch: :meth:`zero_grad`, then :meth:`forward_backward_micro_batches` with all
   its micro-batches (by default :meth:`forward_backward` once per micro-batch, gradients accumulating; a
   pipeline engine runs its schedule over them), then :meth:`optimizer_step` (grad clipping + the non-finite guard). After the last
   mini-batch of the step, :meth:`lr_scheduler_step` once. The shared loop is
   :func:`hybridflow.training.update.update_mini_batches`.
3. :meth:`forward` any time for inference on one micro-batch (old/ref logprobs, values, scores), under
   ``torch.no_grad()`` in the caller, after :meth:`set_train` ``(False)``.
4. :meth:`iter_weights` (full tensors: weight sync to a rollout with its own copy, async generators, export) and
   :meth:`iter_shards` + :meth:`weight_specs` (this rank's shards: the 3D-HybridEngine's resharding), between
   steps. Every rank consumes the iterators to the end, in lockstep.
5. :meth:`save_checkpoint` / :meth:`load_checkpoint` between steps (sharded: each rank its own shards of model and
   optimizer, its lr schedule, RNG and skipped-step count).
6. :meth:`offload` / :meth:`onload` around phases where another model needs the device memory (the actor while
   its rollout generates; the critic between its calls); :meth:`on_device` wraps one call. Both are no-ops for
   what ``spec`` does not offload, and on CPU.

Shapes: (B, R) = sequences of the micro-batch, response tokens; (B, L) = prompt + response tokens.
"""

from __future__ import annotations

import abc
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch

from hybridflow.training.engine_registry import ENGINES, get_engine_class, register_engine, registered_engines

if TYPE_CHECKING:  # pragma: no cover - typing only
    from hybridflow.algorithms.sampling import SamplingSpec
    from hybridflow.protocol import DataProto

__all__ = ["ENGINES", "KINDS", "EngineSpec", "ParallelLayout", "TrainEngine", "WeightSpec", "engine_layout",
           "get_engine_class", "register_engine", "registered_engines"]

KINDS = ("policy", "value", "score")  # causal LM (logprobs, entropy) | value model (per token) | scorer (per token)


@dataclass(frozen=True)
class ParallelLayout:
    """How a role's ranks are laid out: ``dp`` data-parallel x ``sp`` sequence-parallel x ``tp`` tensor-parallel x
    ``pp`` pipeline stages.

    Rank order (every engine uses it, so the resharder and the dispatcher can compute any rank's place): tp
    fastest, then sp, then dp, then pp, i.e. ``rank = ((pp_rank * dp + dp_rank) * sp + sp_rank) * tp + tp_rank``
    (Megatron-core's default ``tp-dp-pp`` order when ``sp=1``; with ``pp=1`` it is the row-major ``("dp", "tp")``
    mesh of the fsdp2 engine over ``dp * sp`` data rows).

    ``sp`` (Ulysses, :mod:`hybridflow.training.ulysses`): the ``sp`` ranks of one dp group share its batch (one
    dispatch chunk per dp group, like tp ranks) and split each sequence; the weights shard over all ``dp * sp``
    ranks (FSDP over both: :meth:`weight_layout`).
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    sp: int = 1
    ep: int = 1  # expert parallelism (Megatron MoE): experts split over ep of each stage's dp*tp ranks; world unchanged

    @property
    def world(self) -> int:
        return self.dp * self.sp * self.tp * self.pp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(dp_rank, tp_rank, pp_rank)`` of global ``rank`` in this layout (its sp rank: :meth:`sp_rank`).

        Raises:
            ValueError: ``rank`` outside ``[0, world)``.
        """
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside the layout's {self.world} ranks ({self})")
        rest, tp_rank = divmod(rank, self.tp)
        pp_rank, dp_rank = divmod(rest // self.sp, self.dp)
        return dp_rank, tp_rank, pp_rank

    def sp_rank(self, rank: int) -> int:
        """The place of global ``rank`` in its sp group (0 when ``sp=1``)."""
        return (rank // self.tp) % self.sp

    def collects(self, rank: int) -> bool:
        """Whether ``rank`` returns its dp group's results (tp, sp and pp rank 0: the others hold the same)."""
        _, tp_rank, pp_rank = self.coords(rank)
        return tp_rank == 0 and pp_rank == 0 and self.sp_rank(rank) == 0

    def rank_of(self, dp_rank: int, tp_rank: int, pp_rank: int = 0, sp_rank: int = 0) -> int:
        """Inverse of :meth:`coords` (+ :meth:`sp_rank`)."""
        return ((pp_rank * self.dp + dp_rank) * self.sp + sp_rank) * self.tp + tp_rank

    def weight_layout(self) -> "ParallelLayout":
        """The layout the weights are sharded on: ``dp * sp`` FSDP shards (the sp ranks of a dp group hold
        different shards; only the data is shared), the same ranks in the same order, the experts split as ``ep``."""
        return ParallelLayout(dp=self.dp * self.sp, tp=self.tp, pp=self.pp, ep=self.ep)


@dataclass(frozen=True)
class EngineSpec:
    """What :meth:`TrainEngine.build` builds.

    Args:
        kind: ``policy`` (a causal LM), ``value`` (backbone + fresh scalar head per token) or ``score`` (a trained
            one-label sequence/token classifier, frozen).
        model: the role's ``model`` config section (``path``, ``dtype``, ``trust_remote_code``,
            ``enable_gradient_checkpointing``, the LoRA keys).
        layout: the role's parallel layout over the worker group's ranks.
        device: ``cpu`` or ``cuda`` (the worker's device).
        optim: the role's ``optim`` section (AdamW + lr schedule), or None for a frozen model (reference, scorer).
        total_steps: lr-schedule length in :meth:`TrainEngine.lr_scheduler_step` calls.
        grad_clip: max global gradient norm of :meth:`TrainEngine.optimizer_step`.
        nonfinite_grad: ``skip`` (drop a step whose gradient norm is NaN/inf, count it) or ``error`` (raise).
        param_offload / optimizer_offload: what :meth:`TrainEngine.offload` moves to host memory.
        reshard_after_forward: ``auto``, ``true`` or ``false``
            (:func:`hybridflow.distributed.resolve_reshard_after_forward`; engines without it ignore it).
        fsdp_size: ``auto``, ``-1`` (shard over every dp rank) or ``1`` (replicate)
            (:func:`hybridflow.distributed.replicate.resolve_fsdp_size`; engines without it ignore it).
        lora: wrap the model with LoRA adapters (peft) before sharding; only they train (a value model's head too).
        lora_config: the section holding ``lora_rank``, ``lora_alpha``, ``target_modules`` ... (default: ``model``).
        auto_bf16: with ``model.dtype=auto`` on CPU, the answer to use instead of this engine's own probe (whether
            to compute in bf16 over fp32 weights): the reference takes its actor's, so that both compute in one
            dtype and the KL of an unchanged policy is exactly 0. None: probe (engines without a probe ignore it).
        remove_padding: padding-free forwards (``model.use_remove_padding``): each micro-batch's valid tokens in one
            packed row (:mod:`hybridflow.training.packing`); results equal the padded forward's.
        role: the name used in messages and the guard's error (``actor``, ``critic`` ...).
        router_replay: ``off`` | ``rollout`` (an MoE model's forwards use the micro-batch's ``routed_experts``
            column, the rollout's expert choices) | ``recompute`` (engines that implement it).
    """

    kind: str
    model: Any
    layout: ParallelLayout
    device: str
    optim: Any = None
    total_steps: int = 0
    grad_clip: float = 1.0
    nonfinite_grad: str = "skip"
    param_offload: bool = False
    optimizer_offload: bool = False
    reshard_after_forward: str = "auto"
    fsdp_size: Any = "auto"
    lora: bool = False
    lora_config: Any = None
    remove_padding: bool = False
    role: str = "actor"
    auto_bf16: Optional[bool] = None
    router_replay: str = "off"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"EngineSpec.kind must be one of {KINDS}, got {self.kind!r}")


@dataclass(frozen=True)
class WeightSpec:
    """One parameter as the resharder sees it (Hugging Face name and shape, whatever the engine stores).

    Attributes:
        shape: the full tensor's shape.
        element_size: bytes per element.
        tp_dim: the dimension training tensor parallelism splits into ``layout.tp`` chunks (None: replicated over
            tp).
        dp_dim: the dimension data parallelism splits into ``layout.dp`` ``torch.chunk`` pieces of the tp-local
            tensor (FSDP2: 0); None: every dp rank holds the whole tp-local tensor (Megatron-core's DDP and
            distributed optimizer keep parameters replicated over dp).
        pp_stage: the pipeline stage whose ranks hold the parameter (its layers); None: every stage holds it
            (``pp=1``).
        ep_dim: the dimension expert parallelism splits into ``layout.ep`` chunks (an MoE layer's experts;
            the chunk of rank (d, t) is ``(d * tp + t) % ep``); None: not split by ep.
    """

    shape: tuple[int, ...]
    element_size: int
    tp_dim: Optional[int]
    dp_dim: Optional[int] = 0
    pp_stage: Optional[int] = None
    ep_dim: Optional[int] = None


class TrainEngine(abc.ABC):
    """One role's model on this rank (see the module docstring for the lifecycle).

    Attributes every engine has: ``spec`` (:class:`EngineSpec`), ``layout`` (:class:`ParallelLayout`), ``module``
    (the Hugging Face module, for its ``config``, buffers and peft calls; parameter data go through the iterators),
    ``optimizer`` / ``lr_scheduler`` (None when frozen), ``skipped_steps`` (optimizer steps the non-finite guard
    dropped, checkpointed), ``applied_update`` (an optimizer update went through since the last
    :meth:`lr_scheduler_step`).
    """

    spec: EngineSpec
    layout: ParallelLayout
    module: torch.nn.Module
    optimizer: Optional[torch.optim.Optimizer]
    lr_scheduler: Any
    skipped_steps: int

    @classmethod
    @abc.abstractmethod
    def build(cls, spec: EngineSpec) -> "TrainEngine":
        """Load and lay out the model, build optimizer and lr schedule (``init_model``, once per rank)."""

    # ------------------------------------------------------------------ compute
    @abc.abstractmethod
    def set_train(self, mode: bool) -> None:
        """Training mode (dropout etc.) before an update, eval mode before inference."""

    @abc.abstractmethod
    def forward(self, micro: DataProto, *, sampling: Optional[SamplingSpec] = None,
                entropy: bool = False) -> dict[str, torch.Tensor]:
        """One micro-batch forward (``input_ids``, ``attention_mask``, ``position_ids`` (B, L), ``responses``
        (B, R)); autograd follows the caller's grad mode.

        Returns, by ``spec.kind``: ``policy``: ``log_probs`` (B, R) fp32, the logprob of each response token under
        the distribution ``sampling`` makes of the logits (:func:`hybridflow.algorithms.sampling.sampling_logits`,
        the sampled token kept), and with ``entropy`` also ``entropy`` (B, R) fp32 of that distribution;
        ``value``: ``values`` (B, R) fp32, V of the state before each response token (not masked);
        ``score``: ``token_scores`` (B, L) fp32, the scorer's output at every position.
        """

    def forward_backward(self, micro: DataProto, loss_fn: Callable[[dict[str, torch.Tensor]], torch.Tensor], *,
                         sampling: Optional[SamplingSpec] = None, entropy: bool = False) -> torch.Tensor:
        """:meth:`forward` with autograd, ``loss = loss_fn(outputs)`` (a scalar), ``loss.backward()`` (gradients
        accumulate until :meth:`zero_grad`). Returns the detached loss."""
        with torch.enable_grad():
            loss = loss_fn(self.forward(micro, sampling=sampling, entropy=entropy))
            loss.backward()
        return loss.detach()

    def forward_backward_micro_batches(self, micros: list[DataProto],
                                       loss_fns: list[Callable[[dict[str, torch.Tensor]], torch.Tensor]], *,
                                       sampling: Optional[SamplingSpec] = None,
                                       entropy: bool = False) -> list[torch.Tensor]:
        """Every micro-batch of one mini-batch at once (``loss_fns[i]`` for ``micros[i]``), gradients accumulated
        as by :meth:`forward_backward` on each in order (the default does exactly that). A pipeline-parallel
        engine overrides it to run its micro-batch schedule (``megatron``: 1F1B over the stages). Returns the
        detached losses."""
        return [self.forward_backward(micro, fn, sampling=sampling, entropy=entropy)
                for micro, fn in zip(micros, loss_fns)]

    @abc.abstractmethod
    def zero_grad(self) -> None:
        """Drop accumulated gradients (start of each mini-batch)."""

    @abc.abstractmethod
    def optimizer_step(self) -> tuple[float, bool]:
        """Clip the accumulated gradients to ``spec.grad_clip`` (global norm over all shards) and step the
        optimizer, unless the norm is NaN/inf: then the gradients are dropped, ``skipped_steps`` grows and with
        ``nonfinite_grad=error`` ``FloatingPointError`` is raised. Returns ``(pre-clip grad norm, skipped)``."""

    @abc.abstractmethod
    def lr_scheduler_step(self) -> float:
        """End a training step for the lr schedule: advance it by one if an optimizer update was applied since the
        last call, else (every update of the step skipped by the non-finite guard) leave it, so the schedule counts
        applied updates and a resume (its state is checkpointed) continues it exactly. Returns the lr the step just
        taken used."""

    # ------------------------------------------------------------------ weights
    @abc.abstractmethod
    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, full tensor)`` for every parameter and buffer (Hugging Face names), gathered one at a time:
        peak extra memory one full tensor. A collective: every rank consumes it to the end."""

    @abc.abstractmethod
    def iter_shards(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, this rank's local shard)`` of every parameter this rank holds (all of them unless the
        parameter's ``pp_stage`` is another stage), without copies where the engine stores the Hugging Face
        layout (views of the training storage), in :meth:`weight_specs` order. Shard boxes (rank coordinates from
        :meth:`ParallelLayout.coords`): tp splits ``tp_dim`` into ``layout.tp`` chunks, then dp splits ``dp_dim``
        of the tp-local tensor into ``layout.dp`` ``torch.chunk`` pieces (FSDP2's rule; ``dp_dim=None``: no dp
        split)."""

    @abc.abstractmethod
    def weight_specs(self) -> dict[str, WeightSpec]:
        """Every parameter's full shape, element size and training tp dimension, in a fixed order."""

    # ------------------------------------------------------------------ state
    @abc.abstractmethod
    def save_checkpoint(self, path: str, extra: Optional[dict[str, Any]] = None) -> None:
        """Write this rank's shards of model (+ optimizer), its lr schedule, RNG, ``skipped_steps`` and
        ``extra`` under ``path`` (the directory is shared by the group)."""

    @abc.abstractmethod
    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Restore what :meth:`save_checkpoint` wrote (same layout); returns ``extra``.

        Raises:
            FileNotFoundError: ``path`` holds no checkpoint for this rank.
        """

    @abc.abstractmethod
    def offload(self) -> None:
        """Move parameters + grads (``spec.param_offload``) and optimizer state (``spec.optimizer_offload``) to
        host memory; a no-op for what is already there."""

    @abc.abstractmethod
    def onload(self, optimizer: bool = True) -> None:
        """Bring back what :meth:`offload` moved (the optimizer state only when ``optimizer``)."""

    @contextmanager
    def on_device(self, optimizer: bool = True) -> Iterator[None]:
        """Onload for one call and offload again afterwards (also after an error)."""
        self.onload(optimizer)
        try:
            yield
        finally:
            self.offload()


def engine_layout(strategy: str, section: Any, world: int, fsdp_tp: int = 1, sp: int = 1) -> ParallelLayout:
    """The layout the engine ``strategy`` of a role runs on over the role's ``world`` ranks.

    An engine registered with ``layout_section`` (megatron: ``"megatron"``) takes its (tp, pp) from that sub-section
    of the role's config ``section`` (``tensor_model_parallel_size``, ``pipeline_model_parallel_size``,
    ``expert_model_parallel_size``; ``expert_tensor_parallel_size`` must be 1); any other runs
    ``(tp=fsdp_tp, pp=1)`` with ``sp`` (the role's ``ulysses_sequence_parallel_size``; such an engine has none).
    dp = ``world / (tp * pp * sp)`` (the config checks at load that it divides).

    Raises:
        hybridflow.registry.UnknownNameError: ``strategy`` is not a registered engine.
        ValueError: ``expert_tensor_parallel_size`` other than 1.
    """
    key = ENGINES.meta(strategy, "layout_section")
    tp, pp, ep = fsdp_tp, 1, 1
    if key is not None:
        layout_config = getattr(section, key)
        tp, pp = layout_config.tensor_model_parallel_size, layout_config.pipeline_model_parallel_size
        ep, etp = layout_config.expert_model_parallel_size, layout_config.expert_tensor_parallel_size
        if etp != 1:  # refused at load too (hybridflow.config.megatron_checks)
            raise ValueError(f"expert_tensor_parallel_size={etp}: only 1 is supported")
    sp = 1 if key is not None else sp
    return ParallelLayout(dp=world // (tp * pp * sp), tp=tp, pp=pp, sp=sp, ep=ep)

"""The actor role: policy training (FSDP2) + its rollout engine + the reference policy, in one process per rank.

Colocating the three roles lets the rollout take its weights from the actor in memory after every update
(``load_weights`` from the gathered FSDP shards, no disk) and lets the frozen reference share the process.
Which of the three a worker holds is chosen by ``role``: ``actor_rollout_ref`` (all), ``actor_rollout``, ``ref``,
or ``actor_ref`` (no rollout: the trainer of the async driver, whose generators are a separate worker group that
receives the weights through :meth:`ActorRolloutRefWorker.send_weights`).

Each method below is one dataflow step: DataProto in, DataProto out, dispatched by the mesh-aware mode. Training
steps use the ``actor`` mesh, the training layout dp x tp (``actor.tensor_model_parallel_size``): one chunk per
dp rank, shared by its tp peers, one rank per dp group collected. ``generate_sequences`` uses the ``rollout``
mesh, the generation layout dp_g x tp_g (``rollout.tensor_model_parallel_size``). With the ``hf`` backend the
3D-HybridEngine (:mod:`hybridflow.engine`) switches the actor's weights between the two layouts: the generation
model exists only from a ``generate_sequences`` call to the next training step, holding 1/tp_g of the weights.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from contextlib import nullcontext
from types import SimpleNamespace

import torch

from hybridflow.algorithms.sampling import SamplingSpec
from hybridflow.controller import Dispatch, Execute, Worker, register
from hybridflow.distributed.checkpoint import load_sharded, save_sharded
from hybridflow.distributed.weight_sync import WeightTransferGroup, layout_of, open_store
from hybridflow.distributed import build_mesh, init_distributed, iter_full_state, parallelize_model, resolve_dtype
from hybridflow.engine import HybridEngine
from hybridflow.models.hf import get_eos_token_ids, load_causal_lm, load_tokenizer
from hybridflow.models import lora as lora_lib
from hybridflow.protocol import DataProto
from hybridflow.workers.timing import report_time
from hybridflow.rollout import get_rollout_class
from hybridflow.rollout.multi_turn import MultiTurnLoop, generate
from hybridflow.workers.optim import build_lr_scheduler, build_optimizer
from hybridflow.workers.ppo_actor import PPOActor

logger = logging.getLogger(__name__)

ROLES = ("actor_rollout_ref", "actor_rollout", "ref", "actor_ref")


def setup_worker_process() -> None:
    """Per-process settings of a training worker: one intra-op thread per rank unless OMP_NUM_THREADS says
    otherwise (ranks share the host's cores); silence FSDP2's warning about view outputs (the workers only
    slice model outputs out of place)."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


def make_rollout_config(config) -> SimpleNamespace:
    """The rollout backend's sampling config (see :class:`hybridflow.rollout.HFRollout`) from the run config."""
    rollout = config.actor_rollout_ref.rollout
    return SimpleNamespace(
        response_length=config.data.max_response_length,
        n=rollout.n,
        do_sample=rollout.do_sample,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        micro_batch_size=rollout.micro_batch_size_per_gpu,
        tensor_model_parallel_size=rollout.tensor_model_parallel_size,
        weight_bucket_bytes=rollout.update_weights_bucket_megabytes << 20,
    )


def with_rank_seed(prompts: DataProto, gen_dp_rank: int) -> DataProto:
    """``prompts`` with ``meta_info["seed"]`` (if any) made distinct per generation dp rank: seed * 1000 + rank,
    so samples are reproducible per (seed, dp_g rank) whichever worker group generates them."""
    meta = dict(prompts.meta_info)
    if "seed" in meta:
        meta["seed"] = int(meta["seed"]) * 1000 + gen_dp_rank
    return DataProto(batch=prompts.batch, non_tensor_batch=prompts.non_tensor_batch, meta_info=meta)


class ActorRolloutRefWorker(Worker):
    """Args:
        config: the full run config (reads ``actor_rollout_ref``, ``data``, ``trainer``).
        role: one of ``actor_rollout_ref``, ``actor_rollout``, ``ref``.
    """

    def __init__(self, config, role: str = "actor_rollout_ref") -> None:
        super().__init__()
        if role not in ROLES:
            raise ValueError(f"unknown actor role {role!r}; expected one of {ROLES}")
        self.config = config
        self.role = role
        self._has_actor = role != "ref"
        self._has_ref = role in ("actor_rollout_ref", "ref", "actor_ref")
        self._has_rollout = role in ("actor_rollout_ref", "actor_rollout")
        self._weight_sync = None  # the transfer group to the async driver's generators (actor_ref)
        self._rollout_stale = True
        self.engine = None  # the 3D-HybridEngine (hf rollout backend)
        self._lora = lora_lib.lora_enabled(config.actor_rollout_ref.model)  # actor wrapped by peft (README "LoRA")
        self.sync_metrics: dict[str, float] = {}  # the last LoRA sync check (sync/verified ...)
        self.multi_turn = None  # the multi-turn tool loop around the rollout (rollout.multi_turn.enable)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self, total_training_steps: int) -> None:
        """Join the process group, load the policy (+ reference), shard with FSDP2, build the rollout.
        ``total_training_steps`` sizes the lr schedule (it is stepped once per ``update_actor``)."""
        setup_worker_process()
        init_distributed()
        cfg = self.config.actor_rollout_ref
        torch.manual_seed(self.config.trainer.seed)
        self.device = self.device_name
        tp = cfg.actor.tensor_model_parallel_size
        self.dp_size = self.world_size // tp
        mesh = build_mesh(dp=self.dp_size, tp=tp)
        dp_rank, tp_rank = divmod(self.rank, tp)
        self._register_dispatch_collect_info("actor", dp_rank=dp_rank, is_collect=tp_rank == 0)
        dtype = resolve_dtype(cfg.model.dtype, self.device)
        path = cfg.model.path
        self.tokenizer = load_tokenizer(cfg.model.tokenizer_path or path, cfg.model.trust_remote_code)
        # the distribution the rollout samples from, which the actor's logprobs are taken under (see PPOActor)
        sampling = SamplingSpec.of(cfg.rollout.do_sample, cfg.rollout.temperature, cfg.rollout.top_k, cfg.rollout.top_p)
        if self._has_actor:
            module = load_causal_lm(path, dtype, cfg.model.trust_remote_code)
            if self._lora:  # before FSDP2: only the adapters require grad, so only they get optimizer state
                module = lora_lib.apply_lora(module, cfg.model)
            if cfg.model.enable_gradient_checkpointing:
                module.gradient_checkpointing_enable()
            module = parallelize_model(module.to(self.device), mesh)
            optimizer = build_optimizer(module, cfg.actor.optim)
            self.lr_scheduler = build_lr_scheduler(optimizer, cfg.actor.optim, total_training_steps)
            scale = cfg.actor.loss_scale_factor or self.config.data.max_response_length  # Dr. GRPO's constant L
            self.actor = PPOActor(module, optimizer, cfg.actor, sampling, self.config.trainer.nonfinite_grad,
                                  loss_scale_factor=scale)
        if self._has_rollout:
            self.multi_turn = MultiTurnLoop.from_config(self.config, self.tokenizer)
            rollout_cls = get_rollout_class(cfg.rollout.name)
            rollout_module = None  # a backend with its own engine (vllm) loads the checkpoint from the path
            # the engine's generation model replaces a separate copy; with LoRA the hf rollout keeps its own copy
            use_engine = cfg.rollout.name == "hf" and not self._lora
            if rollout_cls.needs_module and not use_engine:
                rollout_module = load_causal_lm(path, dtype, cfg.model.trust_remote_code)
                if self._lora and cfg.rollout.lora_sync == "adapter":  # base + adapters, refreshed by A and B only
                    rollout_module = lora_lib.apply_lora(rollout_module, cfg.model)
                rollout_module = rollout_module.to(self.device)
            rollout_cfg = make_rollout_config(self.config)
            eos = get_eos_token_ids(path, self.tokenizer)
            if use_engine:
                self._build_hybrid_engine(mesh, rollout_cfg, eos)
            else:
                self._build_rollout(rollout_cls, path, rollout_module, rollout_cfg, eos, dtype)
                if self._lora and not isinstance(getattr(self.rollout, "module", None), torch.nn.Module):
                    logger.warning("LoRA: the %s rollout receives merged weights but has no in-process module, so "
                                   "the sync is not checked by the probe (no sync/verified)", cfg.rollout.name)
        if self._has_ref and self._lora and self._has_actor:  # the base with adapters disabled: no second copy
            self.ref = PPOActor(self.actor.module, None, cfg.actor, SamplingSpec(sampling.temperature))
        elif self._has_ref:
            ref = load_causal_lm(path, dtype, cfg.model.trust_remote_code)
            ref.requires_grad_(False)
            self.ref = PPOActor(parallelize_model(ref.to(self.device), mesh), None, cfg.actor,
                                SamplingSpec(sampling.temperature))

    def _build_hybrid_engine(self, mesh, rollout_cfg, eos) -> None:
        """The hf rollout generates with the engine's tensor-parallel model; the rollout object is made on the
        first switch (the generation model holds weights only between a switch and the next training step)."""
        cfg = self.config.actor_rollout_ref
        fsdp = cfg.actor.fsdp_config
        self.engine = HybridEngine(
            self.actor.module, mesh, cfg.rollout.tensor_model_parallel_size,
            bucket_bytes=cfg.rollout.update_weights_bucket_megabytes << 20, optimizer=self.actor.optimizer,
            param_offload=fsdp.param_offload, optimizer_offload=fsdp.optimizer_offload)
        self._hf_rollout_args = (rollout_cfg, eos, self.tokenizer.pad_token_id)
        self.rollout = None
        self._register_dispatch_collect_info("rollout", dp_rank=self.engine.gen_dp_rank,
                                             is_collect=self.engine.gen_tp_rank == 0)

    def _build_rollout(self, rollout_cls, path, rollout_module, rollout_cfg, eos, dtype) -> None:
        """A backend with its own copy of the weights, refreshed from the gathered actor after each update; its
        tensor-parallel groups (if any) are consecutive ranks."""
        cfg = self.config.actor_rollout_ref
        self.rollout = rollout_cls.from_config(
            path, rollout_module, rollout_cfg, eos_token_id=eos, pad_token_id=self.tokenizer.pad_token_id,
            dtype=dtype, trust_remote_code=cfg.model.trust_remote_code,
            max_model_len=self.config.data.max_prompt_length + self.config.data.max_response_length,
        )
        self._rollout_stale = False  # both were loaded from the same checkpoint
        tp_g = cfg.rollout.tensor_model_parallel_size
        self._register_dispatch_collect_info("rollout", dp_rank=self.rank // tp_g, is_collect=self.rank % tp_g == 0)

    def _switch_to_training(self) -> None:
        """Free the generation copy (and bring offloaded training state back) before the actor trains."""
        if self.engine is not None:
            self.engine.switch_to_training()

    def _sync_rollout_weights(self) -> None:
        """Make the rollout's weights current: the engine's switch to generation (a no-op when current), or
        for a backend with its own copy, a full gather of the actor's weights (all ranks in lockstep)."""
        if self.engine is not None:
            module = self.engine.switch_to_generation()
            if self.rollout is None:
                rollout_cfg, eos, pad = self._hf_rollout_args
                self.rollout = get_rollout_class("hf")(module, rollout_cfg, eos_token_id=eos, pad_token_id=pad)
        elif self._rollout_stale:
            self.rollout.load_weights(self._rollout_weights())
            self._rollout_stale = False
            if self._lora and isinstance(getattr(self.rollout, "module", None), torch.nn.Module):
                self.sync_metrics = lora_lib.verify_sync(self.actor.module, self.rollout.module,
                                                         self.actor.module.config.vocab_size)

    def _rollout_weights(self):
        """``(name, full tensor)`` for the rollout: the actor's state; with LoRA, merged into the base names
        (``rollout.lora_sync=merged``) or the adapters only (``adapter``). Every rank consumes it in lockstep."""
        state = iter_full_state(self.actor.module)
        if not self._lora:
            return state
        if self.config.actor_rollout_ref.rollout.lora_sync == "adapter":
            return lora_lib.adapter_items(state)
        return lora_lib.merge_lora_stream(state, lora_lib.lora_scaling(self.actor.module.peft_config["default"]))

    @register(dispatch_mode=Dispatch.MESH_COMPUTE_PROTO, mesh_name="rollout")
    @report_time
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Sample responses for left-padded ``prompts`` (see :class:`hybridflow.rollout.BaseRollout`);
        ``meta_info`` may override sampling (validation passes greedy settings) and carry ``seed``. The tp_g
        peers of a generation group get the same prompts and seed and decode in lockstep."""
        self._sync_rollout_weights()
        gen_dp_rank = self._query_dispatch_info("rollout")[0]
        out = generate(self.rollout, with_rank_seed(prompts, gen_dp_rank), self.multi_turn)
        if self.sync_metrics:
            out.meta_info["sync_metrics"] = self.sync_metrics
        if self.engine is not None:
            self.engine.check_lockstep(out.batch["responses"])
        out.meta_info.pop("seed", None)
        return out

    @register(dispatch_mode=Dispatch.MESH_COMPUTE_PROTO, mesh_name="actor")
    @report_time
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """``old_log_probs`` (B, R) and ``entropys`` (B, R) of the current policy, fp32."""
        self._switch_to_training()
        micro = self.config.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu
        log_prob, entropy = self.actor.compute_log_prob(data, micro, calculate_entropy=True)
        return DataProto.from_dict(tensors={"old_log_probs": log_prob, "entropys": entropy})

    @register(dispatch_mode=Dispatch.MESH_COMPUTE_PROTO, mesh_name="actor")
    @report_time
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """``ref_log_prob`` (B, R) fp32 under the frozen reference policy."""
        self._switch_to_training()  # frees the generation copy early; the next update makes it stale anyway
        micro = self.config.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu
        # with LoRA the reference is the actor's module with its adapters disabled (peft's disable_adapter)
        shares_actor = self._has_actor and self.ref.module is self.actor.module
        with self.actor.module.disable_adapter() if shares_actor else nullcontext():
            log_prob, _ = self.ref.compute_log_prob(data, micro)
        return DataProto.from_dict(tensors={"ref_log_prob": log_prob})

    @register(dispatch_mode=Dispatch.MESH_COMPUTE_PROTO, mesh_name="actor")
    @report_time
    def update_actor(self, data: DataProto) -> DataProto:
        """One PPO update over the batch; returns ``meta_info["metrics"]`` (averaged over dp ranks).
        ``data.meta_info["global_step"]`` seeds the mini-batch shuffle."""
        self._switch_to_training()
        cfg = self.config.actor_rollout_ref
        mini = cfg.actor.ppo_mini_batch_size * cfg.rollout.n // self.dp_size
        step = int(data.meta_info.get("global_step", 0))
        metrics = self.actor.update_policy(data, mini, seed=self.config.trainer.seed + step)
        metrics["actor/lr"] = self.lr_scheduler.get_last_lr()[0]
        self.lr_scheduler.step()
        self._rollout_stale = True
        return DataProto(meta_info={"metrics": metrics})

    # ------------------------------------------------------------------ weight push to the async generators
    @register(dispatch_mode=Dispatch.RANK_ZERO, execute_mode=Execute.RANK_ZERO)
    def open_weight_sync(self) -> tuple[str, int, list]:
        """Host the transfer group's store; returns ``(host, port, layout)`` for the generators (layout: the
        ``(name, shape, dtype)`` of every tensor :meth:`send_weights` sends, in order)."""
        host, _ = self.get_master_addr_port()
        self._sync_store = open_store(host, self.config.async_training.weight_sync_timeout_s)
        items = self.actor.module.state_dict().items()
        self._sync_layout = layout_of(lora_lib.merged_names(items) if self._lora else items)
        return host, self._sync_store.port, self._sync_layout

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def init_weight_sync(self, host: str, port: int, world_size: int) -> None:
        """Rank 0 joins the transfer group as its sender (rank 0 of ``world_size``); other ranks only gather."""
        if self.rank == 0:
            self._weight_sync = WeightTransferGroup(
                host, port, 0, world_size, self.device, self.config.async_training.weight_sync_timeout_s,
                store=self._sync_store)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def send_weights(self, version: int) -> dict[str, float]:
        """Gather the full weights (every rank, one tensor at a time) and broadcast them bucket by bucket from
        rank 0 to the generators. Returns rank 0's ``sync/weight_transfer_s`` (seconds) and
        ``sync/weight_transfer_bytes`` (bytes per generator rank); ``version`` is logged only."""
        self._switch_to_training()
        start = time.perf_counter()
        bucket = self.config.actor_rollout_ref.rollout.update_weights_bucket_megabytes << 20
        if self._weight_sync is None:  # ranks > 0 take part in the gathers only
            for _ in self._rollout_weights():
                pass
            return {}
        sent = self._weight_sync.send(self._rollout_weights(), self._sync_layout, bucket)
        seconds = time.perf_counter() - start
        logger.debug("sent weights of version %d: %d bytes in %.3fs", version, sent, seconds)
        return {"sync/weight_transfer_s": seconds, "sync/weight_transfer_bytes": float(sent)}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """Write this rank's shards of the actor weights and optimizer, its lr-scheduler and RNG state; rank 0
        also writes the HF config, generation config and tokenizer to ``path/hf`` (for ``hybridflow export``)."""
        self._switch_to_training()
        save_sharded(path, self.actor.module, self.actor.optimizer,
                     {"lr_scheduler": self.lr_scheduler.state_dict(), "skipped_steps": self.actor.skipped_steps})
        if self.rank == 0:
            hf_dir = os.path.join(path, "hf")
            self.actor.module.config.save_pretrained(hf_dir)
            self.actor.module.generation_config.save_pretrained(hf_dir)
            self.tokenizer.save_pretrained(hf_dir)
            if self._lora:  # marks the checkpoint as LoRA for `hybridflow export` (merged or --adapter-only)
                lora_lib.save_adapter_config(self.actor.module, hf_dir, self.config.actor_rollout_ref.model.path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote (same number of ranks); the rollout re-syncs its weights."""
        self._switch_to_training()
        extra = load_sharded(path, self.actor.module, self.actor.optimizer)
        self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        self.actor.skipped_steps = extra["skipped_steps"]
        self._rollout_stale = True


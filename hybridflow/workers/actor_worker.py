"""The actor role: policy training (its ``actor.strategy`` engine) + its rollout engine + the reference policy, in one
process per rank.

Colocating the three roles lets the rollout take its weights from the actor in memory after every update
(``load_weights`` from the engine's gathered weights, no disk) and lets the frozen reference share the process.
The worker touches its models only through :class:`hybridflow.training.TrainEngine` and the rollout contract.

The memory handoff, every step: ``generate_sequences`` -> (first training-side call: ``compute_log_prob``,
``compute_ref_log_prob``, ``update_actor``, a checkpoint) the rollout ``sleep()``s, releasing its KV cache and, at
level 2, its weights; the actor engine onloads what ``fsdp_config`` offloads -> train -> (next
``generate_sequences``) the rollout ``wake()``s, ``load_weights`` gets the new weights, the actor engine offloads
-> generate. With the 3D-HybridEngine (hf) the switch to training frees the generation copy (the rollout's
weights) and the switch to generation reshards the new weights into it (docs/concepts/training-engines.md, the
memory handoff).
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

import dataclasses
import logging
import os
import time
import warnings
from contextlib import nullcontext
from types import SimpleNamespace
from typing import Any, Optional

import torch

from hybridflow.algorithms.sampling import SamplingSpec
from hybridflow.controller import Dispatch, Execute, Worker, register
from hybridflow.distributed.weight_sync import WeightTransferGroup, layout_of, open_store
from hybridflow.distributed import init_distributed, resolve_dtype
from hybridflow.engine import HybridEngine
from hybridflow.engine.gen_precision import generation_autocast
from hybridflow.models.hf import get_eos_token_ids, load_causal_lm, load_tokenizer
from hybridflow.models import lora as lora_lib
from hybridflow.models import lora_sync
from hybridflow.protocol import DataProto
from hybridflow.workers.timing import report_time
from hybridflow.rollout import BaseRollout, get_rollout_class, uses_hybrid_engine
from hybridflow.training import EngineSpec, engine_layout, get_engine_class
from hybridflow.rollout.multi_turn import MultiTurnLoop, generate
from hybridflow.utils.allocator import keep_freed_host_memory
from hybridflow.utils.metrics import Max, Sum
from hybridflow.workers import columns
from hybridflow.workers.inputs import ActorInputs, ConfigSection, expect, expect_section
from hybridflow.workers.engine_model import compute_dtypes
from hybridflow.workers.ppo_actor import PPOActor

logger = logging.getLogger(__name__)

ROLES = ("actor_rollout_ref", "actor_rollout", "ref", "actor_ref")


def setup_worker_process() -> None:
    """Per-process settings of a training worker: one intra-op thread per rank unless OMP_NUM_THREADS says
    otherwise (ranks share the host's cores); freed host buffers kept mapped for the next micro-batch
    (:func:`hybridflow.utils.allocator.keep_freed_host_memory`); silence FSDP2's warning about view outputs (the
    workers only slice model outputs out of place)."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    keep_freed_host_memory()
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


def make_rollout_config(rollout: ConfigSection, max_response_length: int, lora_rank: int = 0,
                        lora_alpha: float = 16.0) -> SimpleNamespace:
    """The rollout backend's config: every key of the ``actor_rollout_ref.rollout`` section under its own name (so a
    backend's own keys, declared by its registration's ``config=``, reach it without being listed here), plus the
    values derived from elsewhere: ``response_length`` (``data.max_response_length``), ``micro_batch_size``
    (``micro_batch_size_per_gpu``), ``weight_bucket_bytes`` (``update_weights_bucket_megabytes`` in bytes) and the
    LoRA adapter payload's rank and alpha (:func:`hybridflow.models.lora_sync.rollout_lora_options`; rank 0: merged
    or full weights)."""
    names = [f.name for f in dataclasses.fields(rollout)] if dataclasses.is_dataclass(rollout) else list(rollout.keys())
    keys = {name: getattr(rollout, name) for name in names}  # the section: a dataclass object (or a config node)
    return SimpleNamespace(**keys, response_length=max_response_length,
                           micro_batch_size=rollout.micro_batch_size_per_gpu,
                           weight_bucket_bytes=rollout.update_weights_bucket_megabytes << 20,
                           lora_rank=lora_rank, lora_alpha=lora_alpha)


def with_rank_seed(prompts: DataProto, gen_dp_rank: int) -> DataProto:
    """``prompts`` with ``meta_info["seed"]`` (if any) made distinct per generation dp rank: seed * 1000 + rank,
    so samples are reproducible per (seed, dp_g rank) whichever worker group generates them."""
    meta = dict(prompts.meta_info)
    if "seed" in meta:
        meta["seed"] = int(meta["seed"]) * 1000 + gen_dp_rank
    return DataProto(batch=prompts.batch, non_tensor_batch=prompts.non_tensor_batch, meta_info=meta)


def _ref_section(actor: Any) -> Any:
    """The actor section as the reference's forwards read it: an MoE reference routes by its own top-k (no routing
    replay: docs/how-to/moe.md), whatever ``actor.router_replay`` says."""
    if getattr(actor, "router_replay", "off") == "off":
        return actor
    if dataclasses.is_dataclass(actor):
        return dataclasses.replace(actor, router_replay="off")
    from omegaconf import OmegaConf  # a DictConfig section (tests build them)

    return OmegaConf.merge(actor, {"router_replay": "off"})


class ActorRolloutRefWorker(Worker):
    """Args:
        config: the ``actor_rollout_ref`` section (model, actor, rollout, ref), a schema dataclass object.
        inputs: the values derived from the rest of the run config (seed, total steps, lengths, ...).
        role: one of ``actor_rollout_ref``, ``actor_rollout``, ``ref``, ``actor_ref``.

    Built by :func:`hybridflow.trainer.worker_inputs.actor_args`.

    Raises:
        TypeError: ``config`` is not the ``actor_rollout_ref`` section (e.g. the whole run config) or ``inputs``
            not an :class:`~hybridflow.workers.inputs.ActorInputs`.
        ValueError: unknown ``role``.
    """

    def __init__(self, config: ConfigSection, inputs: ActorInputs, role: str = "actor_rollout_ref") -> None:
        super().__init__()
        if role not in ROLES:
            raise ValueError(f"unknown actor role {role!r}; expected one of {ROLES}")
        self.config = expect_section(config, "actor_rollout_ref", ("model", "actor", "rollout", "ref"))
        self.inputs = expect(inputs, ActorInputs, "ActorRolloutRefWorker: inputs")
        self.role = role
        self._has_actor = role != "ref"
        self._has_ref = role in ("actor_rollout_ref", "ref", "actor_ref")
        self._has_rollout = role in ("actor_rollout_ref", "actor_rollout")
        self._weight_sync = None  # the transfer group to the async driver's generators (actor_ref)
        self._rollout_stale = True  # the rollout's weights differ from the actor's (or were discarded by a sleep)
        self._rollout_asleep = False
        self.engine = None  # the 3D-HybridEngine (hf rollout backend)
        self._lora = lora_lib.lora_enabled(config.model)  # actor wrapped by peft (docs/how-to/lora.md)
        self.sync_metrics: dict[str, float] = {}  # the last LoRA sync check (sync/verified ...)
        self.multi_turn = None  # the multi-turn tool loop around the rollout (rollout.multi_turn.enable)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict:
        """Join the process group, build the policy (+ reference) engines of ``actor.strategy``, the rollout.
        ``inputs.total_training_steps`` sizes the lr schedule (it is stepped once per ``update_actor``). Returns
        ``{"compute_dtype": {"actor": "float32", "ref": ...}}`` (what ``dtype=auto`` chose; the driver logs it)."""
        setup_worker_process()
        init_distributed()
        cfg, inputs = self.config, self.inputs
        torch.manual_seed(inputs.seed)
        self.device = self.device_name
        # dp x tp (fsdp2: actor.tensor_model_parallel_size) or dp x tp x pp (megatron: actor.megatron.*)
        layout = engine_layout(cfg.actor.strategy, cfg.actor, self.world_size, cfg.actor.tensor_model_parallel_size,
                               cfg.actor.ulysses_sequence_parallel_size)  # the reference runs on it too
        self.dp_size = layout.dp
        dp_rank = layout.coords(self.rank)[0]  # sp/tp/pp peers share the dp rank's chunk; one of them collects
        self._register_dispatch_collect_info("actor", dp_rank=dp_rank, is_collect=layout.collects(self.rank))
        dtype = resolve_dtype(cfg.model.dtype, self.device)  # the rollout's copy (engines pick their training dtypes)
        path = cfg.model.path
        self.tokenizer = load_tokenizer(cfg.model.tokenizer_path or path, cfg.model.trust_remote_code)
        # the distribution the rollout samples from, which the actor's logprobs are taken under (see PPOActor)
        sampling = SamplingSpec.of(cfg.rollout.do_sample, cfg.rollout.temperature, cfg.rollout.top_k, cfg.rollout.top_p)
        engine_cls = get_engine_class(cfg.actor.strategy)
        if self._has_actor:
            fsdp = cfg.actor.fsdp_config
            engine = engine_cls.build(EngineSpec(
                kind="policy", model=cfg.model, layout=layout, device=self.device, optim=cfg.actor.optim,
                total_steps=inputs.total_training_steps, grad_clip=cfg.actor.grad_clip,
                nonfinite_grad=inputs.nonfinite_grad, param_offload=fsdp.param_offload,
                optimizer_offload=fsdp.optimizer_offload, reshard_after_forward=fsdp.reshard_after_forward,
                fsdp_size=fsdp.fsdp_size, lora=self._lora, role="actor", remove_padding=cfg.model.use_remove_padding,
                router_replay=cfg.actor.router_replay))
            self.actor = PPOActor(engine, None, cfg.actor, sampling, loss_scale_factor=inputs.loss_scale_factor)
        if self._has_rollout:
            self.multi_turn = MultiTurnLoop.from_section(cfg.rollout.multi_turn, self.tokenizer)
            # dtype=auto: a rollout with its own copy (vllm) computes in the dtype the actor's probe chose, as the
            # engine's generation model does (engine/gen_precision.py), so it samples from the trainer's policy
            actor_dtype = getattr(self.actor.engine, "compute_dtype", None) if self._has_actor else None
            self._init_rollout(actor_dtype if cfg.model.dtype == "auto" and actor_dtype is not None else dtype)
        if self._has_ref and self._lora and self._has_actor:  # the base with adapters disabled: no second copy
            self.ref = PPOActor(self.actor.engine, None, _ref_section(cfg.actor), SamplingSpec(sampling.temperature))
        elif self._has_ref:
            # dtype=auto: the reference computes in the actor's dtype (no probe of its own), so KL starts at 0
            actor_dtype = getattr(self.actor.engine, "compute_dtype", None) if self._has_actor else None
            ref = engine_cls.build(EngineSpec(kind="policy", model=cfg.model, layout=layout, device=self.device,
                                              reshard_after_forward=cfg.actor.fsdp_config.reshard_after_forward,
                                              fsdp_size=cfg.actor.fsdp_config.fsdp_size,
                                              role="ref", remove_padding=cfg.model.use_remove_padding,
                                              auto_bf16=None if actor_dtype is None else actor_dtype == torch.bfloat16))
            self.ref = PPOActor(ref, None, _ref_section(cfg.actor), SamplingSpec(sampling.temperature))
        return {"compute_dtype": compute_dtypes(actor=getattr(self, "actor", None), ref=getattr(self, "ref", None))}

    def _init_rollout(self, dtype: torch.dtype) -> None:
        """The rollout backend: generating with the 3D-HybridEngine's model (hf without LoRA), or with its own
        copy of the weights (a module loaded here when the backend needs one; vllm loads the path itself)."""
        cfg = self.config
        path = cfg.model.path
        rollout_cls = get_rollout_class(cfg.rollout.name)
        rollout_module = None
        # the engine's generation model replaces a separate copy; with LoRA the hf rollout keeps its own copy
        use_engine = uses_hybrid_engine(cfg.rollout.name) and not self._lora
        if rollout_cls.needs_module and not use_engine:
            rollout_module = load_causal_lm(path, dtype, cfg.model.trust_remote_code)
            if self.inputs.rollout_lora_adapters:  # base + adapters, refreshed by A and B only
                rollout_module = lora_lib.apply_lora(rollout_module, cfg.model)
            rollout_module = rollout_module.to(self.device)
        rollout_cfg = make_rollout_config(cfg.rollout, self.inputs.max_response_length,
                                          **lora_sync.rollout_lora_options(cfg.model, self.inputs.rollout_lora_adapters))
        # MoE routing replay: the rollout records each token's experts (docs/how-to/moe.md)
        rollout_cfg.record_routing = getattr(cfg.actor, "router_replay", "off") == "rollout"
        eos = get_eos_token_ids(path, self.tokenizer)
        if use_engine:
            self._build_hybrid_engine(rollout_cfg, eos)
        else:
            self._build_rollout(rollout_cls, path, rollout_module, rollout_cfg, eos, dtype)
            if self._lora and not lora_sync.can_probe(self.rollout):
                logger.warning("LoRA: the %s rollout cannot be probed, so its weight sync is not checked (no "
                               "sync/verified)", cfg.rollout.name)

    def _build_hybrid_engine(self, rollout_cfg: SimpleNamespace, eos: list[int]) -> None:
        """The hf rollout generates with the engine's tensor-parallel model; the rollout object is made on the
        first switch (the generation model holds weights only between a switch and the next training step)."""
        cfg = self.config
        self.engine = HybridEngine(self.actor.engine, gen_tp=cfg.rollout.tensor_model_parallel_size,
                                   bucket_bytes=cfg.rollout.update_weights_bucket_megabytes << 20)
        self._hf_rollout_args = (rollout_cfg, eos, self.tokenizer.pad_token_id)
        self.rollout = None
        self._register_dispatch_collect_info("rollout", dp_rank=self.engine.gen_dp_rank,
                                             is_collect=self.engine.gen_tp_rank == 0)

    def _build_rollout(self, rollout_cls: type[BaseRollout], path: str, rollout_module: Optional[torch.nn.Module],
                       rollout_cfg: SimpleNamespace, eos: list[int], dtype: torch.dtype) -> None:
        """A backend with its own copy of the weights, refreshed from the gathered actor after each update; its
        tensor-parallel groups (if any) are consecutive ranks."""
        cfg = self.config
        self.rollout = rollout_cls.from_config(
            path, rollout_module, rollout_cfg, eos_token_id=eos, pad_token_id=self.tokenizer.pad_token_id,
            dtype=dtype, trust_remote_code=cfg.model.trust_remote_code,
            max_model_len=self.inputs.max_prompt_length + self.inputs.max_response_length,
        )
        self._rollout_stale = False  # both were loaded from the same checkpoint
        tp_g = cfg.rollout.tensor_model_parallel_size
        self._register_dispatch_collect_info("rollout", dp_rank=self.rank // tp_g, is_collect=self.rank % tp_g == 0)

    # ------------------------------------------------------------------ the train/generate memory handoff
    def _sleep_level(self) -> int:
        """2 (discard the rollout's weights too) when the next wake reloads all of them, 1 (keep them, offloaded)
        when only LoRA adapters are pushed (``rollout.lora_sync=adapter``: the base weights are not resent)."""
        adapter_only = self._lora and self.config.rollout.lora_sync == "adapter"
        return 1 if adapter_only else 2

    def _switch_to_training(self) -> None:
        """Before the actor or reference computes: the rollout sleeps (its KV cache, and at level 2 its weights,
        are released; with the 3D-HybridEngine the generation copy is freed) and the actor's offloaded training
        state comes back. A no-op when already training."""
        if self.engine is not None:
            self.engine.switch_to_training()  # the hybrid engine onloads what it offloaded
            return
        if self._has_rollout and not self._rollout_asleep:
            level = self._sleep_level()
            self.rollout.sleep(level=level)
            self._rollout_asleep = True
            self._rollout_stale |= level == 2
        if self._has_actor:
            self.actor.engine.onload()

    def _sync_rollout_weights(self) -> None:
        """Before generating: make the rollout's weights current. With the 3D-HybridEngine its switch to
        generation (a no-op when current; it offloads training state itself). Otherwise wake the rollout, load
        the actor's full weights when they changed or were discarded (all ranks in lockstep), then offload the
        actor's training state (``fsdp_config.param_offload`` / ``optimizer_offload``) while generating."""
        if self.engine is not None:
            module = self.engine.switch_to_generation()
            if self.rollout is None:
                rollout_cfg, eos, pad = self._hf_rollout_args
                backend = get_rollout_class(self.config.rollout.name)
                self.rollout = backend(module, rollout_cfg, eos_token_id=eos, pad_token_id=pad)
            return
        if self._rollout_asleep:
            self.rollout.wake()
            self._rollout_asleep = False
        if self._rollout_stale:
            self.actor.engine.onload(optimizer=False)
            self.rollout.load_weights(self._rollout_weights())
            self._rollout_stale = False
            if self._lora:  # the rollout's probe against the trainer's; a mismatch fails the step
                vocab = self.actor.module.config.get_text_config().vocab_size  # a VLM's: its text config's
                self.sync_metrics = lora_sync.verify_rollout_sync(self.actor.module, self.rollout, vocab)
        self.actor.engine.offload()

    def _rollout_weights(self):
        """``(name, full tensor)`` for the rollout: the actor's state; with LoRA, merged into the base names
        (``rollout.lora_sync=merged``) or the adapters only (``adapter``, where the rollout takes them; see
        :mod:`hybridflow.models.lora_sync`). Every rank consumes it in lockstep."""
        state = self.actor.engine.iter_weights()
        if not self._lora:
            return state
        return lora_sync.rollout_stream(self.inputs.rollout_lora_adapters, self.actor.module, state)

    def _push_items(self):
        """What :meth:`send_weights` sends: :meth:`_rollout_weights`, and with LoRA the trainer's sync probe last
        (the generators check their own against it). Every rank consumes it in lockstep."""
        yield from self._rollout_weights()
        if self._lora:
            yield lora_sync.probe_entry(self.actor.module)

    @register(dispatch_mode=Dispatch.MESH_COMPUTE_PROTO, mesh_name="rollout", rows_per_row=True)
    @report_time
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Sample responses for left-padded ``prompts`` (see :class:`hybridflow.rollout.BaseRollout`);
        ``meta_info`` may override sampling (validation passes greedy settings) and carry ``seed``. The tp_g
        peers of a generation group get the same prompts and seed and decode in lockstep."""
        self._sync_rollout_weights()
        gen_dp_rank = self._query_dispatch_info("rollout")[0]
        with generation_autocast(self.engine):  # the trainer's compute dtype (dtype=auto: bf16 over fp32 weights)
            out = generate(self.rollout, with_rank_seed(prompts, gen_dp_rank), self.multi_turn)
        if self.sync_metrics:
            out.meta_info["sync_metrics"] = lora_sync.probe_metric_kinds(self.sync_metrics)
        if self.engine is not None:
            self.engine.check_lockstep(out.batch["responses"])
        out.meta_info.pop("seed", None)
        return out

    @register(dispatch_mode=Dispatch.MESH_COMPUTE_PROTO, mesh_name="actor", batch_keys=columns.ACTOR_SEQUENCE,
              non_tensor_batch_keys=columns.MODEL_INPUTS)
    @report_time
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """``old_log_probs`` (B, R) and ``entropys`` (B, R) of the current policy, fp32."""
        self._switch_to_training()
        return DataProto.from_dict(tensors=self._old_log_prob(data))

    @register(dispatch_mode=Dispatch.MESH_COMPUTE_PROTO, mesh_name="actor", batch_keys=columns.SEQUENCE,
              non_tensor_batch_keys=columns.MODEL_INPUTS)
    @report_time
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """``ref_log_prob`` (B, R) fp32 under the frozen reference policy."""
        self._switch_to_training()  # frees the generation copy early; the next update makes it stale anyway
        return DataProto.from_dict(tensors=self._ref_log_prob(data))

    def _old_log_prob(self, data: DataProto) -> dict[str, torch.Tensor]:
        rollout = self.config.rollout
        log_prob, entropy = self.actor.compute_log_prob(data, rollout.log_prob_micro_batch_size_per_gpu, True,
                                                        rollout.log_prob_max_token_len_per_gpu, record_routing=True)
        out = {"old_log_probs": log_prob, "entropys": entropy}
        if self.actor.recorded_routing is not None:  # router_replay=recompute: replayed by the update
            out["routed_experts"] = self.actor.recorded_routing
        return out

    def _ref_log_prob(self, data: DataProto) -> dict[str, torch.Tensor]:
        ref = self.config.ref
        # with LoRA the reference is the actor's module with its adapters disabled
        shares_actor = self._has_actor and self.ref.module is self.actor.module
        with lora_lib.adapters_disabled(self.actor.module) if shares_actor else nullcontext():
            log_prob, _ = self.ref.compute_log_prob(data, ref.log_prob_micro_batch_size_per_gpu,
                                                    max_token_len=ref.log_prob_max_token_len_per_gpu)
        return {"ref_log_prob": log_prob}

    @register(dispatch_mode=Dispatch.MESH_COMPUTE_PROTO, mesh_name="actor", batch_keys=columns.ACTOR_UPDATE,
              non_tensor_batch_keys=columns.MODEL_INPUTS)
    @report_time
    def update_actor(self, data: DataProto) -> DataProto:
        """One PPO update over the batch; returns ``meta_info["metrics"]`` (averaged over dp ranks).
        ``data.meta_info["global_step"]`` seeds the mini-batch shuffle."""
        self._switch_to_training()
        cfg = self.config
        mini = cfg.actor.ppo_mini_batch_size * cfg.rollout.n // self.dp_size
        step = int(data.meta_info.get("global_step", 0))
        metrics = self.actor.update_policy(data, mini, seed=self.inputs.seed + step)
        metrics["actor/lr"] = self.actor.engine.lr_scheduler_step()
        self._rollout_stale = True
        return DataProto(meta_info={"metrics": metrics})

    # ------------------------------------------------------------------ weight push to the async generators
    @register(dispatch_mode=Dispatch.RANK_ZERO, execute_mode=Execute.RANK_ZERO)
    def open_weight_sync(self) -> tuple[str, int, list]:
        """Host the transfer group's store; returns ``(host, port, layout)`` for the generators (layout: the
        ``(name, shape, dtype)`` of every tensor :meth:`send_weights` sends, in order)."""
        host, _ = self.get_master_addr_port()
        self._sync_store = open_store(host, self.inputs.weight_sync_timeout_s)
        items = self.actor.module.state_dict().items()
        if self._lora:  # the payload the generators take (adapters or merged), then the trainer's sync probe
            items = [*lora_sync.rollout_layout_items(self.inputs.rollout_lora_adapters, items),
                     lora_sync.probe_layout_entry()]
        self._sync_layout = layout_of(items)
        return host, self._sync_store.port, self._sync_layout

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def init_weight_sync(self, host: str, port: int, world_size: int) -> None:
        """Rank 0 joins the transfer group as its sender (rank 0 of ``world_size``); other ranks only gather."""
        if self.rank == 0:
            self._weight_sync = WeightTransferGroup(
                host, port, 0, world_size, self.device, self.inputs.weight_sync_timeout_s,
                store=self._sync_store)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def send_weights(self, version: int) -> dict[str, float]:
        """Gather the full weights (every rank, one tensor at a time) and broadcast them bucket by bucket from
        rank 0 to the generators. Returns rank 0's ``sync/weight_transfer_s`` (seconds, a ``Max`` over the ranks)
        and ``sync/weight_transfer_bytes`` (bytes per generator rank, a ``Sum``: only rank 0 sends); ``version`` is
        logged only."""
        self._switch_to_training()
        start = time.perf_counter()
        bucket = self.config.rollout.update_weights_bucket_megabytes << 20
        if self._weight_sync is None:  # ranks > 0 take part in the gathers only
            for _ in self._push_items():
                pass
            return {}
        sent = self._weight_sync.send(self._push_items(), self._sync_layout, bucket)
        seconds = time.perf_counter() - start
        logger.debug("sent weights of version %d: %d bytes in %.3fs", version, sent, seconds)
        return {"sync/weight_transfer_s": Max(seconds), "sync/weight_transfer_bytes": Sum(float(sent))}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """Write this rank's shards of the actor weights and optimizer, its lr-scheduler and RNG state; rank 0
        also writes the HF config, generation config and tokenizer to ``path/hf`` (for ``hybridflow export``)."""
        self._switch_to_training()
        self.actor.engine.save_checkpoint(path)
        if self.rank == 0:
            hf_dir = os.path.join(path, "hf")
            self.actor.module.config.save_pretrained(hf_dir)
            self.actor.module.generation_config.save_pretrained(hf_dir)
            self.tokenizer.save_pretrained(hf_dir)
            if self._lora:  # marks the checkpoint as LoRA for `hybridflow export` (merged or --adapter-only)
                lora_lib.save_adapter_config(self.actor.module, hf_dir, self.config.model.path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote (same number of ranks); the rollout re-syncs its weights."""
        self._switch_to_training()
        self.actor.engine.load_checkpoint(path)
        self._rollout_stale = True


"""The critic role: a value model trained by its ``critic.strategy`` engine, one process per rank."""

from __future__ import annotations

import torch

from hybridflow.controller import Dispatch, Worker, register
from hybridflow.distributed import init_distributed
from hybridflow.models import lora as lora_lib
from hybridflow.protocol import DataProto
from hybridflow.training import EngineSpec, engine_layout, get_engine_class
from hybridflow.workers import columns
from hybridflow.workers.timing import report_time
from hybridflow.workers.actor_worker import setup_worker_process
from hybridflow.workers.engine_model import compute_dtypes
from hybridflow.workers.inputs import ConfigSection, CriticInputs, expect, expect_section
from hybridflow.workers.ppo_critic import PPOCritic


class CriticWorker(Worker):
    """Args:
        config: the ``critic`` section, a schema dataclass object.
        inputs: the values derived from the rest of the run config (seed, total steps, rollout.n, the backbone's
            model section).

    Built by :func:`hybridflow.trainer.worker_inputs.critic_args` (the reward critic and Safe-RLHF's cost critic).

    With ``critic.fsdp_config.param_offload`` / ``optimizer_offload`` the parameters (and grads) / the AdamW state
    live in host memory between the critic's calls and come to the device only for a call that needs them
    (verl's critic offload); on CPU both are no-ops.

    Raises:
        TypeError: ``config`` is not the ``critic`` section or ``inputs`` not a
            :class:`~hybridflow.workers.inputs.CriticInputs`.
    """

    def __init__(self, config: ConfigSection, inputs: CriticInputs) -> None:
        super().__init__()
        self.config = expect_section(config, "critic", ("model", "optim", "fsdp_config", "strategy"))
        self.inputs = expect(inputs, CriticInputs, "CriticWorker: inputs")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict:
        """Join the process group, build the value model's engine (backbone ``inputs.model``: ``critic.model``, its
        path the actor's when it has none; fresh scalar head; FSDP over all ranks) with AdamW and the lr schedule
        (``inputs.total_training_steps`` long), offloaded as ``critic.fsdp_config`` says. Returns
        ``{"compute_dtype": {"critic": "float32" | "bfloat16"}}`` (what ``dtype=auto`` chose; the driver logs it)."""
        setup_worker_process()
        init_distributed()
        cfg, inputs = self.config, self.inputs
        torch.manual_seed(inputs.seed + 1)
        self.layout = engine_layout(cfg.strategy, cfg, self.world_size, sp=cfg.ulysses_sequence_parallel_size)  # dp only (fsdp2) or megatron's dp x tp x pp
        dp_rank = self.layout.coords(self.rank)[0]  # sp/tp/pp peers share the dp rank's chunk; one of them collects
        self._register_dispatch_collect_info("critic", dp_rank=dp_rank, is_collect=self.layout.collects(self.rank))
        model_cfg = inputs.model
        fsdp = cfg.fsdp_config
        engine = get_engine_class(cfg.strategy).build(EngineSpec(
            kind="value", model=model_cfg, layout=self.layout, device=self.device_name,
            optim=cfg.optim, total_steps=inputs.total_training_steps, grad_clip=cfg.grad_clip,
            nonfinite_grad=inputs.nonfinite_grad, param_offload=fsdp.param_offload,
            optimizer_offload=fsdp.optimizer_offload, reshard_after_forward=fsdp.reshard_after_forward, role="critic",
            fsdp_size=fsdp.fsdp_size,
            lora=lora_lib.lora_enabled(model_cfg),  # inputs.model carries critic.model's lora_*: backbone adapters
            remove_padding=model_cfg.use_remove_padding))
        self.critic = PPOCritic(engine, None, cfg)
        engine.offload()
        return {"compute_dtype": compute_dtypes(critic=self.critic)}  # what dtype=auto chose; the driver logs it

    @register(dispatch_mode=Dispatch.MESH_COMPUTE_PROTO, mesh_name="critic", batch_keys=columns.SEQUENCE,
              non_tensor_batch_keys=columns.MODEL_INPUTS)
    @report_time
    def compute_values(self, data: DataProto) -> DataProto:
        """``values`` (B, R) fp32: V(s_t) before each response token, zero at padding."""
        with self.critic.engine.on_device(optimizer=False):
            cfg = self.config
            values = self.critic.compute_values(data, cfg.forward_micro_batch_size_per_gpu,
                                                cfg.forward_max_token_len_per_gpu)
        return DataProto.from_dict(tensors={"values": values})

    @register(dispatch_mode=Dispatch.MESH_COMPUTE_PROTO, mesh_name="critic", batch_keys=columns.CRITIC_UPDATE,
              non_tensor_batch_keys=columns.MODEL_INPUTS)
    @report_time
    def update_critic(self, data: DataProto) -> DataProto:
        """One clipped value-loss update; returns ``meta_info["metrics"]``."""
        cfg = self.config
        mini = cfg.ppo_mini_batch_size * self.inputs.rollout_n // self.layout.dp
        step = int(data.meta_info.get("global_step", 0))
        with self.critic.engine.on_device(optimizer=True):
            metrics = self.critic.update_critic(data, mini, seed=self.inputs.seed + step)
        metrics["critic/lr"] = self.critic.engine.lr_scheduler_step()
        return DataProto(meta_info={"metrics": metrics})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """Write this rank's shards of the critic weights and optimizer, its lr-scheduler and RNG state."""
        with self.critic.engine.on_device(optimizer=True):
            self.critic.engine.save_checkpoint(path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote (same number of ranks)."""
        with self.critic.engine.on_device(optimizer=True):
            self.critic.engine.load_checkpoint(path)


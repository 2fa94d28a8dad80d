"""The critic role: a value model trained with FSDP2, one process per rank."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from hybridflow.controller import Dispatch, Worker, register
from hybridflow.distributed.checkpoint import load_sharded, save_sharded
from hybridflow.distributed import (apply_fsdp2, build_mesh, init_distributed, offload_module, offload_optimizer,
                                    onload_module, onload_optimizer)
from hybridflow.distributed.precision import mixed_precision_policy, training_dtypes
from hybridflow.models.hf import load_value_model
from hybridflow.protocol import DataProto
from hybridflow.workers.timing import report_time
from hybridflow.workers.actor_worker import setup_worker_process
from hybridflow.workers.optim import build_lr_scheduler, build_optimizer
from hybridflow.workers.ppo_critic import PPOCritic


class CriticWorker(Worker):
    """Args:
        config: the full run config (reads ``critic``, ``actor_rollout_ref`` for defaults, ``trainer``).

    With ``critic.fsdp_config.param_offload`` / ``optimizer_offload`` the parameters (and grads) / the AdamW state
    live in host memory between the critic's calls and come to the device only for a call that needs them
    (verl's critic offload); on CPU both are no-ops.
    """

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self, total_training_steps: int) -> None:
        """Join the process group, load the value model (backbone from ``critic.model.path`` or the actor's
        path, fresh scalar head), shard with FSDP2, build AdamW and the lr schedule."""
        setup_worker_process()
        init_distributed()
        cfg = self.config.critic
        torch.manual_seed(self.config.trainer.seed + 1)
        device = self.device_name
        mesh = build_mesh(dp=self.world_size)
        self._register_dispatch_collect_info("critic", dp_rank=self.rank, is_collect=True)
        model_cfg = cfg.model if cfg.model.path else self.config.actor_rollout_ref.model
        dtype, compute = training_dtypes(model_cfg.dtype, device)  # hybridflow.distributed.precision
        module = load_value_model(model_cfg.path, dtype, model_cfg.trust_remote_code)
        if model_cfg.enable_gradient_checkpointing:
            module.gradient_checkpointing_enable()
        module = apply_fsdp2(module.to(device), mesh, mp_policy=mixed_precision_policy(compute))
        optimizer = build_optimizer(module, cfg.optim)
        self.lr_scheduler = build_lr_scheduler(optimizer, cfg.optim, total_training_steps)
        self.critic = PPOCritic(module, optimizer, cfg, self.config.trainer.nonfinite_grad,
                                use_remove_padding=model_cfg.use_remove_padding)
        self._device = device
        self._offload()

    def _offload(self) -> None:
        fsdp = self.config.critic.fsdp_config
        if fsdp.param_offload:
            offload_module(self.critic.module)
        if fsdp.optimizer_offload:
            offload_optimizer(self.critic.optimizer)

    @contextmanager
    def _on_device(self, optimizer: bool) -> Iterator[None]:
        """Onload what ``critic.fsdp_config`` offloads (the optimizer state only when ``optimizer``) for one call,
        and offload it again afterwards (also after an error)."""
        fsdp = self.config.critic.fsdp_config
        if fsdp.param_offload:
            onload_module(self.critic.module, self._device)
        if optimizer and fsdp.optimizer_offload:
            onload_optimizer(self.critic.optimizer, self._device)
        try:
            yield
        finally:
            self._offload()

    @register(dispatch_mode=Dispatch.MESH_COMPUTE_PROTO, mesh_name="critic")
    @report_time
    def compute_values(self, data: DataProto) -> DataProto:
        """``values`` (B, R) fp32: V(s_t) before each response token, zero at padding."""
        with self._on_device(optimizer=False):
            cfg = self.config.critic
            values = self.critic.compute_values(data, cfg.forward_micro_batch_size_per_gpu,
                                                cfg.forward_max_token_len_per_gpu)
        return DataProto.from_dict(tensors={"values": values})

    @register(dispatch_mode=Dispatch.MESH_COMPUTE_PROTO, mesh_name="critic")
    @report_time
    def update_critic(self, data: DataProto) -> DataProto:
        """One clipped value-loss update; returns ``meta_info["metrics"]``."""
        cfg = self.config.critic
        mini = cfg.ppo_mini_batch_size * self.config.actor_rollout_ref.rollout.n // self.world_size
        step = int(data.meta_info.get("global_step", 0))
        with self._on_device(optimizer=True):
            metrics = self.critic.update_critic(data, mini, seed=self.config.trainer.seed + step)
        metrics["critic/lr"] = self.lr_scheduler.get_last_lr()[0]
        self.lr_scheduler.step()
        return DataProto(meta_info={"metrics": metrics})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """Write this rank's shards of the critic weights and optimizer, its lr-scheduler and RNG state."""
        with self._on_device(optimizer=True):
            save_sharded(path, self.critic.module, self.critic.optimizer,
                         {"lr_scheduler": self.lr_scheduler.state_dict(), "skipped_steps": self.critic.skipped_steps})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote (same number of ranks)."""
        with self._on_device(optimizer=True):
            extra = load_sharded(path, self.critic.module, self.critic.optimizer)
        self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        self.critic.skipped_steps = extra["skipped_steps"]


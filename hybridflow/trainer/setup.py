"""Building what a driver needs from the config: the Ray connection, the data, the worker groups."""

from __future__ import annotations

import itertools
import logging
import os
from typing import Iterator

import torch

from hybridflow.controller import RayClassWithInitArgs, RayWorkerGroup, ResourcePool
from hybridflow.data.builtin_task import make_builtin_rows
from hybridflow.data.dataset import RLHFDataset, collate_fn, load_rows
from hybridflow.models.hf import load_tokenizer
from hybridflow.protocol import DataProto
from hybridflow.workers.actor_worker import ActorRolloutRefWorker
from hybridflow.workers.critic_worker import CriticWorker
from hybridflow.workers.reward_worker import RuleRewardWorker

logger = logging.getLogger(__name__)

#: estimators that need a learned value function
CRITIC_ESTIMATORS = ("gae",)


def init_ray(config) -> bool:
    """Connect to ``RAY_ADDRESS`` / ``trainer.ray_init.address`` if set, else start a local cluster whose
    dashboard (if any) binds to 127.0.0.1. Returns True when this call started the cluster."""
    import ray

    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS") or config.trainer.ray_init.address
    if address:
        ray.init(address=address)
        return False
    ranks = config.trainer.n_gpus_per_node * config.trainer.nnodes
    num_cpus = config.trainer.ray_init.num_cpus or max(os.cpu_count() or 1, ranks + 1)
    ray.init(num_cpus=num_cpus, include_dashboard=False, dashboard_host="127.0.0.1", log_to_driver=True)
    return True


def use_critic(config) -> bool:
    """``critic.enable`` if set, else whether the advantage estimator needs values."""
    if config.critic.enable is not None:
        return bool(config.critic.enable)
    return config.algorithm.adv_estimator in CRITIC_ESTIMATORS


def _rows(files, split: str, size: int, seed: int, prompt_key: str) -> list[dict]:
    return load_rows(files, prompt_key) if files else make_builtin_rows(split, size, seed)


def build_data(config) -> tuple[Iterator[DataProto], DataProto, int]:
    """Train batches (an endless iterator over epochs, reshuffled per epoch with ``data.seed``), the whole
    validation set as one left-padded DataProto, and the number of steps per epoch."""
    data = config.data
    model = config.actor_rollout_ref.model
    tokenizer = load_tokenizer(model.tokenizer_path or model.path, model.trust_remote_code)

    def dataset(files, split, size):
        rows = _rows(files, split, size, data.seed, data.prompt_key)
        return RLHFDataset(rows, tokenizer, data.max_prompt_length, data.prompt_key, data.truncation)

    train = dataset(data.train_files, "train", data.builtin_train_size)
    val = dataset(data.val_files, "val", data.builtin_val_size)
    steps_per_epoch = len(train) // data.train_batch_size
    if steps_per_epoch == 0:
        raise ValueError(
            f"data.train_batch_size={data.train_batch_size} exceeds the {len(train)} training prompts"
        )

    def collate(features):
        return collate_fn(features, tokenizer.pad_token_id, data.max_prompt_length)

    def batches() -> Iterator[DataProto]:
        for epoch in itertools.count():
            gen = torch.Generator().manual_seed(data.seed + epoch)
            order = torch.randperm(len(train), generator=gen) if data.shuffle else torch.arange(len(train))
            for i in range(steps_per_epoch):
                idx = order[i * data.train_batch_size : (i + 1) * data.train_batch_size]
                yield collate([train[int(j)] for j in idx])

    val_data = collate([val[i] for i in range(len(val))])
    return batches(), val_data, steps_per_epoch


def total_training_steps(config, steps_per_epoch: int) -> int:
    """``trainer.total_training_steps`` if set, else ``total_epochs`` x steps per epoch."""
    if config.trainer.total_training_steps:
        return int(config.trainer.total_training_steps)
    return int(config.trainer.total_epochs * steps_per_epoch)


def build_worker_groups(config, total_steps: int) -> dict[str, RayWorkerGroup]:
    """Spawn the actor(+rollout+ref) and critic groups on one shared pool of ``n_gpus_per_node x nnodes``
    ranks (each group has that many ranks; they take turns on the same devices), and the rule reward on a
    one-rank pool. Calls ``init_model`` on each (in parallel)."""
    tr = config.trainer
    pool = ResourcePool([tr.n_gpus_per_node] * tr.nnodes, max_colocate_count=3, name_prefix="global")
    reward_pool = ResourcePool([1], max_colocate_count=1, name_prefix="reward")
    groups = {"actor": RayWorkerGroup(pool, RayClassWithInitArgs(ActorRolloutRefWorker, config, "actor_rollout_ref"),
                                      name_prefix="actor")}
    if use_critic(config):
        groups["critic"] = RayWorkerGroup(pool, RayClassWithInitArgs(CriticWorker, config), name_prefix="critic")
    groups["reward"] = RayWorkerGroup(reward_pool, RayClassWithInitArgs(RuleRewardWorker, config),
                                      name_prefix="reward")
    # init in parallel: the reward is cheap; actor and critic load concurrently
    for name, group in groups.items():
        if name == "reward":
            group.init_model()
        else:
            group.init_model(total_steps)
    return groups

"""Building what a driver needs from the config: the Ray connection, the data, the worker groups."""

from __future__ import annotations

import itertools
from contextlib import contextmanager
import logging
import os
from typing import Callable, Iterator

import torch

from hybridflow.controller import RayClassWithInitArgs, RayWorkerGroup, ResourcePool
from hybridflow.config import need_critic
from hybridflow.controller.futures import get_outputs
from hybridflow.data.builtin_task import make_builtin_rows
from hybridflow.data.dataset import RLHFDataset, collate_fn, load_rows
from hybridflow.models.hf import load_tokenizer
from hybridflow.protocol import DataProto
from hybridflow.workers.actor_worker import ActorRolloutRefWorker
from hybridflow.workers.critic_worker import CriticWorker
from hybridflow.workers.generator_worker import GeneratorWorker
from hybridflow.workers.reward_worker import RuleRewardWorker
from hybridflow.workers.rm_worker import RewardModelWorker

logger = logging.getLogger(__name__)

def init_ray(config) -> bool:
    """Connect to ``RAY_ADDRESS`` / ``trainer.ray_init.address`` if set, else start a local cluster (with
    ``trainer.ray_init.num_cpus`` logical CPUs, default max(cores, ranks of all resource pools + 1)) whose
    dashboard (if any) binds to 127.0.0.1. Returns True when this call started the cluster."""
    import ray

    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS") or config.trainer.ray_init.address
    if address:
        ray.init(address=address)
        return False
    pools = config.resource_pool.pools
    ranks = sum(sum(nodes) for nodes in pools.values()) if pools else config.trainer.n_gpus_per_node * config.trainer.nnodes
    num_cpus = config.trainer.ray_init.num_cpus or max(os.cpu_count() or 1, ranks + 1)
    ray.init(num_cpus=num_cpus, include_dashboard=False, dashboard_host="127.0.0.1", log_to_driver=True)
    return True


def _rows(files, split: str, size: int, seed: int, prompt_key: str) -> list[dict]:
    return load_rows(files, prompt_key) if files else make_builtin_rows(split, size, seed)


def build_data(config) -> tuple[Callable[[int], Iterator[DataProto]], DataProto, int]:
    """``batches(start_step)``: the train batches from batch position ``start_step`` on (an endless iterator over
    epochs, each a permutation seeded by ``data.seed + epoch``, so the batches are a pure function of the
    position and a resumed run sees exactly the batches it would have seen; the position is the global step
    unless DAPO dynamic sampling consumed extra batches, and the trainer checkpoints it); the whole validation set as one
    left-padded DataProto; the number of steps per epoch."""
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

    def batches(start_step: int = 0) -> Iterator[DataProto]:
        for epoch in itertools.count(start_step // steps_per_epoch):
            gen = torch.Generator().manual_seed(data.seed + epoch)
            order = torch.randperm(len(train), generator=gen) if data.shuffle else torch.arange(len(train))
            first = start_step % steps_per_epoch if epoch == start_step // steps_per_epoch else 0
            for i in range(first, steps_per_epoch):
                idx = order[i * data.train_batch_size : (i + 1) * data.train_batch_size]
                yield collate([train[int(j)] for j in idx])

    val_data = collate([val[i] for i in range(len(val))])
    return batches, val_data, steps_per_epoch


def total_training_steps(config, steps_per_epoch: int) -> int:
    """``trainer.total_training_steps`` if set, else ``total_epochs`` x steps per epoch."""
    if config.trainer.total_training_steps:
        return int(config.trainer.total_training_steps)
    return int(config.trainer.total_epochs * steps_per_epoch)


DEFAULT_POOL = "global_pool"
ROLES = ("actor", "critic", "reward", "reward_model", "cost_model", "cost_critic", "generator")  # worker-group roles
_TAKE_TOTAL_STEPS = ("actor", "critic", "cost_critic")  # roles whose init_model sizes an lr schedule


def worker_roles(config) -> dict[str, RayClassWithInitArgs]:
    """The worker groups a run needs, by role: ``actor`` (+rollout+reference) and ``reward`` (rule reward and
    rule cost) always; ``critic`` when :func:`~hybridflow.config.need_critic`; ``reward_model`` with
    ``reward_model.enable``; for ``algorithm.driver=safe_rlhf`` a ``cost_critic`` (same settings as ``critic``)
    and, with ``cost_model.enable``, a ``cost_model``; for ``algorithm.driver=async`` the ``generator`` group, and the
    actor without a rollout (it trains; the generators sample)."""
    is_async = config.algorithm.driver == "async"
    roles = {"actor": RayClassWithInitArgs(ActorRolloutRefWorker, config,
                                           "actor_ref" if is_async else "actor_rollout_ref"),
             "reward": RayClassWithInitArgs(RuleRewardWorker, config)}
    if is_async:
        roles["generator"] = RayClassWithInitArgs(GeneratorWorker, config)
    if need_critic(config):
        roles["critic"] = RayClassWithInitArgs(CriticWorker, config)
    if config.reward_model.enable:
        roles["reward_model"] = RayClassWithInitArgs(RewardModelWorker, config, "reward_model")
    if config.algorithm.driver == "safe_rlhf":
        roles["cost_critic"] = RayClassWithInitArgs(CriticWorker, config)
        if config.cost_model.enable:
            roles["cost_model"] = RayClassWithInitArgs(RewardModelWorker, config, "cost_model")
    return roles


def resource_pool_spec(config) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Pools (name -> ranks per node) and the role -> pool mapping from ``resource_pool``; the default is one
    pool of ``n_gpus_per_node x nnodes`` ranks shared by every role.

    Raises:
        ValueError: a role maps to a pool that is not defined (the message lists the pools).
    """
    tr = config.trainer
    pools = dict(config.resource_pool.pools or {DEFAULT_POOL: [tr.n_gpus_per_node] * tr.nnodes})
    given = dict(config.resource_pool.mapping)
    unknown = sorted(set(given) - set(ROLES))
    if unknown:
        raise ValueError(f"resource_pool.mapping has unknown roles {unknown}; roles are {list(ROLES)}")
    actor_pool = given.get("actor", DEFAULT_POOL)
    # a role not mapped explicitly shares the actor's pool
    mapping = {role: given.get(role, actor_pool) for role in ROLES}
    for role, pool in mapping.items():
        if pool not in pools:
            where = f"resource_pool.mapping.{role}" if role in given else f"{role} (unmapped: follows the actor)"
            raise ValueError(f"{where} names pool {pool!r}, but the pools are {sorted(pools)}")
    return {k: list(v) for k, v in pools.items()}, mapping


@contextmanager
def worker_groups(config, total_steps: int) -> Iterator[dict[str, RayWorkerGroup]]:
    """Spawn the groups of :func:`worker_roles` on their resource pools (each group has as many ranks as its
    pool; groups on one pool share its devices and take turns), run every group's ``init_model`` concurrently,
    and yield ``{role: group}``. On exit (also on error) the pools are removed, which ends their actors, so a
    long-lived Ray cluster is left as it was found."""
    pools_spec, mapping = resource_pool_spec(config)
    roles = worker_roles(config)
    sharing = {name: sum(mapping[r] == name for r in roles) for name in pools_spec}
    pools: dict[str, ResourcePool] = {}
    try:
        for name, nodes in pools_spec.items():
            if sharing[name]:
                pools[name] = ResourcePool(nodes, max_colocate_count=max(1, sharing[name]), name_prefix=name)
        created = RayWorkerGroup.create_many([(pools[mapping[role]], cls, role) for role, cls in roles.items()])
        groups = dict(zip(roles, created))
        pending = {role: group.execute_all_async("init_model",
                                                     *([total_steps] if role in _TAKE_TOTAL_STEPS else []))
                   for role, group in groups.items()}
        for role, refs in pending.items():  # WorkerError names the role and rank of a failed init
            get_outputs(refs, range(len(refs)), groups[role].name, "init_model")
        yield groups
    finally:
        for pool in pools.values():
            pool.remove()

"""Building what a driver needs from the config: the Ray connection, the data, the worker groups."""

from __future__ import annotations

import itertools
from contextlib import contextmanager
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Union

import torch

from hybridflow.controller import (ColocatedWorkerGroup, RayClassWithInitArgs, RayWorkerGroup, ResourcePoolManager,
                                   create_groups)
from hybridflow.controller.futures import CallTimeoutError, get_outputs
from hybridflow.controller.unread import forget
from hybridflow.controller.worker import is_loopback
from hybridflow.data.builtin import builtin_task_rows, is_builtin_task
from hybridflow.data.builtin_task import make_builtin_rows
from hybridflow.data.dataset import RLHFDataset, collate_fn, first_rows, load_rows
from hybridflow.data.multimodal import MultimodalDataset, collate_multimodal, vision_dataset
from hybridflow.errors import DataError, UserError
from hybridflow.models.hf import MissingTokenizerError, load_tokenizer, model_positions
from hybridflow.models.vlm import INPUTS_KEY
from hybridflow.protocol import DataProto
from hybridflow.plugins import plugin_env
from hybridflow.utils import startup
from hybridflow.utils.progress import Progress
from hybridflow.rewards import check_data_sources
from hybridflow.tools.config import prompt_tool_schemas
from hybridflow.trainer.driver import Role, all_roles, get_driver
from hybridflow.trainer.layouts import log_layouts

if TYPE_CHECKING:
    from omegaconf import DictConfig
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

RAY_AUTH_MODE = "RAY_AUTH_MODE"  # Ray's token authentication: "token" or "disabled" (read at ray.init)

def init_ray(config: DictConfig) -> bool:
    """Connect to ``RAY_ADDRESS`` / ``trainer.ray_init.address`` if set (the cluster's own node IPs are used),
    else start a local cluster (with ``trainer.ray_init.num_cpus`` logical CPUs, default max(cores, ranks of all
    resource pools + 1)) whose processes listen on ``trainer.ray_init.node_ip_address`` only (127.0.0.1 by
    default, no dashboard). Returns True when this call started the cluster."""
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
    _start_local_ray(num_cpus, config.trainer.ray_init.node_ip_address)
    return True


def load_split(config: DictConfig, tokenizer: PreTrainedTokenizerBase, split: str) -> RLHFDataset:
    """The ``train`` or ``val`` prompts: ``data.<split>_files`` (parquet files, or ``builtin:NAME`` for a built-in
    task's split, :mod:`hybridflow.data.builtin`; the built-in arith task when unset), cut to the first
    ``data.<split>_max_samples`` rows (-1: all) before anything else reads them,
    tokenized, with every row's ``data_source`` checked against the reward registry (unless the rule reward is
    not used, ``reward_model.enable`` with ``combine=model``, or is a user's ``reward_model.compute_score``).

    Raises:
        DataError: a file is missing, lacks a column or has no rows, a row is malformed or over-long
            (``truncation=error``: all over-long rows in one message naming the longest), or a ``data_source`` has
            no registered reward; the message starts with ``data.<split>_files`` and names the file and the row
            inside it.
    """
    data, key = config.data, f"data.{split}_files"
    given = data.train_files if split == "train" else data.val_files
    files = [str(given)] if isinstance(given, (str, os.PathLike)) else [str(f) for f in given or []]
    sizes: list[tuple[str, int]] = []  # (file, rows), to name the file of a row
    rows: list[dict] = []
    try:
        size = data.builtin_train_size if split == "train" else data.builtin_val_size
        for path in files:
            part = (builtin_task_rows(path, split, size, data.seed) if is_builtin_task(path)
                    else load_rows(path, data.prompt_key))
            sizes.append((path, len(part)))
            rows += part
        if not files:
            rows = make_builtin_rows(split, size, data.seed)
            sizes.append((f"the built-in task's {split} split", len(rows)))
        rows = first_rows(rows, data.train_max_samples if split == "train" else data.val_max_samples,
                          f"data.{split}_max_samples")
        dataset = (vision_dataset(rows, tokenizer, config.actor_rollout_ref.model.path, data.max_prompt_length,
                                  data.prompt_key, prompt_tool_schemas(config))
                   or RLHFDataset(rows, tokenizer, data.max_prompt_length, data.prompt_key, data.truncation,
                                  tools=prompt_tool_schemas(config)))
        rule_reward_used = not (config.reward_model.enable and config.reward_model.combine == "model")
        if rule_reward_used and config.reward_model.compute_score == "default":
            check_data_sources(rows)
    except FileNotFoundError as exc:
        raise DataError(f"{key}: {exc}") from None
    except DataError as exc:
        raise DataError(f"{key}: {_where(sizes, exc)}") from None
    return dataset


def _where(sizes: list[tuple[str, int]], exc: DataError) -> str:
    """``exc``'s message with its row (an index into the concatenated files) as ``<file> row <i>``."""
    if exc.row is None:
        return str(exc)
    row = exc.row
    for path, count in sizes:
        if row < count:
            return f"{path} row {row}: {exc.reason}"
        row -= count
    return str(exc)
def _start_local_ray(num_cpus: int, host: str) -> None:
    """``ray.init`` of a local cluster whose processes (GCS, raylet, agents, workers, the driver's own server)
    listen on ``host``; the workers' torch.distributed rendezvous then binds it too (``MASTER_ADDR`` is the node
    IP Ray reports).

    On Linux Ray replaces a loopback node IP by the machine's outward IP (its multi-machine mode), so for a
    loopback ``host`` Ray's single-machine mode (the one it uses on macOS/Windows: ``ENABLE_RAY_CLUSTER`` false,
    env ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``) is switched on for the duration of ``ray.init`` only; the
    started processes take the node IP from their command line.

    A loopback cluster starts without Ray's token authentication (``RAY_AUTH_MODE=disabled`` in this process's
    environment, which the started processes inherit; Ray 2.60 otherwise turns it on for every new local cluster,
    writes ``~/.ray/auth_token`` and warns at each start). A ``RAY_AUTH_MODE`` the user set is kept, and a cluster
    on another address keeps Ray's default.
    """
    import ray
    from ray._private import ray_constants

    single_machine = is_loopback(host)
    if single_machine and not hasattr(ray_constants, "ENABLE_RAY_CLUSTER"):
        logger.warning("this Ray version (%s) has no single-machine mode: its processes may listen on all "
                       "interfaces", ray.__version__)
        single_machine = False
    saved = getattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    if single_machine:
        ray_constants.ENABLE_RAY_CLUSTER = False
    if is_loopback(host):  # only this machine can reach the cluster: no token (Ray's default makes one and warns)
        os.environ.setdefault(RAY_AUTH_MODE, "disabled")
    try:
        # address="local": always a new cluster, never one that another `ray start` left on this machine
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, dashboard_host=host,
                 _node_ip_address=host, log_to_driver=True)
    finally:
        if single_machine:
            ray_constants.ENABLE_RAY_CLUSTER = saved


def _tokenizer(path: str, trust_remote_code: bool):
    """:func:`load_tokenizer`, with a directory that is not a model reported in one line naming the key.

    Raises:
        FileNotFoundError: ``path`` is not a local directory.
        UserError: the directory holds no loadable tokenizer (one line: the config keys, the directory and, for
            missing files, the files expected; else transformers' whole message joined into one line).
    """
    key = "actor_rollout_ref.model.path / tokenizer_path"
    try:
        return load_tokenizer(path, trust_remote_code)
    except FileNotFoundError:
        raise
    except MissingTokenizerError as exc:
        raise UserError(f"{key}: no loadable tokenizer: {exc}") from None
    except (OSError, ValueError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise UserError(f"{key} {path!r}: no loadable tokenizer there ({type(exc).__name__}: {reason})") from None


def _sequence_models(config: DictConfig) -> list[tuple[str, Any]]:
    """(config key, model section) of every model that reads a whole prompt + response: the actor, the critic when
    trained from its own checkpoint, the reward and cost models when enabled."""
    from hybridflow.algorithms import need_critic_for

    models = [("actor_rollout_ref.model.path", config.actor_rollout_ref.model)]
    if need_critic_for(config.critic.enable, config.algorithm.adv_estimator) and config.critic.model.path:
        models.append(("critic.model.path", config.critic.model))
    for role in ("reward_model", "cost_model"):
        section = config.get(role)
        if section is not None and section.enable and section.model.path:
            models.append((f"{role}.model.path", section.model))
    return models


def check_positions(config: DictConfig) -> None:
    """``data.max_prompt_length + data.max_response_length`` fits each model's positions
    (:func:`~hybridflow.models.hf.model_positions`: ``max_position_embeddings``, times the rope scaling factor
    when the config has one); a model whose config cannot be read is left to its loader.

    Raises:
        UserError: the sum exceeds a model's positions (one line: both lengths, the keys, the model's limit).
    """
    data = config.data
    need = int(data.max_prompt_length) + int(data.max_response_length)
    for key, model in _sequence_models(config):
        positions = model_positions(model.path, model.trust_remote_code)
        if positions is None:
            continue
        limit, factor = positions
        if need > limit * factor:
            scaled = f" x rope scaling factor {factor:g}" if factor > 1 else ""
            raise UserError(f"data.max_prompt_length + data.max_response_length = {data.max_prompt_length} + "
                            f"{data.max_response_length} = {need} exceeds the model's max_position_embeddings="
                            f"{limit}{scaled} ({key}={model.path}, its config.json): lower data.max_prompt_length "
                            "or data.max_response_length, or use a model with more positions")


def build_data(config: DictConfig) -> tuple[Callable[[int], Iterator[DataProto]], DataProto, int]:
    """``batches(start_step)``: the train batches from batch position ``start_step`` on (an endless iterator over
    epochs, each a permutation seeded by ``data.seed + epoch``, so the batches are a pure function of the
    position and a resumed run sees exactly the batches it would have seen; the position is the global step
    unless DAPO dynamic sampling consumed extra batches, and the trainer checkpoints it); the whole validation
    set as one left-padded DataProto; the number of steps per epoch.

    Raises:
        DataError: see :func:`load_split`; also a ``data.train_batch_size`` above the number of train prompts.
        UserError: the model (or tokenizer) directory holds no loadable tokenizer; prompt + response longer than
            a model's positions (:func:`check_positions`).
    """
    data = config.data
    model = config.actor_rollout_ref.model
    tokenizer = _tokenizer(model.tokenizer_path or model.path, model.trust_remote_code)
    check_positions(config)

    train = load_split(config, tokenizer, "train")
    val = load_split(config, tokenizer, "val")
    steps_per_epoch = len(train) // data.train_batch_size
    if steps_per_epoch == 0:
        raise DataError(f"data.train_batch_size={data.train_batch_size} exceeds the {len(train)} training prompts "
                        f"of data.train_files ({data.train_files or 'the built-in task'})")

    vision = next((d for d in (train, val) if isinstance(d, MultimodalDataset)), None)

    def collate(features: list[dict[str, Any]]) -> DataProto:
        if vision is not None and isinstance(features[0].get(INPUTS_KEY), dict):  # image prompts: + mrope, images
            return collate_multimodal(features, tokenizer.pad_token_id, vision.image_token_id, vision.merge_size,
                                      data.max_prompt_length)
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


def total_training_steps(config: DictConfig, steps_per_epoch: int) -> int:
    """``trainer.total_training_steps`` if set, else ``total_epochs`` x steps per epoch."""
    if config.trainer.total_training_steps:
        return int(config.trainer.total_training_steps)
    return int(config.trainer.total_epochs * steps_per_epoch)


DEFAULT_POOL = "global_pool"

#: a role's worker group: processes of its own, or a view of processes shared with the other roles of its pool
WorkerGroup = Union[RayWorkerGroup, ColocatedWorkerGroup]


def worker_roles(config: DictConfig) -> dict[str, Role]:
    """The worker groups a run needs, by role: what the driver ``algorithm.driver`` asks for
    (:meth:`~hybridflow.trainer.driver.Driver.roles`; for the built-in drivers ``actor`` (+rollout+reference) and
    ``reward`` always, ``critic`` when :func:`~hybridflow.config.need_critic`, ``reward_model`` with
    ``reward_model.enable``, Safe-RLHF's ``cost_critic`` and ``cost_model``, the async driver's ``generator``)."""
    return get_driver(config.algorithm.driver).roles(config)


def resource_pool_spec(config: DictConfig) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Pools (name -> ranks per node) and the role -> pool mapping from ``resource_pool``; the default is one
    pool of ``n_gpus_per_node x nnodes`` ranks shared by every role.

    Raises:
        ValueError: a role maps to a pool that is not defined (the message lists the pools).
    """
    tr = config.trainer
    roles = all_roles()
    pools = dict(config.resource_pool.pools or {DEFAULT_POOL: [tr.n_gpus_per_node] * tr.nnodes})
    given = dict(config.resource_pool.mapping)
    unknown = sorted(set(given) - set(roles))
    if unknown:
        raise ValueError(f"resource_pool.mapping has unknown roles {unknown}; roles are {list(roles)}")
    actor_pool = given.get("actor", DEFAULT_POOL)
    # a role not mapped explicitly shares the actor's pool
    mapping = {role: given.get(role, actor_pool) for role in roles}
    for role, pool in mapping.items():
        if pool not in pools:
            where = f"resource_pool.mapping.{role}" if role in given else f"{role} (unmapped: follows the actor)"
            raise ValueError(f"{where} names pool {pool!r}, but the pools are {sorted(pools)}")
    return {k: list(v) for k, v in pools.items()}, mapping


def _use_gpu(device: str) -> bool | None:
    """``trainer.device`` -> the pools' ``use_gpu``: auto -> None (GPUs iff the Ray cluster has them), cpu -> False
    (the workers reserve and see no GPU), cuda -> True.

    Raises:
        UserError: ``cuda`` on a Ray cluster without GPUs.
    """
    import ray

    if device == "cuda" and ray.cluster_resources().get("GPU", 0) < 1:
        raise UserError("trainer.device=cuda, but the Ray cluster has no GPUs (use trainer.device=auto or cpu, "
                         "or a cluster with GPUs)")
    return {"auto": None, "cpu": False, "cuda": True}[device]


@contextmanager
def worker_groups(config: DictConfig, total_steps: int) -> Iterator[dict[str, WorkerGroup]]:
    """Spawn the groups of :func:`worker_roles` on their resource pools (a
    :class:`~hybridflow.controller.ResourcePoolManager` of the pools the roles use; each group has as many ranks as
    its pool; groups on one pool share its devices and take turns; GPUs per ``trainer.device``), each worker
    constructed from its role's inputs (its config section(s) and derived values, :mod:`hybridflow.trainer.
    worker_inputs`; ``total_steps`` sizes the lr schedules), run every group's ``init_model`` concurrently, and
    yield ``{role: group}``. With ``trainer.colocate_roles`` the roles of one pool run in one process per rank
    (:func:`hybridflow.controller.create_groups`; a class asking for ``max_concurrency > 1``, the async generator,
    keeps processes of its own), each role still a group of its own (its name, calls, errors). Every worker imports
    ``trainer.plugins`` before its own constructor runs. On exit (also on error) the pools are removed, which ends their actors, so a long-lived
    Ray cluster is left as it was found."""
    pools_spec, mapping = resource_pool_spec(config)
    log_layouts(config)  # (dp, tp, pp) per role, marking the planned ones (the `layouts` section)
    use_gpu = _use_gpu(config.trainer.device)
    roles = worker_roles(config)
    used = {role: mapping[role] for role in roles}
    manager = ResourcePoolManager({name: nodes for name, nodes in pools_spec.items() if name in used.values()},
                                  used, use_gpu=use_gpu)
    try:
        start = time.monotonic()
        logger.info("starting worker groups: %s", ", ".join(
            f"{role} ({sum(pools_spec[mapping[role]])} ranks on {mapping[role]})" for role in roles))
        env = plugin_env(config.trainer.plugins)
        created = create_groups([
            (manager.get_resource_pool(role),
             RayClassWithInitArgs(spec.worker_class(), *spec.constructor_args(config, total_steps)), role)
            for role, spec in roles.items()], env=env, colocate=colocate_roles(config, roles, used))
        groups = dict(zip(roles, created))
        for group in created:  # every wait on a group's call is bounded by trainer.call_timeout_s (None: not)
            group.call_timeout_s = config.trainer.call_timeout_s
        _log_processes(groups)
        startup.mark("worker processes")
        pending = {role: group.execute_all_async("init_model") for role, group in groups.items()}
        _wait_until_up(groups, pending, start, config.trainer.call_timeout_s)
        startup.mark("models")
        yield groups
    finally:
        manager.remove()
        forget()  # the groups are gone: their calls nobody read concern no later step


def colocate_roles(config: DictConfig, roles: dict[str, Role], mapping: dict[str, str]) -> bool:
    """Whether the roles of a pool run in one process per rank: ``trainer.colocate_roles``, unless two roles of one
    pool build training engines that keep process-wide state (megatron-core's parallel state and RNG tracker:
    ``process_wide_state`` in :data:`hybridflow.training.ENGINES`; the roles' ``strategy_key``), which then could
    not hold different layouts or seeds (a warning says so and every role gets processes of its own)."""
    from omegaconf import OmegaConf

    from hybridflow.training import ENGINES

    if not config.trainer.colocate_roles:
        return False
    engines = {role: OmegaConf.select(config, spec.strategy_key) for role, spec in roles.items() if spec.strategy_key}

    for pool in set(mapping.values()):
        stateful = [r for r, name in engines.items() if mapping[r] == pool
                    and ENGINES.meta(name, "process_wide_state", False)]
        if len(stateful) > 1:
            logger.warning("roles %s on pool %s train with engines that keep process-wide state (%s): every role "
                           "runs in processes of its own (trainer.colocate_roles ignored)", stateful, pool,
                           ", ".join(sorted({engines[r] for r in stateful})))
            return False
    return True


def _log_processes(groups: dict[str, WorkerGroup]) -> None:
    """Log which roles share their processes (colocated), e.g. ``actor+critic+reward``."""
    seen: set[str] = set()
    for role, group in groups.items():
        if isinstance(group, ColocatedWorkerGroup) and role not in seen:
            hosted = (role, *group.colocated_with)
            seen.update(hosted)
            logger.info("colocated: %s in %d processes (one per rank)", "+".join(hosted), group.world_size)


def _wait_until_up(groups: dict[str, WorkerGroup], pending: dict[str, list], start: float,
                   timeout_s: Optional[float] = None) -> None:
    """Wait for every group's ``init_model`` refs (``pending``: role -> refs, one per rank), reporting each group
    as it comes up (a progress bar on a terminal, a log line each, with the seconds since ``start``, a
    ``time.monotonic()`` taken before the groups were spawned), at most ``timeout_s`` seconds from now (None: no
    limit).

    Raises:
        WorkerError: a rank's ``init_model`` raised or its actor died (names the role and rank), as soon as it
            happens, even while other groups still initialize.
        CallTimeoutError: ranks had not finished ``init_model`` after ``timeout_s`` seconds (names them per group).
    """
    import ray

    left = {role: set(refs) for role, refs in pending.items()}
    up: list[str] = []
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with Progress("worker groups up", len(pending), "groups", leave=False) as progress:
        while left:
            wait = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            ready, _ = ray.wait([ref for refs in left.values() for ref in refs], num_returns=1, timeout=wait)
            if not ready:
                raise CallTimeoutError([(groups[role].name, "init_model", sorted(pending[role].index(r) for r in refs))
                                        for role, refs in left.items() if refs], timeout_s)
            role = next(r for r, refs in left.items() if ready[0] in refs)
            left[role].discard(ready[0])
            if left[role]:
                continue
            del left[role]
            # WorkerError names the role and rank of a failed init
            outputs = get_outputs(pending[role], range(len(pending[role])), groups[role].name, "init_model")
            up.append(role)
            logger.info("worker group %s up: %d ranks, %.1f s after spawning%s", role, len(pending[role]),
                        time.monotonic() - start, _dtype_note(outputs[0] if outputs else None))
            progress.update(1, postfix={"up": ", ".join(up)})


def _dtype_note(output) -> str:
    """``; computes in actor float32, ref float32`` from a rank's ``init_model`` output (``compute_dtype``: model ->
    dtype name, what ``dtype=auto`` chose; every rank agrees), or "" when it reports none."""
    dtypes = output.get("compute_dtype") if isinstance(output, dict) else None
    return "; computes in " + ", ".join(f"{name} {dtype}" for name, dtype in dtypes.items()) if dtypes else ""

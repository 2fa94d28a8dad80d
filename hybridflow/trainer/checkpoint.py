"""Driver-side checkpoint bookkeeping: atomic directories, the ``latest`` pointer, retention, resume lookup.

Layout under ``trainer.default_local_dir``::

    global_step_<N>/actor/      sharded actor weights + optimizer (one set of files per rank), lr schedule, RNG
    global_step_<N>/critic/     the same for the critic (when trained)
    global_step_<N>/trainer_state.pt   step counter, KL controller (and other driver state)
    global_step_<N>/config.yaml        the run's resolved config (checked against the config that resumes it)
    latest_checkpointed_iteration.txt  N of the newest complete checkpoint

A checkpoint is written into ``.tmp_global_step_<N>`` and renamed when every part is on disk, and only then is
the pointer replaced (write + ``os.replace``). A crash part-way through a save therefore leaves the previous
checkpoint and the pointer untouched; the leftover ``.tmp_*`` directory is removed by the next save. A checkpoint
of the same step already on disk (from a run restarted with ``resume_mode=disable`` or from an earlier checkpoint) is
moved aside to ``.tmp_replaced_global_step_<N>`` and deleted only once the new one is in place (the next save puts
it back if a crash came in between).

Retention (``max_to_keep``) runs only after the new checkpoint and the pointer are complete, and it never removes
the checkpoint just written: it keeps that one and the ``max_to_keep - 1`` highest steps below it. Checkpoints of a
higher step (left by a run restarted from an earlier point) are removed then too. It looks at the directory, not at
what this process saved, so it also prunes what earlier (resumed) runs left.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

if TYPE_CHECKING:
    from omegaconf import DictConfig

logger = logging.getLogger(__name__)

POINTER = "latest_checkpointed_iteration.txt"
STATE_FILE = "trainer_state.pt"
CONFIG_FILE = "config.yaml"  # the resolved config, one per checkpoint
PREFIX = "global_step_"
REPLACED = ".tmp_replaced_"  # prefix of a checkpoint being replaced by a new one of the same step


class CheckpointManager:
    """Args:
        root: ``trainer.default_local_dir``.
        max_to_keep: keep the newest N checkpoints (None keeps all).
    """

    def __init__(self, root: str, max_to_keep: Optional[int] = None) -> None:
        self.root = root
        self.max_to_keep = max_to_keep

    def save(self, step: int, writers: dict[str, Callable[[str], None]], trainer_state: dict[str, Any]) -> str:
        """Write checkpoint ``step``: ``writers[name](dir)`` writes part ``name`` (e.g. a worker group's
        ``save_checkpoint``, or the config file) at ``<ckpt>/<name>`` (the checkpoint directory exists, whatever
        the parts); then the driver's ``trainer_state``. Returns the path."""
        os.makedirs(self.root, exist_ok=True)
        self._clean_leftovers()
        final = os.path.join(self.root, f"{PREFIX}{step}")
        tmp = os.path.join(self.root, f".tmp_{PREFIX}{step}")
        os.makedirs(tmp, exist_ok=True)
        for name, write in writers.items():
            write(os.path.join(tmp, name))
        torch.save(trainer_state, os.path.join(tmp, STATE_FILE))
        replaced = os.path.join(self.root, f"{REPLACED}{PREFIX}{step}")
        if os.path.exists(final):  # an older run's checkpoint of this step: keep it until the new one is in place
            os.replace(final, replaced)
        try:
            os.replace(tmp, final)
        except OSError:
            if os.path.exists(replaced):
                os.replace(replaced, final)
            raise
        pointer_tmp = os.path.join(self.root, POINTER + ".tmp")
        with open(pointer_tmp, "w") as f:
            f.write(str(step))
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer_tmp, os.path.join(self.root, POINTER))
        shutil.rmtree(replaced, ignore_errors=True)
        self._prune(step)
        logger.info("saved checkpoint %s", final)
        return final

    def _clean_leftovers(self) -> None:
        """Remove what an interrupted save left: its ``.tmp_*`` directory, and a replaced checkpoint whose
        replacement is complete (one whose replacement never landed is put back)."""
        for leftover in os.listdir(self.root):
            path = os.path.join(self.root, leftover)
            if leftover.startswith(REPLACED):
                final = os.path.join(self.root, leftover[len(REPLACED):])
                if not os.path.exists(os.path.join(final, STATE_FILE)):
                    shutil.rmtree(final, ignore_errors=True)
                    os.replace(path, final)
                    continue
            if leftover.startswith(".tmp_"):
                shutil.rmtree(path, ignore_errors=True)

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints on disk, ascending."""
        if not os.path.isdir(self.root):
            return []
        found = []
        for name in os.listdir(self.root):
            if name.startswith(PREFIX) and name[len(PREFIX):].isdigit():
                if os.path.exists(os.path.join(self.root, name, STATE_FILE)):
                    found.append(int(name[len(PREFIX):]))
        return sorted(found)

    def latest(self) -> Optional[str]:
        """Path of the checkpoint the pointer names (None when there is none)."""
        pointer = os.path.join(self.root, POINTER)
        if not os.path.exists(pointer):
            return None
        with open(pointer) as f:
            path = os.path.join(self.root, f"{PREFIX}{int(f.read().strip())}")
        if not os.path.exists(os.path.join(path, STATE_FILE)):
            raise FileNotFoundError(f"{pointer} names {path}, which is not a complete checkpoint")
        return path

    def resolve(self, resume_mode: str) -> Optional[str]:
        """``auto``: the latest checkpoint if any; ``disable``: None; anything else is a checkpoint path.

        Raises:
            FileNotFoundError: an explicit path that is not a complete checkpoint.
        """
        if resume_mode == "disable":
            return None
        if resume_mode == "auto":
            return self.latest()
        if not os.path.exists(resume_mode):
            raise FileNotFoundError(f"trainer.resume_mode={resume_mode!r}: no such path; use auto, disable or a "
                                    "global_step_<N> directory")
        if not os.path.exists(os.path.join(resume_mode, STATE_FILE)):
            raise FileNotFoundError(
                f"trainer.resume_mode={resume_mode!r}: not a complete checkpoint (no {STATE_FILE}); "
                "use auto, disable or a global_step_<N> directory"
            )
        return resume_mode

    def _prune(self, saved: int) -> None:
        """Keep checkpoint ``saved`` (just written) and the ``max_to_keep - 1`` highest steps below it."""
        if not self.max_to_keep:
            return
        older = [s for s in self.steps() if s < saved]
        doomed = older[: max(0, len(older) - (self.max_to_keep - 1))] + [s for s in self.steps() if s > saved]
        for step in doomed:
            shutil.rmtree(os.path.join(self.root, f"{PREFIX}{step}"), ignore_errors=True)


class IncompatibleCheckpointError(ValueError):
    """A checkpoint written with a config that the resuming run's config cannot continue (see ``RESUME_KEYS``)."""


# What a resume cannot change: the algorithm (driver, estimator: which parts a checkpoint has and what they mean),
# the models whose weights it holds, and the layout its shards were written in (ranks per checkpointed group and
# training tensor parallelism: per-rank shards, RNG and lr-schedule files are loaded rank by rank). Everything else
# (learning rates, batch sizes, KL and loss settings, total steps, logging, ...) may change on resume.
RESUME_KEYS = ("algorithm.driver", "algorithm.adv_estimator", "critic.enable", "actor_rollout_ref.model.path",
               "critic.model.path", "actor_rollout_ref.actor.tensor_model_parallel_size",
               "actor_rollout_ref.actor.strategy", "critic.strategy",
               *(f"{role}.megatron.{size}_model_parallel_size" for role in ("actor_rollout_ref.actor", "critic")
                 for size in ("tensor", "pipeline", "expert")))
# a key a checkpoint's config may predate: its value then (the *.megatron sections came with strategy=megatron)
RESUME_DEFAULTS = {key: 1 for key in RESUME_KEYS if ".megatron." in key}


def save_config(config: DictConfig, path: str, run_info: Optional[dict[str, Any]] = None) -> None:
    """Write the resolved ``config`` to ``path`` (YAML): a checkpoint part (``<ckpt>/config.yaml``), with the run's
    ``run_info`` section (:func:`~hybridflow.utils.provenance.make_run_info`; none when None), which the resume
    check does not compare."""
    from omegaconf import OmegaConf

    from hybridflow.utils.provenance import config_with_run_info

    OmegaConf.save(config_with_run_info(config, run_info), path, resolve=True)


def resume_signature(config: DictConfig) -> dict[str, Any]:
    """The values of ``RESUME_KEYS`` in ``config`` (a loaded config or one read back from a checkpoint) plus the
    number of ranks of each group a driver checkpoints (``ranks of <role>``, the roles its
    :meth:`~hybridflow.trainer.driver.Driver.roles` marks ``checkpointed``, from ``resource_pool`` or
    ``trainer.n_gpus_per_node x trainer.nnodes``; None for a group this run's driver does not train). ``critic.enable`` is
    resolved (whether a critic is trained) and ``critic.model.path`` is the path the critic loads ("" = actor's)."""
    from omegaconf import OmegaConf

    from hybridflow.algorithms import need_critic_for
    from hybridflow.trainer.driver import all_checkpointed_roles, get_driver
    from hybridflow.trainer.setup import resource_pool_spec

    sig = {key: OmegaConf.select(config, key, default=RESUME_DEFAULTS.get(key)) for key in RESUME_KEYS}
    critic = need_critic_for(config.critic.enable, config.algorithm.adv_estimator)
    sig["critic.enable"] = critic
    sig["critic.model.path"] = (sig["critic.model.path"] or sig["actor_rollout_ref.model.path"]) if critic else None
    pools, mapping = resource_pool_spec(config)
    trained = [r for r, spec in get_driver(config.algorithm.driver).roles(config).items() if spec.checkpointed]
    for role in all_checkpointed_roles():  # the same keys whatever the driver
        sig[f"ranks of {role}"] = sum(pools[mapping[role]]) if role in trained else None
    return sig


def check_resume_config(config: DictConfig, path: str) -> None:
    """Raise when checkpoint ``path`` was written with a config that ``config`` cannot resume (differing
    :func:`resume_signature`). A checkpoint without ``config.yaml`` (written before checkpoints carried it) is
    resumed with a warning.

    Raises:
        IncompatibleCheckpointError: naming every differing key with the checkpoint's and this run's value.
    """
    from omegaconf import OmegaConf

    saved_path = os.path.join(path, CONFIG_FILE)
    if not os.path.exists(saved_path):
        logger.warning("checkpoint %s has no %s: cannot check that this config can resume it", path, CONFIG_FILE)
        return
    saved, now = resume_signature(OmegaConf.load(saved_path)), resume_signature(config)
    def show(value: Any) -> str:
        return "none" if value is None else repr(value)

    diffs = [f"{key}: {show(saved.get(key))} in the checkpoint, {show(now[key])} now"
             for key in now if saved.get(key) != now[key]]
    if diffs:
        raise IncompatibleCheckpointError(
            f"cannot resume {path} (trainer.resume_mode={config.trainer.resume_mode}): it was written with another "
            f"config: {'; '.join(diffs)}. Train into another trainer.default_local_dir, or set "
            "trainer.resume_mode=disable to start from scratch here (this directory's checkpoints get replaced)")


def load_trainer_state(path: str) -> dict[str, Any]:
    """The driver state saved with checkpoint ``path`` (plain dicts, lists and numbers: it loads with
    ``weights_only=True``, so a checkpoint from someone else cannot run code)."""
    return torch.load(os.path.join(path, STATE_FILE), weights_only=True)

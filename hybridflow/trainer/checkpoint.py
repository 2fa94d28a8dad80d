"""Driver-side checkpoint bookkeeping: atomic directories, the ``latest`` pointer, retention, resume lookup.

Layout under ``trainer.default_local_dir``::

    global_step_<N>/actor/      sharded actor weights + optimizer (one set of files per rank), lr schedule, RNG
    global_step_<N>/critic/     the same for the critic (when trained)
    global_step_<N>/trainer_state.pt   step counter, KL controller (and other driver state)
    latest_checkpointed_iteration.txt  N of the newest complete checkpoint

A checkpoint is written into ``.tmp_global_step_<N>`` and renamed when every part is on disk, and only then is
the pointer replaced (write + ``os.replace``). A crash part-way through a save therefore leaves the previous
checkpoint and the pointer untouched; the leftover ``.tmp_*`` directory is removed by the next save.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any, Callable, Optional

import torch

logger = logging.getLogger(__name__)

POINTER = "latest_checkpointed_iteration.txt"
STATE_FILE = "trainer_state.pt"
PREFIX = "global_step_"


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
        ``save_checkpoint``) into ``<ckpt>/<name>``; then the driver's ``trainer_state``. Returns the path."""
        os.makedirs(self.root, exist_ok=True)
        for leftover in os.listdir(self.root):
            if leftover.startswith(".tmp_"):
                shutil.rmtree(os.path.join(self.root, leftover), ignore_errors=True)
        final = os.path.join(self.root, f"{PREFIX}{step}")
        tmp = os.path.join(self.root, f".tmp_{PREFIX}{step}")
        for name, write in writers.items():
            write(os.path.join(tmp, name))
        torch.save(trainer_state, os.path.join(tmp, STATE_FILE))
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer_tmp = os.path.join(self.root, POINTER + ".tmp")
        with open(pointer_tmp, "w") as f:
            f.write(str(step))
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer_tmp, os.path.join(self.root, POINTER))
        self._prune()
        logger.info("saved checkpoint %s", final)
        return final

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

    def _prune(self) -> None:
        if not self.max_to_keep:
            return
        for step in self.steps()[: -self.max_to_keep]:
            shutil.rmtree(os.path.join(self.root, f"{PREFIX}{step}"), ignore_errors=True)


def load_trainer_state(path: str) -> dict[str, Any]:
    """The driver state saved with checkpoint ``path`` (plain dicts, lists and numbers: it loads with
    ``weights_only=True``, so a checkpoint from someone else cannot run code)."""
    return torch.load(os.path.join(path, STATE_FILE), weights_only=True)

"""Built-in tasks addressed as ``builtin:NAME`` in ``data.train_files`` / ``data.val_files``.

``arith`` (:mod:`hybridflow.data.builtin_task`, the default when no files are given), ``tool-arith``
(:mod:`hybridflow.data.tool_task`, the tool-use task) and ``vlm-count`` (:mod:`hybridflow.data.vlm_task`, counting
circles in a synthetic image; its rows carry verl's ``images`` column). Each entry is a row maker
``fn(split, num, seed) -> list[dict]`` in verl's parquet schema; its metadata ``data_source`` names the reward
that scores its rows. ``data.builtin_train_size`` / ``data.builtin_val_size`` give ``num``, ``data.seed`` the seed.
"""

from __future__ import annotations

from hybridflow.data import builtin_task, tool_task, vlm_task
from hybridflow.registry import Registry

BUILTIN_DATA_PREFIX = "builtin:"
BUILTIN_TASKS: Registry = Registry("built-in task")
BUILTIN_TASKS.register("arith", data_source=builtin_task.DATA_SOURCE)(builtin_task.make_builtin_rows)
BUILTIN_TASKS.register("tool-arith", data_source=tool_task.DATA_SOURCE)(tool_task.make_tool_rows)
BUILTIN_TASKS.register("vlm-count", data_source=vlm_task.DATA_SOURCE)(vlm_task.make_vlm_rows)


def is_builtin_task(path: object) -> bool:
    """Whether a ``data.*_files`` entry names a built-in task (``"builtin:NAME"``) instead of a file."""
    return isinstance(path, str) and path.startswith(BUILTIN_DATA_PREFIX)


def builtin_task_rows(spec: str, split: str, num: int, seed: int) -> list[dict]:
    """The ``num`` rows of ``split`` of the built-in task ``spec`` (``"builtin:NAME"``), drawn with ``seed``.

    Raises:
        UnknownNameError: NAME is not a built-in task (the message lists the known ones).
        ValueError: unknown ``split`` or negative ``num``.
    """
    return BUILTIN_TASKS.get(spec[len(BUILTIN_DATA_PREFIX):])(split, num, seed)

"""What produced a run's files: the hybridflow version, the git commit of a checkout, the wall-clock start.

:func:`make_run_info` is the ``run_info`` section that the run's ``config.yaml`` (and each checkpoint's) carries
next to the config sections; every ``metrics.jsonl`` row carries its own ``timestamp``
(:class:`~hybridflow.utils.tracking.Tracking`). None of it is config: the config loader drops a ``run_info``
section of a recipe (a run's saved ``config.yaml`` used as a recipe), and the resume check never reads it.
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import subprocess
import time
from typing import Any, Optional

import hybridflow

logger = logging.getLogger(__name__)

RUN_INFO_KEY = "run_info"  # the section of config.yaml that holds make_run_info()
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(hybridflow.__file__)))


@functools.lru_cache(maxsize=1)
def git_commit() -> Optional[str]:
    """``git rev-parse HEAD`` of the checkout hybridflow is imported from (the package's parent directory holds a
    ``.git``), or None: an installed package, no ``git`` program, or a command that fails or takes over 5 s."""
    if not os.path.exists(os.path.join(_PACKAGE_PARENT, ".git")):
        return None
    try:
        out = subprocess.run(["git", "-C", _PACKAGE_PARENT, "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        logger.debug("no git commit for %s: %s", _PACKAGE_PARENT, exc)
        return None
    return out or None


def iso_time(seconds: float) -> str:
    """``seconds`` since the epoch as ISO 8601 UTC to the second, e.g. ``2026-12-07T15:47:16Z``."""
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def make_run_info(started_at: Optional[float] = None) -> dict[str, Any]:
    """``{"hybridflow_version", "git_commit" (only from a git checkout), "started_at"}``: the version string,
    the commit hash, and ``started_at`` (seconds since the epoch; default now) in :func:`iso_time`."""
    info: dict[str, Any] = {"hybridflow_version": hybridflow.__version__}
    commit = git_commit()
    if commit:
        info["git_commit"] = commit
    info["started_at"] = iso_time(time.time() if started_at is None else started_at)
    return info


def config_with_run_info(config: Any, info: Optional[dict[str, Any]]) -> Any:
    """``config`` (a ``DictConfig``, dict or dataclass; resolved) as a plain dict with ``info`` under
    :data:`RUN_INFO_KEY` after its sections; ``config`` unchanged when ``info`` is None."""
    if info is None:
        return config
    from omegaconf import OmegaConf

    container = OmegaConf.to_container(OmegaConf.create(config) if not OmegaConf.is_config(config) else config,
                                       resolve=True)
    return {**container, RUN_INFO_KEY: dict(info)}

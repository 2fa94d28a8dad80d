"""``trainer.plugins``: user modules that register into hybridflow's registries (a driver, a policy loss, a reward,
a rollout backend, a tool ...), imported on the driver and in every worker.

Each entry is a module name (importable: on ``PYTHONPATH`` or installed) or the path of a ``.py`` file. The config
loader imports them before it validates anything else (:func:`import_plugins`), so a name registered by a plugin
passes validation and a misspelled plugin fails at once, before Ray starts. The worker groups pass the list to every
rank in the environment variable ``HYBRIDFLOW_PLUGINS`` (:func:`plugin_env`), and
:class:`~hybridflow.controller.Worker` imports them (:func:`import_plugins_from_env`) before the worker's own
constructor runs, so lookups inside the workers find the same names.

A file is imported as the module ``hybridflow_plugin_<stem>`` and its functions and classes are pickled by value,
so they reach processes that cannot import the file by that name.

This module imports nothing from hybridflow except the errors, so every layer may use it.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import sys
from types import ModuleType
from typing import Iterable, Optional

from hybridflow.errors import UserError

logger = logging.getLogger(__name__)

ENV_VAR = "HYBRIDFLOW_PLUGINS"  # JSON list of the plugin entries, set in every worker's environment
FILE_MODULE_PREFIX = "hybridflow_plugin_"


def is_file_plugin(entry: str) -> bool:
    """Whether ``entry`` names a ``.py`` file (else a module name)."""
    return entry.endswith(".py") or os.sep in entry or (os.altsep is not None and os.altsep in entry)


def resolve_plugins(entries: Iterable[str]) -> list[str]:
    """``entries`` with the file paths made absolute (``~`` expanded), so every process finds the same file."""
    return [os.path.abspath(os.path.expanduser(e)) if is_file_plugin(e) else e for e in entries]


def import_plugin(entry: str) -> ModuleType:
    """Import one plugin (module name or ``.py`` path); importing it twice returns the first import.

    Raises:
        UserError: the module or file cannot be found, or importing it raised (one line naming the entry).
    """
    try:
        return _import_file(entry) if is_file_plugin(entry) else importlib.import_module(entry)
    except UserError:
        raise
    except ModuleNotFoundError as exc:
        raise UserError(f"trainer.plugins: cannot import {entry!r}: {exc} (a plugin is a module on PYTHONPATH "
                        "or the path of a .py file)") from None
    except Exception as exc:  # the plugin's own code failed: report it in one line
        raise UserError(f"trainer.plugins: importing {entry!r} failed: {type(exc).__name__}: {exc}") from None


def _import_file(path: str) -> ModuleType:
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise UserError(f"trainer.plugins: {path!r} is not a file")
    name = FILE_MODULE_PREFIX + os.path.splitext(os.path.basename(path))[0].replace("-", "_").replace(".", "_")
    module = sys.modules.get(name)
    if module is not None and os.path.abspath(getattr(module, "__file__", "") or "") == path:
        return module
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UserError(f"trainer.plugins: {path!r} is not an importable Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    _pickle_by_value(module)
    return module


def _pickle_by_value(module: ModuleType) -> None:
    """Let cloudpickle (Ray) send the file module's objects by value: other processes cannot import it by name."""
    try:
        import cloudpickle
    except ImportError:
        try:
            from ray import cloudpickle  # type: ignore[no-redef]
        except ImportError:
            return
    register = getattr(cloudpickle, "register_pickle_by_value", None)
    if register is not None:
        register(module)


def import_plugins(entries: Iterable[str]) -> list[ModuleType]:
    """Import every plugin of ``entries`` in order (see :func:`import_plugin`; raises its ``UserError``)."""
    modules = [import_plugin(entry) for entry in entries]
    if modules:
        logger.debug("imported plugins %s", [m.__name__ for m in modules])
    return modules


def plugin_env(entries: Optional[Iterable[str]]) -> dict[str, str]:
    """The environment that makes a worker import ``entries`` (empty when there are none)."""
    entries = list(entries or [])
    return {ENV_VAR: json.dumps(resolve_plugins(entries))} if entries else {}


def import_plugins_from_env() -> list[ModuleType]:
    """Import the plugins listed in ``$HYBRIDFLOW_PLUGINS`` (nothing when unset); called by every worker."""
    raw = os.environ.get(ENV_VAR)
    return import_plugins(json.loads(raw)) if raw else []

"""Training engines behind one :class:`TrainEngine` contract (docs/concepts/architecture.md, layer 4b), chosen
by a role's ``strategy``.

* :mod:`hybridflow.training.engine_registry`: ``ENGINES`` and :func:`register_engine` (no torch, no Ray);
* :mod:`hybridflow.training.fsdp2_config`, :mod:`hybridflow.training.megatron_config`: each built-in engine's
  registration (lazy: the class is imported by the first :func:`get_engine_class`), its config sub-section
  (``fsdp_config``, ``megatron``), load checks and the abilities the auto-mapper plans within;
* :mod:`hybridflow.training.base`: the contract, its lifecycle, :func:`engine_layout`;
* :mod:`hybridflow.training.fsdp2`: ``fsdp2``, FSDP2 over dp with DTensor tensor parallelism inside;
* :mod:`hybridflow.training.megatron`: ``megatron``, Megatron-core tp x pp x dp (needs the ``megatron`` extra to
  build; registered without it);
* :mod:`hybridflow.training.update`: the mini-batch / micro-batch update loop shared by actor and critics;
* :mod:`hybridflow.training.micro`: micro-batch forward slicing and the loss normalisers;
* :mod:`hybridflow.training.optim`: AdamW and the lr schedule.

Importing the package registers the built-in engines and imports neither torch nor Ray (the config loader and the
auto-mapper read the registry); every other name below is imported on first use (PEP 562).
"""

import importlib
from typing import Any

from hybridflow.training import fsdp2_config, megatron_config  # noqa: F401  (register the built-in engines)
from hybridflow.training.engine_registry import ENGINES, get_engine_class, register_engine, registered_engines

#: name -> the module that defines it, imported at first access
_LAZY = {"KINDS": "base", "EngineSpec": "base", "ParallelLayout": "base", "TrainEngine": "base", "WeightSpec": "base",
         "engine_layout": "base", "FSDP2Engine": "fsdp2", "MegatronEngine": "megatron", "MicroLoss": "update",
         "update_mini_batches": "update"}

__all__ = ["ENGINES", "KINDS", "EngineSpec", "FSDP2Engine", "MegatronEngine", "MicroLoss", "ParallelLayout", "TrainEngine",
           "WeightSpec", "engine_layout", "get_engine_class", "register_engine", "registered_engines", "update_mini_batches"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value

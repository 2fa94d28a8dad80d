"""Training engines behind one :class:`TrainEngine` contract (docs/concepts/architecture.md, layer 4b), chosen
by a role's ``strategy``.

* :mod:`hybridflow.training.base`: the contract, its lifecycle, ``ENGINES`` and :func:`register_engine`;
* :mod:`hybridflow.training.fsdp2`: ``fsdp2``, FSDP2 over dp with DTensor tensor parallelism inside;
* :mod:`hybridflow.training.megatron`: ``megatron``, Megatron-core tp x pp x dp (needs the ``megatron`` extra to
  build; registered without it);
* :mod:`hybridflow.training.update`: the mini-batch / micro-batch update loop shared by actor and critics;
* :mod:`hybridflow.training.micro`: micro-batch forward slicing and the loss normalisers;
* :mod:`hybridflow.training.optim`: AdamW and the lr schedule.
"""

from hybridflow.training.base import (ENGINES, KINDS, EngineSpec, ParallelLayout, TrainEngine, WeightSpec,
                                      engine_layout, get_engine_class, register_engine, registered_engines)
from hybridflow.training.fsdp2 import FSDP2Engine
from hybridflow.training.megatron import MegatronEngine
from hybridflow.training.update import MicroLoss, update_mini_batches

__all__ = ["ENGINES", "KINDS", "EngineSpec", "FSDP2Engine", "MegatronEngine", "MicroLoss", "ParallelLayout", "TrainEngine",
           "WeightSpec", "engine_layout", "get_engine_class", "register_engine", "registered_engines", "update_mini_batches"]

"""Test plugin: a recording rollout backend (``recording``, the hf backend with its own weight copy) and a
recording training engine (``recording_fsdp2``, the fsdp2 engine), both appending every lifecycle call to the
file named by ``$HYBRIDFLOW_TEST_RECORD`` as ``<pid> <event>`` lines (one process per rank, so each pid's lines
are that rank's order). Imported in every process of a run (driver and Ray workers) through ``trainer.plugins``
(tests/workers/test_engine_plugin.py).
"""

from __future__ import annotations

import os
from typing import Iterable

import torch

from hybridflow.rollout import register_rollout
from hybridflow.rollout.hf_rollout import HFRollout
from hybridflow.training import FSDP2Engine, register_engine

RECORD_ENV = "HYBRIDFLOW_TEST_RECORD"


def record(event: str) -> None:
    path = os.environ.get(RECORD_ENV)
    if path:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {event}\n")


@register_rollout("recording")
class RecordingRollout(HFRollout):
    """The hf backend on its own module, recording generate / sleep / wake / load_weights."""

    def generate_sequences(self, prompts):
        record("generate")
        return super().generate_sequences(prompts)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        record("load_weights")
        super().load_weights(weights)

    def sleep(self, level: int = 1) -> None:
        record(f"sleep level={level}")
        super().sleep(level)

    def wake(self) -> None:
        record("wake")
        super().wake()


@register_engine("recording_fsdp2")
class RecordingEngine(FSDP2Engine):
    """fsdp2, recording each build (``build <kind> <role>``) and each training step (``update <role>``: the lr
    schedule advances once per update call), ``offload <role>`` and ``onload <role>``."""

    @classmethod
    def build(cls, spec):
        record(f"build {spec.kind} {spec.role}")
        return super().build(spec)

    def lr_scheduler_step(self) -> float:
        record(f"update {self.spec.role}")
        return super().lr_scheduler_step()

    def offload(self) -> None:
        record(f"offload {self.spec.role}")
        super().offload()

    def onload(self, optimizer: bool = True) -> None:
        record(f"onload {self.spec.role}")
        super().onload(optimizer)

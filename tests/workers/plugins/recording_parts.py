"""Test plugin: a recording rollout backend (``recording``, the hf backend with its own weight copy) and a
recording training engine (``recording_fsdp2``, the fsdp2 engine), both appending every lifecycle call to the
file named by ``$HYBRIDFLOW_TEST_RECORD`` as ``<pid> <event>`` lines (one process per rank, so each pid's lines
are that rank's order). Imported in every process of a run (driver and Ray workers) through ``trainer.plugins``
(tests/workers/test_engine_plugin.py).

Weight streams carry a digest (sha1 over the names and fp32 bytes, in stream order): the rollout's
``load_weights digest=<hex>`` and the engine's ``weights digest=<hex>`` (what ``iter_weights`` streamed: the
rollout sync, or the async driver's push), so a test can match what a rollout loaded with what a trainer sent.
"""

from __future__ import annotations

import hashlib
import os
from typing import Iterable, Iterator

import torch

from hybridflow.rollout import register_rollout
from hybridflow.rollout.hf_rollout import HFRollout
from hybridflow.training import FSDP2Engine, register_engine

RECORD_ENV = "HYBRIDFLOW_TEST_RECORD"


def digest(weights: Iterable[tuple[str, torch.Tensor]], into: "hashlib._Hash") -> Iterator[tuple[str, torch.Tensor]]:
    """Pass ``weights`` through, updating the sha1 ``into`` with each name and its fp32 bytes."""
    for name, tensor in weights:
        into.update(name.encode())
        into.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
        yield name, tensor


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
        sha = hashlib.sha1()
        weights = list(digest(weights, sha))  # every rank consumes the whole stream, as the backend would
        record(f"load_weights digest={sha.hexdigest()}")
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
    schedule advances once per update call), ``offload <role>``, ``onload <role>`` and ``weights digest=<hex>``."""

    @classmethod
    def build(cls, spec):
        record(f"build {spec.kind} {spec.role}")
        return super().build(spec)

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        sha = hashlib.sha1()
        try:
            yield from digest(super().iter_weights(), sha)
        finally:  # also when the consumer stops at the last item (the weight push takes as many as its layout)
            record(f"weights digest={sha.hexdigest()}")

    def lr_scheduler_step(self) -> float:
        record(f"update {self.spec.role}")
        return super().lr_scheduler_step()

    def offload(self) -> None:
        record(f"offload {self.spec.role}")
        super().offload()

    def onload(self, optimizer: bool = True) -> None:
        record(f"onload {self.spec.role}")
        super().onload(optimizer)

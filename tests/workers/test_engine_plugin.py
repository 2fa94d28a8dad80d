"""A second training engine and a recording rollout, registered in a test module, drive real runs of
``hybridflow train``: the engine is chosen by ``strategy=<name>`` for the actor and the critic, and the actor
worker drives the rollout lifecycle generate -> sleep -> update -> wake -> load_weights -> generate every step.

The plugin module (tests/workers/plugins/recording_parts.py) reaches the driver and every Ray worker through
``trainer.plugins`` (a ``.py`` path).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PLUGIN = REPO / "tests" / "workers" / "plugins" / "recording_parts.py"  # imported everywhere via trainer.plugins
STEPS = 2
SMALL = [
    "data.builtin_train_size=16", "data.builtin_val_size=4", "data.train_batch_size=4",
    "data.max_response_length=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "critic.ppo_mini_batch_size=4",
    "critic.ppo_micro_batch_size_per_gpu=2", f"trainer.total_training_steps={STEPS}", "trainer.test_freq=-1",
    "trainer.val_before_train=false", "trainer.logger=[jsonl]", "trainer.plot_curves=false",
    "trainer.n_gpus_per_node=2", "trainer.device=cpu",
    "actor_rollout_ref.rollout.name=recording", "actor_rollout_ref.actor.strategy=recording_fsdp2",
    "critic.strategy=recording_fsdp2",
]


def _train(tmp_path: Path, recipe: str, extra: list[str]) -> dict[int, list[str]]:
    """Run ``hybridflow train`` in a subprocess with the plugin in ``trainer.plugins``; return each process's
    recorded events in order."""
    record = tmp_path / "record.txt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               HYBRIDFLOW_TEST_RECORD=str(record))
    env.pop("RAY_ADDRESS", None)  # a cluster of its own
    cmd = [sys.executable, "-m", "hybridflow", "train", recipe, *SMALL, *extra, f"trainer.plugins=[{PLUGIN}]",
           f"trainer.default_local_dir={tmp_path / 'run'}"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    events: dict[int, list[str]] = defaultdict(list)
    for line in record.read_text().splitlines():
        pid, event = line.split(" ", 1)
        events[int(pid)].append(event)
    return dict(events)


def _handoff(events: list[str]) -> list[str]:
    """The rollout lifecycle and actor updates of one actor rank, consecutive generates (ReMax's greedy pass,
    dynamic sampling) counted once."""
    kept = [e.split(" level=")[0] for e in events
            if e.startswith(("generate", "sleep", "wake", "load_weights", "update actor"))]
    return [e for i, e in enumerate(kept) if not (e == "generate" and i and kept[i - 1] == "generate")]


EXPECTED = (["generate", "sleep", "update actor", "wake", "load_weights"] * STEPS)[:-2]
OFFLOAD = ["actor_rollout_ref.actor.fsdp_config.param_offload=true",
           "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"]


def _check_offload_around_generation(events: list[str]) -> None:
    """With offload set, the actor engine's last offload/onload call before each generate is an offload and
    before each update an onload (on CPU the moves are no-ops, the calls are what is checked)."""
    last = None
    for e in events:
        if e in ("offload actor", "onload actor"):
            last = e
        elif e == "generate":
            assert last == "offload actor", events
        elif e == "update actor":
            assert last == "onload actor", events


@pytest.mark.slow
@pytest.mark.parametrize("recipe,extra,critics", [
    ("quickstart", [], 1),
    ("remax_quickstart", OFFLOAD, 0),
    ("safe_rlhf_quickstart", [], 2),
])
def test_engine_by_strategy_and_rollout_handoff_order(tmp_path, recipe, extra, critics):
    events = _train(tmp_path, recipe, extra)
    actors = {pid: ev for pid, ev in events.items() if "build policy actor" in ev}
    builds = [e for ev in events.values() for e in ev if e == "build value critic"]
    critic_updates = [e for ev in events.values() for e in ev if e == "update critic"]
    assert len(actors) == 2, events  # both actor ranks built the test engine, chosen by actor.strategy
    for pid, ev in actors.items():
        assert _handoff(ev) == EXPECTED, (pid, ev)
        # the rollout holds its own copy, reloaded in full after each update: it sleeps at level 2
        assert all(e == "sleep level=2" for e in ev if e.startswith("sleep"))
        if extra == OFFLOAD:
            _check_offload_around_generation(ev)
    # critic.strategy reached every rank of every critic group (safe_rlhf: reward and cost critics)
    assert len(builds) == 2 * critics
    assert len(critic_updates) == 2 * critics * STEPS

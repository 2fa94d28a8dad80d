"""A second training engine and a recording rollout, registered in a test module, drive real runs of
``hybridflow train``: the engine is chosen by ``strategy=<name>`` for the actor and the critic, and the actor
worker drives the rollout lifecycle generate -> sleep -> update -> wake -> load_weights -> generate every step
(PPO, ReMax, Safe-RLHF); the async driver's generators and trainer keep the order of a LlamaRL-style design
(:func:`test_async_generators_load_each_pushed_version_between_generations`).

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
TINY = [  # a tiny run of any recipe (one actor update per step), with the recording rollout and engine
    "data.builtin_train_size=16", "data.builtin_val_size=4", "data.train_batch_size=4",
    "data.max_response_length=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    f"trainer.total_training_steps={STEPS}", "trainer.val_before_train=false", "trainer.logger=[jsonl]",
    "trainer.plot_curves=false", "trainer.device=cpu",
    "actor_rollout_ref.rollout.name=recording", "actor_rollout_ref.actor.strategy=recording_fsdp2",
]
SMALL = TINY + [
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "critic.ppo_mini_batch_size=4",
    "critic.ppo_micro_batch_size_per_gpu=2", "trainer.test_freq=-1", "trainer.n_gpus_per_node=2",
    "critic.strategy=recording_fsdp2",
]


def _train(tmp_path: Path, recipe: str, extra: list[str], base: list[str] = SMALL) -> dict[int, list[str]]:
    """Run ``hybridflow train`` in a subprocess with the plugin in ``trainer.plugins``; return each process's
    recorded events in order."""
    record = tmp_path / "record.txt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               HYBRIDFLOW_TEST_RECORD=str(record))
    env.pop("RAY_ADDRESS", None)  # a cluster of its own
    cmd = [sys.executable, "-m", "hybridflow", "train", recipe, *base, *extra, f"trainer.plugins=[{PLUGIN}]",
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
    kept = [e.split(" level=")[0].split(" digest=")[0] for e in events
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


def _digest(event: str) -> str:
    return event.split(" digest=")[1]


@pytest.mark.slow
def test_async_generators_load_each_pushed_version_between_generations(tmp_path):
    """The async driver (LlamaRL, arXiv 2505.24034) puts the generators on devices of their own, so the colocated
    handoff (generate -> sleep -> update -> wake -> load_weights) does not apply: a generator never trains, so its
    rollout never sleeps or wakes (there is no training state to make room for), and the trainer (role
    ``actor_ref``) holds no rollout, so it never generates. What holds instead:

    - trainer: ``update``, then the push of the new weights (``weights``: the stream ``send_weights`` broadcasts),
      every step; nothing else of the rollout lifecycle;
    - generator: ``generate`` with the initial checkpoint's weights (version 0), then a pushed version is loaded
      only between two generations (never during one, so a response comes from one version), in push order, and
      each load is exactly the weights the trainer pushed after its update (same digest).

    With max_staleness 1 (queue of 2 requests) the second request is generated by version 0 while the trainer
    trains on the first; the third, submitted after push 1 has arrived, loads version 1 first; validation at the
    last step (on the generators) loads version 2. So the generator sees generate, generate, load_weights(v1),
    generate, load_weights(v2), generate. ``entropy_coeff`` makes every update change the weights (with all-equal
    rewards in a group GRPO's advantages are 0), so the digests tell the versions apart.
    """
    events = _train(tmp_path, "async_grpo_quickstart", [
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", f"trainer.test_freq={STEPS}",
        "actor_rollout_ref.actor.entropy_coeff=0.01"], base=TINY)
    trainers = [ev for ev in events.values() if "build policy actor" in ev]
    generators = [ev for ev in events.values() if "build policy actor" not in ev and "generate" in ev]
    assert len(trainers) == 1 and len(generators) == 1, events  # one rank each (the recipe's pools)
    trainer, generator = trainers[0], generators[0]
    lifecycle = ("generate", "sleep", "wake", "load_weights", "update actor", "weights")
    trainer_order = [e.split(" digest=")[0] for e in trainer if e.startswith(lifecycle)]
    assert trainer_order == ["update actor", "weights"] * STEPS, trainer
    pushed = [_digest(e) for e in trainer if e.startswith("weights")]
    assert len(set(pushed)) == STEPS  # each update changed the weights

    gen_order = [e.split(" digest=")[0] for e in generator if e.startswith(lifecycle)]
    assert gen_order == ["generate", "generate"] + ["load_weights", "generate"] * STEPS, generator
    loaded = [_digest(e) for e in generator if e.startswith("load_weights")]
    assert loaded == pushed  # version k loaded = the trainer's push after its k-th update

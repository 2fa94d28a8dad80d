"""An existing Ray cluster: `ray start --head` on loopback, then `ray job submit` of a 1-step run (the driver
connects through RAY_ADDRESS instead of starting its own cluster). The test stops the cluster it started."""

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from hybridflow.distributed.launch import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _ray() -> str:
    return shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"


def _stop_cluster(temp_dir: str) -> None:
    """Stop only the cluster this test started: every process whose command line names its temp dir
    (`ray stop` would stop every Ray cluster on the machine, including other sessions')."""
    procs = [p for p in psutil.process_iter(["cmdline"]) if temp_dir in " ".join(p.info["cmdline"] or [])]
    for proc in procs:
        proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=20)
    for proc in alive:
        proc.kill()
    shutil.rmtree(temp_dir, ignore_errors=True)


def _start_head(env: dict) -> tuple[str, int]:
    """``ray start --head`` on loopback with every port explicit (another Ray on this machine, e.g. the test
    session's own, holds the defaults); returns (temp dir, dashboard port). A port picked free can be taken before
    Ray binds it, so a failed start is tried once more with new ports; a second failure shows Ray's output."""
    for attempt in (1, 2):
        gcs, dashboard = free_port(), free_port()
        temp_dir = tempfile.mkdtemp(prefix="hfray", dir="/tmp")  # Ray's socket paths must stay short
        start = [_ray(), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}", "--num-cpus=4",
                 "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
                 f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
                 f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
                 f"--temp-dir={temp_dir}", "--disable-usage-stats"]
        proc = subprocess.run(start, env=env, capture_output=True, text=True, timeout=120)
        if proc.returncode == 0:
            return temp_dir, dashboard
        _stop_cluster(temp_dir)
        assert attempt == 1, f"ray start failed twice:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    raise AssertionError("unreachable")


def test_ray_job_submit_to_existing_cluster(tmp_path):
    # token auth on both sides (Ray >= 2.59 enables it for local clusters; the job client must know the mode), with
    # this test's own token: `ray start` does not create one, and a token file an earlier Ray start left in the
    # home directory is not there in a clean CI run (RAY_AUTH_TOKEN_PATH unset: the variable wins)
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_TOKEN_PATH"}
    env.update(RAY_ADDRESS="", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    temp_dir, dashboard = _start_head(env)
    try:
        out = tmp_path / "run"
        submit = [_ray(), "job", "submit", f"--address=http://127.0.0.1:{dashboard}", "--working-dir", str(REPO),
                  "--", "hybridflow", "train", "recipes/quickstart.yaml", "trainer.total_training_steps=1",
                  "trainer.test_freq=-1", "trainer.val_before_train=false", "data.train_batch_size=8",
                  "actor_rollout_ref.actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=4",
                  "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "critic.ppo_micro_batch_size_per_gpu=2",
                  f"trainer.default_local_dir={out}"]
        deadline = time.time() + 120  # the head's job agent comes up a few seconds after `ray start` returns
        while True:
            result = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=300)
            if "No available agent" not in result.stderr + result.stdout or time.time() > deadline:
                break
            time.sleep(2)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert "succeeded" in result.stdout.lower()
        assert "Started a local Ray instance" not in result.stdout  # it joined the existing cluster
        lines = (out / "metrics.jsonl").read_text().splitlines()
        assert len(lines) == 1  # one step is enough to show the job ran its workers on that cluster
    finally:
        _stop_cluster(temp_dir)

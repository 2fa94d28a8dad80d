"""The benchmark scripts report bad input as the CLI does (hybridflow.cli.run_script): a config typo is the
ConfigError message and exit 2, a bad path ``error: ...`` and exit 1, with no traceback; compare_trl checks its
hybridflow overrides before TRL's runs start."""

import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.cli import run_script
from hybridflow.config import ConfigError
from hybridflow.errors import DataError

ROOT = Path(__file__).resolve().parents[2]


def test_run_script_statuses(capsys):
    assert run_script(lambda: None) == 0

    def typo():
        raise ConfigError(["actor_rollout_ref.actr: unknown key"])

    def bad_row():
        raise DataError("no 'prompt' column", row=3)

    assert run_script(typo) == 2 and "actor_rollout_ref.actr" in capsys.readouterr().err
    assert run_script(bad_row) == 1 and capsys.readouterr().err == "error: row 3: no 'prompt' column\n"

    def bug():
        raise KeyError("a bug keeps its traceback")

    with pytest.raises(KeyError):
        run_script(bug)


@pytest.mark.parametrize("script, args", [
    ("benchmarks/step_profile.py", []),
    ("benchmarks/compare_trl.py", ["--skip-trl", "--steps", "2"]),  # fails before any training
])
def test_an_override_typo_is_one_line(script, args):
    done = subprocess.run([sys.executable, script, *args, "actor_rollout_ref.actr.lr=1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "actor_rollout_ref.actr" in done.stderr


@pytest.mark.parametrize("script", ["benchmarks/step_profile.py", "benchmarks/compare_trl.py"])
@pytest.mark.parametrize("model", ["missing-dir", "mediumm", "builtin:nosuch"])
def test_a_bad_model_is_one_line_and_nothing_is_downloaded(tmp_path, script, model):
    model = str(tmp_path / "no-such-model") if model == "missing-dir" else model
    env = {"HF_HUB_OFFLINE": "0", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # a download would be attempted
    extra = ["--skip-trl"] if "compare_trl" in script else []
    done = subprocess.run([sys.executable, script, *extra, "--steps", "2", "--model", model], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and done.stderr.startswith("error: model ") and model in done.stderr
    assert "huggingface.co" not in done.stderr


@pytest.mark.parametrize("argv", [["--steps", "1"], ["--steps", "4", "--warmup", "4"], ["--warmup", "0"]])
def test_step_profile_refuses_runs_that_time_no_step(argv):
    done = subprocess.run([sys.executable, "benchmarks/step_profile.py", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "--steps must exceed --warmup >= 1" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr

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

"""benchmarks/gpu_check.py on a machine (or a process) without a GPU: a clear message and a non-zero status,
before any part runs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


@pytest.mark.parametrize("extra", [[], ["--part", "ppo"]])
def test_without_a_gpu_it_fails_loudly(extra):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # hides any GPU, so this holds on GPU machines too
    result = subprocess.run([sys.executable, str(SCRIPT), *extra], capture_output=True, text=True, env=env,
                            timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith("gpu_check: no GPU: torch.cuda.is_available() is False")
    assert result.stdout == ""  # no JSON that could be mistaken for a result

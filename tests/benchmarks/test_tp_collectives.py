"""benchmarks/tp_collectives.py runs end to end on 2 gloo ranks (few calls; its timings are not asserted)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.distributed.shm_comm import platform_supported

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not platform_supported(), reason="the shared-memory path is used on Linux x86-64 only")
def test_prints_one_json_line_with_both_ways_and_the_load():
    out = subprocess.run([sys.executable, "benchmarks/tp_collectives.py", "--calls", "20", "--rounds", "1"],
                         cwd=REPO, capture_output=True, text=True, timeout=300, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert set(result["median_us_per_call"]) == {"all_reduce_gloo", "all_reduce_shm", "all_gather_gloo",
                                                 "all_gather_shm"}
    assert set(result["ratio_gloo_over_shm"]) == {"all_reduce", "all_gather"}
    assert result["ranks_same_bits"] is True and len(result["load_average_before"]) == 3

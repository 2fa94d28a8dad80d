"""benchmarks/step_profile.py's arithmetic (the script itself trains; not run by the suite)."""

import pytest


def test_padding_fraction_and_phase_flops_by_hand(repo_script):
    module = repo_script("benchmarks/step_profile.py")
    rows = [{"perf/actor_computed_tokens": 100.0, "perf/actor_valid_tokens": 80.0},
            {"perf/actor_computed_tokens": 100.0, "perf/actor_valid_tokens": 70.0}]
    assert module.padding_fraction(rows, "actor") == pytest.approx(0.25)  # 1 - 150 / 200
    assert module.padding_fraction(rows, "critic") is None
    # N = 10 parameters, 4 sequences of 5 valid tokens, 2 epochs; actor padding 0.5 doubles its computed tokens
    flops = module.phase_flops(10, 4, 5.0, 2, {"actor": 0.5, "critic": None})
    assert flops["generate"] == 2 * 10 * 20
    assert flops["old_log_prob"] == flops["reference"] == 2 * 10 * 20 * 2
    assert flops["actor_update"] == 6 * 10 * 20 * 2 * 2
    assert "values" not in flops and "critic_update" not in flops
    # the reference forward run inside the update call: 2N per computed token once more in that phase
    inline = module.phase_flops(10, 4, 5.0, 2, {"actor": 0.5, "critic": None}, ref_in_update=True)
    assert inline["actor_update"] == flops["actor_update"] + 2 * 10 * 20 * 2


def test_matmul_rate_counts_two_flops_per_multiply_add():
    from hybridflow.distributed.precision import matmul_rate

    assert matmul_rate(1, seconds=0.2, size=64) > 2 * 64 ** 3  # at least one 64x64 matmul in a 0.2 s loop

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


def test_each_step_is_measured_against_the_loops_around_it(repo_script):
    from types import SimpleNamespace

    module = repo_script("benchmarks/step_profile.py")
    cfg = SimpleNamespace(data=SimpleNamespace(train_batch_size=2),
                          actor_rollout_ref=SimpleNamespace(rollout=SimpleNamespace(n=2),
                                                            actor=SimpleNamespace(ppo_epochs=1)))
    # N = 10, 4 sequences of 3 + 2 = 5 valid tokens, no padding: the actor update is 6 * 10 * 20 = 1200 FLOPs
    row = {"prompt_length/mean": 3.0, "response_length/mean": 2.0, "perf/actor_computed_tokens": 20.0,
           "perf/actor_valid_tokens": 20.0, "timing_s/update_actor": 2.0}
    rows = [dict(row, step=2), dict(row, step=3, **{"timing_s/update_actor": 4.0})]
    rates = {0: 1.0, 1: 500.0, 2: 700.0, 3: 100.0}  # FLOP/s of the loop before step 1 and after each step
    fractions = module.matmul_fractions(rows, cfg, 10, rates)
    # step 2: 600 FLOP/s against (500 + 700) / 2; step 3: 300 FLOP/s against (700 + 100) / 2
    assert fractions["actor_update"] == pytest.approx([600 / 600, 300 / 400])
    assert set(fractions) == {"actor_update"}  # phases without seconds in the rows are left out

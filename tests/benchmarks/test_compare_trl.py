"""benchmarks/compare_trl.py is not run by the suite (it trains twice and needs the bench extra); this only imports
it (TRL is imported inside its functions) and checks the arithmetic of its summary."""


import pytest


def test_imports_without_trl_and_summarises(repo_script):
    module = repo_script("benchmarks/compare_trl.py")
    assert callable(module.main) and callable(module.run_trl) and callable(module.run_hybridflow)
    summary = module._summary([2.0, 4.0], [60.0, 120.0], [0.5, 1.0])
    # 3 s per step; 90 generated tokens per step / 3 s
    assert summary == {"seconds_per_step": 3.0, "generated_tokens_per_s": 30.0, "mean_reward": 0.75,
                       "timed_steps": 2}
    with pytest.raises(Exception):
        module._summary([], [], [])


def test_thread_counts_and_max_new_tokens_are_parsed(repo_script):
    module = repo_script("benchmarks/compare_trl.py")
    assert module._thread_counts("1,2") == [1, 2]
    for bad in ("0", "a", ""):
        with pytest.raises(Exception):
            module._thread_counts(bad)
    args = module._parser().parse_args(["--model", "medium", "--max-new-tokens", "256", "--trl-threads", "1,2"])
    assert (args.model, args.max_new_tokens, args.trl_threads) == ("medium", 256, [1, 2])
    with pytest.raises(SystemExit):
        module._parser().parse_args(["--max-new-tokens", "257"])


def test_steps_below_two_and_a_missing_bench_extra_stop_with_one_line(repo_script, monkeypatch):
    module = repo_script("benchmarks/compare_trl.py")
    assert module._parser().parse_args(["--steps", "2"]).steps == 2
    for bad in ("1", "0", "x"):
        with pytest.raises(SystemExit):
            module._parser().parse_args(["--steps", bad])
    import importlib.util

    real = importlib.util.find_spec
    # neither is importable, whatever this environment has installed
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("trl", "datasets") else real(name, *a))
    with pytest.raises(SystemExit, match=r"trl, datasets not installed: pip install -e \".\[bench\]\"") as err:
        module._require_trl()
    assert "--skip-trl" in str(err.value)

"""``hybridflow train`` reports user errors (bad data) in one line, exit 1, before Ray starts; bugs keep tracebacks."""

import subprocess
import sys
import types
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridflow.cli import main

REPO = Path(__file__).resolve().parent.parent
# the built-in task's reward; the shipped tiny model's tokenizer splits "1 + 1 = ?" into a handful of tokens
GOOD = {"data_source": "hybridflow/arith", "prompt": [{"role": "user", "content": "1 + 1 = ?"}],
        "reward_model": {"style": "rule", "ground_truth": "2"}}
LONG = {**GOOD, "prompt": [{"role": "user", "content": " + ".join(["1"] * 200)}]}
UNKNOWN = {**GOOD, "data_source": "nobody/registered"}


def _write(path: Path, rows: list[dict], schema: pa.Schema | None = None) -> str:
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return str(path)


def _cases(tmp: Path) -> dict[str, tuple[list[str], list[str]]]:
    """Case -> (overrides, strings the one error line must contain)."""
    good = _write(tmp / "good.parquet", [GOOD] * 4)
    no_column = _write(tmp / "no_column.parquet", [{k: v for k, v in GOOD.items() if k != "reward_model"}] * 4)
    empty = _write(tmp / "empty.parquet", [], schema=pa.Table.from_pylist([GOOD]).schema)
    long = _write(tmp / "long.parquet", [GOOD, GOOD, LONG])
    unknown = _write(tmp / "unknown.parquet", [GOOD, UNKNOWN, GOOD])
    return {
        "missing_column": ([f"data.train_files={no_column}", f"data.val_files={good}"],
                           ["data.train_files", no_column, "'reward_model'"]),
        "empty_file": ([f"data.train_files={good}", f"data.val_files={empty}"],
                       ["data.val_files", empty, "no rows"]),
        "prompt_too_long": ([f"data.train_files={good}", f"data.val_files=[{good},{long}]", "data.truncation=error"],
                            ["data.val_files", long, "row 2", "max_prompt_length=64"]),
        "unknown_data_source": ([f"data.train_files={unknown}", f"data.val_files={good}"],
                                ["data.train_files", unknown, "row 1", "'nobody/registered'", "hybridflow/arith"]),
    }


CASES = ["missing_column", "empty_file", "prompt_too_long", "unknown_data_source"]
SMALL = ["data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "critic.ppo_micro_batch_size_per_gpu=1"]


@pytest.mark.parametrize("case", CASES)
def test_data_error_is_one_line_before_ray_in_process(case, tmp_path, capsys, monkeypatch):
    import hybridflow.trainer.main as train_main

    def no_ray(config):  # another test of the session may have started Ray: check that this run never asks
        raise AssertionError("Ray was started before the data error was reported")

    monkeypatch.setattr(train_main, "init_ray", no_ray)
    overrides, expected = _cases(tmp_path)[case]
    assert main(["train", "quickstart", *SMALL, f"trainer.default_local_dir={tmp_path / 'run'}", *overrides]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    for text in expected:
        assert text in err
    assert not (tmp_path / "run").exists()  # nothing ran: no tracker, no workers


@pytest.mark.slow
def test_data_errors_through_the_cli_are_one_line_without_traceback(tmp_path):
    """The real command line: stderr is exactly the error line (no log records, no traceback), exit status 1."""
    procs = {}
    for case in CASES:  # concurrently: each start-up is mostly importing torch
        (tmp_path / case).mkdir()
        overrides, expected = _cases(tmp_path / case)[case]
        cmd = [sys.executable, "-m", "hybridflow", "train", "quickstart", *SMALL,
               f"trainer.default_local_dir={tmp_path / case / 'run'}", *overrides]
        procs[case] = (subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
                       expected)
    for case, (proc, expected) in procs.items():
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 1, (case, stderr)
        assert "Traceback" not in stderr
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (case, stderr)
        for text in expected:
            assert text in lines[0], (case, text)
        assert not (tmp_path / case / "run").exists()


def test_programming_error_keeps_its_traceback(monkeypatch):
    module = types.ModuleType("hybridflow.trainer.main")

    def run_ppo(config):
        raise RuntimeError("a bug")

    module.run_ppo = run_ppo
    monkeypatch.setitem(sys.modules, "hybridflow.trainer.main", module)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["train", "quickstart"])


def _no_ray(monkeypatch) -> None:
    import hybridflow.trainer.main as train_main

    def no_ray(config):
        raise AssertionError("Ray was started before the user error was reported")

    monkeypatch.setattr(train_main, "init_ray", no_ray)


def _one_error_line(capsys, *args: str) -> str:
    assert main(["train", "quickstart", *SMALL, *args]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


def test_a_file_that_is_not_parquet_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
    _no_ray(monkeypatch)
    garbage = tmp_path / "garbage.parquet"
    garbage.write_text("not parquet at all\n")
    err = _one_error_line(capsys, f"data.train_files={garbage}", f"trainer.default_local_dir={tmp_path / 'run'}")
    assert "data.train_files" in err and str(garbage) in err and "not a readable parquet file" in err


def test_a_directory_that_is_not_a_model_is_one_line_naming_the_key(tmp_path, capsys, monkeypatch):
    _no_ray(monkeypatch)
    (tmp_path / "notes.txt").write_text("no model here\n")
    err = _one_error_line(capsys, f"actor_rollout_ref.model.path={tmp_path}", f"trainer.default_local_dir={tmp_path / 'run'}")
    assert "actor_rollout_ref.model.path" in err and str(tmp_path) in err and "no loadable tokenizer" in err


def test_a_run_directory_that_is_a_file_is_one_line_before_ray(tmp_path, capsys, monkeypatch):
    _no_ray(monkeypatch)
    afile = tmp_path / "afile"
    afile.write_text("x")
    err = _one_error_line(capsys, f"trainer.default_local_dir={afile}")
    assert f"trainer.default_local_dir={afile}" in err and "cannot create the run directory" in err


def test_device_cuda_without_a_gpu_is_one_line_before_ray(tmp_path, capsys, monkeypatch):
    import torch

    if torch.cuda.device_count():
        pytest.skip("this machine has a GPU")
    _no_ray(monkeypatch)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    err = _one_error_line(capsys, "trainer.device=cuda", f"trainer.default_local_dir={tmp_path / 'run'}")
    assert "trainer.device=cuda" in err and "no GPU" in err


def test_a_run_that_fails_to_start_leaves_the_previous_metrics_in_place(tmp_path, capsys, monkeypatch):
    """metrics.jsonl of a previous run is set aside only once the workers are up, not by a run that never starts."""
    import hybridflow.trainer.main as train_main
    from hybridflow.errors import UserError

    def ray_fails(config):
        raise UserError("the cluster could not be reached")

    monkeypatch.setattr(train_main, "init_ray", ray_fails)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "x": 1.0}\n')
    _one_error_line(capsys, f"trainer.default_local_dir={run}")
    assert (run / "metrics.jsonl").read_text() == '{"step": 1, "x": 1.0}\n'
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]


def test_a_run_directory_held_by_a_live_run_is_one_line_naming_it_before_ray(tmp_path, capsys, monkeypatch):
    """A second run into a live run's directory is refused (exit 1, one line naming the holder's pid and the lock
    file) before Ray starts, and leaves the live run's files as they are."""
    import fcntl
    import json
    import os

    _no_ray(monkeypatch)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "x": 1.0}\n')
    lock = run / "run.lock"
    holder = os.open(lock, os.O_RDWR | os.O_CREAT)  # the live run: this process, through another open file
    body = json.dumps({"pid": os.getpid(), "host": "h", "started": "2026-01-02T03:04:05+00:00", "command": "c"})
    try:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(holder, body.encode())
        err = _one_error_line(capsys, f"trainer.default_local_dir={run}")
    finally:
        os.close(holder)
    assert f"pid {os.getpid()} on host h (started 2026-01-02T03:04:05+00:00" in err and f"lock file {lock}" in err
    assert (run / "metrics.jsonl").read_text() == '{"step": 1, "x": 1.0}\n' and lock.read_text() == body


FAILING_DRIVER = '''\
from hybridflow.trainer.driver import Driver, register_driver
from hybridflow.trainer.ppo import common_roles


def check(groups):
    return groups["actor"]


@register_driver("failing_driver")
class FailingDriver(Driver):
    ROLES = ("actor", "reward", "reward_model")

    @classmethod
    def roles(cls, config):
        return common_roles(config)

    @classmethod
    def build(cls, config, groups):
        return cls(check(groups))
'''


def test_a_user_driver_raising_on_the_driver_is_one_line_and_its_frames(tmp_path, capsys, monkeypatch):
    """A driver plugin (the user's file) that raises in the driver process: ``error: driver '<name>': ...`` and the
    user's frames, exit 1 (the worker groups are stubbed: the error comes from building the driver)."""
    import contextlib

    import hybridflow.trainer.main as train_main
    from hybridflow.trainer.driver import DRIVERS, _ORDER

    plugin = tmp_path / "failing_driver.py"
    plugin.write_text(FAILING_DRIVER)
    monkeypatch.setattr(train_main, "init_ray", lambda config: False)
    monkeypatch.setattr(train_main, "worker_groups", lambda config, total: contextlib.nullcontext({}))
    try:
        assert main(["train", "quickstart", *SMALL, f"trainer.plugins=[{plugin}]", "algorithm.driver=failing_driver",
                     "trainer.logger=[jsonl]", f"trainer.default_local_dir={tmp_path / 'run'}"]) == 1
    finally:
        if "failing_driver" in DRIVERS:
            DRIVERS.unregister("failing_driver")
            _ORDER.remove("failing_driver")
    assert capsys.readouterr().err.splitlines() == [
        "error: driver 'failing_driver': KeyError: 'actor'",
        f"  {plugin}:19 in build", "    return cls(check(groups))",
        f"  {plugin}:6 in check", '    return groups["actor"]']


def test_prompt_and_response_longer_than_the_models_positions_is_one_line_before_ray(tmp_path, capsys, monkeypatch):
    """480 + 64 = 544 positions asked of the shipped tiny model, whose config.json allows 256."""
    _no_ray(monkeypatch)
    err = _one_error_line(capsys, "data.max_prompt_length=480", "data.max_response_length=64",
                          f"trainer.default_local_dir={tmp_path / 'run'}")
    for text in ("data.max_prompt_length", "data.max_response_length", "480 + 64 = 544",
                 "max_position_embeddings=256", "actor_rollout_ref.model.path=builtin:tiny-arith"):
        assert text in err, text
    assert not (tmp_path / "run").exists()


def test_check_positions_reads_each_models_limit_and_its_rope_factor(tmp_path):
    from transformers import LlamaConfig

    from hybridflow.config import load_config
    from hybridflow.errors import UserError
    from hybridflow.trainer.setup import check_positions

    # a critic of its own with 128 positions: 64 + 96 = 160 fits the actor's 256 but not the critic's 128 ...
    LlamaConfig(max_position_embeddings=128).save_pretrained(tmp_path / "critic")
    lengths = ["data.max_prompt_length=64", "data.max_response_length=96"]
    critic = ["critic.enable=true", f"critic.model.path={tmp_path / 'critic'}"]
    with pytest.raises(UserError, match=r"64 \+ 96 = 160 exceeds the model's max_position_embeddings=128 "
                                        rf"\(critic.model.path={tmp_path / 'critic'}"):
        check_positions(load_config("quickstart", lengths + critic))
    check_positions(load_config("quickstart", ["data.max_prompt_length=64", "data.max_response_length=64"] + critic))
    # ... and 128 x a rope scaling factor of 2 = 256 positions fit 160
    LlamaConfig(max_position_embeddings=128, rope_scaling={"rope_type": "linear", "factor": 2.0}).save_pretrained(
        tmp_path / "critic")
    check_positions(load_config("quickstart", lengths + critic))
    check_positions(load_config("quickstart", ["data.max_prompt_length=200", "data.max_response_length=56"]))  # 256

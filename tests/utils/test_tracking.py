"""Tracking: metrics.jsonl lines, the one-line console summary, scalar conversion, backend names."""

import importlib.util
import json
import os

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from hybridflow.utils.tracking import Tracking, format_console_line, set_metrics_aside, trim_metrics


def _read_jsonl(path):
    """The rows without a wall-clock ``timestamp`` (checked in test_rows_and_config_record_when_and_what_ran)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:
        row.pop("timestamp", None)
    return rows


def test_jsonl_lines_have_step_and_float_metrics(tmp_path):
    tracker = Tracking("p", "e", tmp_path / "run", backends=("jsonl",))
    tracker.log({"a": 0.25, "b": 3, "flag": True}, step=1)
    # Flushed per call: readable before finish().
    assert _read_jsonl(tmp_path / "run" / "metrics.jsonl") == [{"step": 1, "a": 0.25, "b": 3.0, "flag": 1.0}]
    tracker.log({"np32": np.float32(0.5), "np0d": np.array(1.5), "np1": np.array([2.5]),
                 "int64": np.int64(7), "tensor": torch.tensor(0.75), "tensor1": torch.tensor([1.25])}, step=2)
    tracker.finish()
    tracker.finish()
    lines = _read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert lines[1] == {"step": 2, "np32": 0.5, "np0d": 1.5, "np1": 2.5, "int64": 7.0, "tensor": 0.75, "tensor1": 1.25}
    assert all(type(v) is float for v in lines[1].values() if v != 2)


def test_jsonl_appends_across_runs_and_saves_config_once(tmp_path):
    config = OmegaConf.create({"trainer": {"project_name": "p", "default_local_dir": "out/${trainer.project_name}"}})
    for step in (1, 2):
        tracker = Tracking("p", "e", tmp_path, config=config)
        tracker.log({"x": float(step)}, step=step)
        tracker.finish()
    assert [line["step"] for line in _read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]
    saved = OmegaConf.load(tmp_path / "config.yaml")
    assert saved.trainer.default_local_dir == "out/p"  # resolved when saved


def test_console_line_has_the_well_known_fields(tmp_path, capsys):
    tracker = Tracking("p", "e", tmp_path / "run", backends=("console",))
    tracker.log({
        "critic/rewards/mean": 0.41, "critic/score/mean": 0.5, "rollout/kl": 0.003, "actor/entropy": 0.85,
        "response_length/mean": 14.2, "val/score": 0.62, "timing_s/step": 3.14, "perf/throughput": 812.4,
        "actor/pg_loss": 0.1,
    }, step=12)
    out = capsys.readouterr().out
    expected = "step 12 | reward 0.41 | kl 0.003 | entropy 0.85 | resp_len 14.2 | val/score 0.62 | 3.1s | 812 tok/s"
    assert out == expected + "\n"
    assert not (tmp_path / "run").exists()  # the console backend writes no files


def test_console_line_falls_back_to_score_and_omits_absent_fields():
    assert format_console_line({"critic/score/mean": 0.5, "val/score/arith": 1.0}, step=3) == (
        "step 3 | reward 0.5 | val/score/arith 1")
    assert format_console_line({}, step=0) == "step 0"
    assert format_console_line({"response_length/mean": 1234.4}, step=1) == "step 1 | resp_len 1234"


def test_console_line_of_40_metrics_keeps_the_fixed_fields_within_200_characters():
    metrics = {"critic/score/mean": 0.5, "rollout/kl": 0.003, "actor/entropy": 0.85, "response_length/mean": 14.2,
               "val/score": 0.62, "timing_s/step": 3.14, "perf/throughput": 812.4}
    metrics.update({f"actor/loss_{i}": 0.1 for i in range(13)})  # training metrics: never on the line
    metrics.update({f"val/score/source_{i:02d}": 0.25 for i in range(20)})  # 20 x 25 characters: not all fit
    assert len(metrics) == 40
    line = format_console_line(metrics, step=7)
    assert len(line) <= 200, line
    assert line.startswith("step 7 | reward 0.5 | kl 0.003 | entropy 0.85 | resp_len 14.2 | val/score 0.62 | ")
    fields = line.split(" | ")
    shown = [f for f in fields if f.startswith("val/score/source_")]
    assert shown == [f"val/score/source_{i:02d} 0.25" for i in range(len(shown))] and 0 < len(shown) < 20
    assert fields[-3:] == ["3.1s", "812 tok/s", f"+{20 - len(shown)} val/ metrics"]
    assert "actor/loss" not in line
    # one more source would not fit: the line is as full as the cap allows
    assert len(line) + len(" | val/score/source_xx 0.25") > 200


def test_unknown_backend_lists_known_ones(tmp_path):
    known = "known: console, jsonl, tensorboard, wandb, mlflow, swanlab"
    with pytest.raises(ValueError, match=rf"unknown tracking backend\(s\) \['wandbb'\]; {known}"):
        Tracking("p", "e", tmp_path, backends=("console", "wandbb"))


@pytest.mark.parametrize("value,message", [
    (np.array([1.0, 2.0]), r"metric 'm' must be a scalar, got an array of shape \(2,\)"),
    (torch.ones(2, 2), r"metric 'm' must be a scalar, got an array of shape \(2, 2\)"),
    ("high", r"metric 'm' must be a number, got str: 'high'"),
])
def test_non_scalar_metrics_are_refused(tmp_path, value, message):
    tracker = Tracking("p", "e", tmp_path, backends=("console",))
    with pytest.raises(TypeError, match=message):
        tracker.log({"m": value}, step=1)


def test_step_is_a_reserved_metric_name(tmp_path):
    with pytest.raises(ValueError, match="'step' is reserved"):
        Tracking("p", "e", tmp_path, backends=("console",)).log({"step": 1.0}, step=1)


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None, reason="tensorboard installed")
def test_tensorboard_without_the_package_says_how_to_install(tmp_path):
    with pytest.raises(ImportError, match="pip install tensorboard"):  # torch's SummaryWriter needs it
        Tracking("p", "e", tmp_path, backends=("tensorboard",))


def _write_rows(path, steps, tail=""):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"step": s, "m": float(s)}) + "\n" for s in steps) + tail)


def test_trim_metrics_drops_the_rows_after_the_resumed_checkpoint(tmp_path):
    # an interrupted run logged steps 0 (validation) .. 5 and had half-written step 6; its checkpoint is at step 4
    path = tmp_path / "metrics.jsonl"
    _write_rows(path, [0, 1, 2, 3, 4, 5], tail='{"step": 6, "m": ')
    assert trim_metrics(tmp_path, 4) == 2
    assert [r["step"] for r in _read_jsonl(path)] == [0, 1, 2, 3, 4]
    assert trim_metrics(tmp_path, 4) == 0  # nothing more to drop
    # the resumed run appends 5, 6: exactly one row per step
    tracker = Tracking("p", "e", tmp_path, backends=("jsonl",))
    for step in (5, 6):
        tracker.log({"m": float(step)}, step=step)
    tracker.finish()
    assert [r["step"] for r in _read_jsonl(path)] == [0, 1, 2, 3, 4, 5, 6]
    assert trim_metrics(tmp_path / "nowhere", 3) == 0


def test_trim_metrics_ends_a_last_row_that_lost_its_newline(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write_rows(path, [1], tail='{"step": 2, "m": 2.0}')
    assert trim_metrics(tmp_path, 2) == 0
    assert path.read_text().endswith("\n") and [r["step"] for r in _read_jsonl(path)] == [1, 2]


def test_set_metrics_aside_moves_a_previous_runs_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert set_metrics_aside(tmp_path) is None  # no file: nothing to do
    _write_rows(path, [1, 2])
    os.utime(path, (0, 86400 + 3661))  # last written 1970-01-02 01:01:01 UTC
    moved = set_metrics_aside(tmp_path)
    assert moved == tmp_path / "metrics.19700102-010101.jsonl" and not path.exists()
    assert [r["step"] for r in _read_jsonl(moved)] == [1, 2]
    _write_rows(path, [1])
    os.utime(path, (0, 86400 + 3661))
    assert set_metrics_aside(tmp_path) == tmp_path / "metrics.19700102-010101-1.jsonl"  # never overwrites


def test_rows_and_config_record_when_and_what_ran(tmp_path):
    """Each metrics.jsonl row has the wall-clock time it was logged at; config.yaml has a run_info section (the
    package's version, the checkout's commit from git itself, the start) after the config's own sections."""
    import subprocess
    import time

    import hybridflow
    from hybridflow.utils.plot import read_metrics

    before = time.time()
    tracker = Tracking("p", "e", tmp_path, backends=("jsonl",), config={"trainer": {"seed": 1}})
    tracker.log({"x": 1.0}, step=1)
    tracker.log({"x": 2.0}, step=2)
    tracker.finish()
    after = time.time()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    stamps = [row["timestamp"] for row in rows]
    assert before - 0.001 <= stamps[0] <= stamps[1] <= after + 0.001
    assert read_metrics(tmp_path) == {"x": [(1, 1.0), (2, 2.0)]}  # hybridflow plot: the timestamp is no curve
    with pytest.raises(ValueError, match="'timestamp' is reserved"):
        Tracking("p", "e", tmp_path / "other", backends=("jsonl",)).log({"timestamp": 1.0}, step=1)

    saved = OmegaConf.to_container(OmegaConf.load(tmp_path / "config.yaml"))
    assert list(saved) == ["trainer", "run_info"] and saved["trainer"] == {"seed": 1}
    info = saved["run_info"]
    assert info["hybridflow_version"] == hybridflow.__version__
    repo = os.path.dirname(os.path.dirname(hybridflow.__file__))
    if os.path.exists(os.path.join(repo, ".git")):  # a checkout: the commit git reports there
        head = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
        assert info["git_commit"] == head.strip() and len(head.strip()) == 40
    else:
        assert "git_commit" not in info
    started = time.mktime(time.strptime(info["started_at"], "%Y-%m-%dT%H:%M:%SZ")) - time.timezone
    assert int(before) - 1 <= started <= after + 1


def test_git_commit_is_omitted_outside_a_checkout(tmp_path, monkeypatch):
    from hybridflow.utils import provenance

    monkeypatch.setattr(provenance, "_PACKAGE_PARENT", str(tmp_path))  # as an installed package: no .git there
    provenance.git_commit.cache_clear()
    try:
        assert set(provenance.make_run_info(0.0)) == {"hybridflow_version", "started_at"}
        assert provenance.make_run_info(0.0)["started_at"] == "1970-01-01T00:00:00Z"
    finally:
        provenance.git_commit.cache_clear()

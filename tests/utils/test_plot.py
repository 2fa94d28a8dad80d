"""hybridflow plot: panels present in the metrics, one axis per requested metric, several runs with a legend."""

import json

import pytest
from PIL import Image

from hybridflow.cli import main
from hybridflow.utils.plot import plot_runs, read_metrics, write_run_curves


def _write_run(run_dir, rows):
    run_dir.mkdir(parents=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return run_dir


def _ppo_rows(offset=0.0):
    """Validation at step 0 and 2 (own rows, as the trainer logs them), three training steps."""
    rows = [{"step": 0, "val/score": 0.1 + offset}]
    for step in (1, 2, 3):
        rows.append({"step": step, "critic/score/mean": 0.2 * step + offset, "critic/rewards/mean": 0.2 * step,
                     "rollout/kl": 0.01 * step, "actor/entropy": 1.0 / step, "response_length/mean": 10.0 + step,
                     "timing_s/step": 2.0, "perf/throughput": 500.0, "actor/pg_loss": 0.3})
    rows.append({"step": 2, "val/score": 0.4 + offset})
    return rows


def test_standard_panels_of_a_ppo_run(tmp_path):
    run = _write_run(tmp_path / "run", _ppo_rows())
    out = tmp_path / "pics" / "curves.png"
    fig = plot_runs([run], out=out)
    assert [ax.get_title() for ax in fig.axes] == [
        "score / reward", "KL(actor || reference)", "entropy (nats / token)", "response length (tokens)",
        "step time (s)", "throughput (tokens / s)"]  # no Safe-RLHF or async panels: their metrics are absent
    # 6 panels -> 3 columns x 2 rows of 5.0 x 3.4 inches at 100 dpi
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size == (1500, 680)
    score_ax = fig.axes[0]
    lines = {line.get_label(): line for line in score_ax.get_lines()}
    assert sorted(lines) == ["critic/rewards/mean", "critic/score/mean", "val/score"]
    assert list(lines["critic/score/mean"].get_xdata()) == [1, 2, 3]
    assert list(lines["critic/score/mean"].get_ydata()) == pytest.approx([0.2, 0.4, 0.6])
    assert list(lines["val/score"].get_xdata()) == [0, 2]  # the validation points at the steps they ran
    assert lines["val/score"].get_marker() == "o"
    assert len({line.get_color() for line in lines.values()}) == 3  # one run: a colour per metric


def test_one_axis_per_requested_metric(tmp_path):
    run = _write_run(tmp_path / "run", _ppo_rows())
    fig = plot_runs([run], metrics=["actor/pg_loss", "rollout/kl", "val/score"])
    assert [ax.get_title() for ax in fig.axes] == ["actor/pg_loss", "rollout/kl", "val/score"]
    assert list(fig.axes[1].get_lines()[0].get_ydata()) == pytest.approx([0.01, 0.02, 0.03])


def test_several_runs_share_the_panels_with_a_legend(tmp_path):
    run_a = _write_run(tmp_path / "grpo", _ppo_rows())
    run_b = _write_run(tmp_path / "ppo", _ppo_rows(offset=0.05))
    fig = plot_runs([run_a, run_b], metrics=["critic/score/mean"])
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["grpo", "ppo"]
    assert [line.get_color() for line in ax.get_lines()] == ["C0", "C1"]
    fig = plot_runs([run_a, run_b])
    assert "grpo: critic/score/mean" in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]


def test_safe_rlhf_and_async_panels_when_their_metrics_exist(tmp_path):
    rows = [{"step": s, "critic/score/mean": 0.1, "cost/score/mean": 0.5 - 0.1 * s, "lagrange/lambda": 0.1 * s,
             "async/staleness_mean": 0.5, "async/staleness_max": 1.0} for s in (1, 2)]
    fig = plot_runs([_write_run(tmp_path / "run", rows)])
    assert [ax.get_title() for ax in fig.axes] == [
        "score / reward", "Safe-RLHF cost", "Safe-RLHF lambda", "async staleness (policy versions)"]


def test_a_repeated_step_keeps_its_last_value_and_non_finite_values_are_dropped(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text(
        '{"step": 1, "x": 1.0}\n{"step": 2, "x": NaN}\n{"step": 1, "x": 3.0}\n\n{"step": 3, "x": 4.0}\n')
    assert read_metrics(tmp_path / "run") == {"x": [(1, 3.0), (3, 4.0)]}


def test_errors_name_the_problem(tmp_path):
    run = _write_run(tmp_path / "run", _ppo_rows())
    with pytest.raises(ValueError, match=r"no run has 'rollout/kll' \(close: rollout/kl\)"):
        plot_runs([run], metrics=["rollout/kll"])
    with pytest.raises(FileNotFoundError, match="metrics.jsonl not found"):
        plot_runs([tmp_path])
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text('{"x": 1}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:1: not a metrics line with a step"):
        read_metrics(tmp_path / "bad")


def test_cli_plot(tmp_path, capsys):
    run = _write_run(tmp_path / "run", _ppo_rows())
    assert main(["plot", str(run)]) == 0
    assert capsys.readouterr().out.strip() == str(run / "curves.png")
    assert (run / "curves.png").stat().st_size > 0
    other = _write_run(tmp_path / "other", _ppo_rows())
    out = tmp_path / "both.png"
    assert main(["plot", str(run), str(other), "--metrics", "rollout/kl", "--out", str(out)]) == 0
    with Image.open(out) as image:
        assert image.size == (500, 340)  # one panel
    assert main(["plot", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err
    assert "metrics.jsonl not found" in err and f"there is no directory {tmp_path / 'missing'} " in err


@pytest.mark.parametrize("metrics_file", ["empty", "blank_lines", "missing"])
def test_cli_plot_of_a_run_without_steps_is_one_line_naming_the_file(tmp_path, capsys, metrics_file):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("trainer: {}\n")  # a run that started and has logged no step
    if metrics_file != "missing":
        (run / "metrics.jsonl").write_text("" if metrics_file == "empty" else "\n  \n")
    assert main(["plot", str(run)]) == 1
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and out.err.startswith("error: "), out.err
    assert f"{run / 'metrics.jsonl'} " in out.err and "has logged no step yet" in out.err
    assert not (run / "curves.png").exists()


def test_run_end_curves(tmp_path):
    run = _write_run(tmp_path / "run", _ppo_rows())
    assert write_run_curves(run) == run / "curves.png" and (run / "curves.png").is_file()
    assert write_run_curves(tmp_path / "no_jsonl") is None  # logger without jsonl: nothing to draw, no error
    assert write_run_curves(_write_run(tmp_path / "odd", [{"step": 1, "mine": 1.0}])) is None

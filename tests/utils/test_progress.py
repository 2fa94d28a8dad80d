"""Progress: a tqdm bar with count and ETA on a terminal; plain log lines without control characters elsewhere."""

import io
import logging
import sys


from hybridflow.utils.progress import Progress, write_line
from hybridflow.utils.tracking import RunProgress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Recorder:
    """A tracker that keeps what it is given."""

    def __init__(self):
        self.logged, self.finished = [], False

    def log(self, data, step):
        self.logged.append((step, dict(data)))

    def finish(self):
        self.finished = True


def test_on_a_terminal_a_bar_with_count_and_eta(monkeypatch):
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    with Progress("validation (greedy)", 3, "prompts") as progress:
        for _ in range(3):
            progress.update(1, postfix={"score": 0.5})
    out = term.getvalue()
    assert "\r" in out  # redrawn in place
    assert "validation (greedy)" in out and "3/3" in out and "score=0.5" in out
    assert "<" in out  # tqdm's "elapsed<remaining" (the ETA)


def test_off_a_terminal_plain_lines_with_eta(monkeypatch, caplog):
    piped = io.StringIO()
    monkeypatch.setattr(sys, "stderr", piped)
    clock = iter([0.0, 10.0, 12.0, 20.0, 40.0, 41.0, 50.0, 51.0]).__next__
    monkeypatch.setattr("hybridflow.utils.progress.time.monotonic", clock)
    with caplog.at_level(logging.INFO, logger="hybridflow.utils.progress"):
        progress = Progress("eval (greedy, mean@1)", 4, "prompts", interval_s=30.0)  # starts at t=0
        progress.update(1)  # t=10: first update -> a line; ETA 10 s/prompt x 3 left = 30 s
        progress.update(1)  # t=20: < 30 s since the last line -> none
        progress.update(1)  # t=40: 30 s since the last line -> a line
        progress.update(1)  # t=50: the end -> a line
        progress.close()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["eval (greedy, mean@1): 1/4 prompts (25%), 00:12 elapsed, ETA 00:36",
                     "eval (greedy, mean@1): 3/4 prompts (75%), 00:41 elapsed, ETA 00:13",
                     "eval (greedy, mean@1): 4/4 prompts (100%), 00:51 elapsed, ETA 00:00"]
    assert piped.getvalue() == ""  # no bar drawn


def test_run_progress_forwards_to_the_tracker_and_shows_the_step(monkeypatch):
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    tracker = Recorder()
    run = RunProgress(tracker, total=2)
    run.log({"val/score": 0.25}, step=0)
    run.log({"critic/score/mean": 0.5}, step=1)
    run.log({"critic/score/mean": 0.75, "val/score": 1.0}, step=2)
    run.finish()
    assert [s for s, _ in tracker.logged] == [0, 1, 2] and tracker.finished
    assert run.last_step == 2
    out = term.getvalue()
    assert "train" in out and "2/2" in out and "reward=0.75" in out and "val/score=1" in out


def test_write_line_goes_above_an_open_bar(monkeypatch):
    term, stdout = Terminal(), Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    monkeypatch.setattr(sys, "stdout", stdout)
    with Progress("train", 2, "steps") as progress:
        progress.update(1)
        write_line("step 1 | reward 0.5")
    assert stdout.getvalue().endswith("step 1 | reward 0.5\n")

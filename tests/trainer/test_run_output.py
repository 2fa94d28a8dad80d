"""What a user sees from ``hybridflow train``: piped output is plain lines (no carriage returns or ANSI codes) that
say what each long phase does; on a terminal a bar shows ``step N/total``, and Ctrl-C there prints one line (last
step, latest checkpoint, resume command), exits with 130 and leaves no process of the run behind."""

import fcntl
import os
import pty
import re
import signal
import struct
import sys
import termios
import threading
import time
from pathlib import Path

import psutil
import pytest

from hybridflow.trainer.checkpoint import CheckpointManager, load_trainer_state

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SMALL = ["data.train_batch_size=8", "data.builtin_val_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
         "critic.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
         "critic.ppo_micro_batch_size_per_gpu=2"]


def test_piped_output_is_plain_lines_naming_each_phase(quickstart_run):
    """The shared quickstart run's output (tests/helpers/quickstart_run.py: ``python -m hybridflow train
    quickstart`` for 2 steps, validation at 0 and 2, a checkpoint at 2, stdout and stderr piped to a file)."""
    text = quickstart_run.output
    assert quickstart_run.returncode == 0, text[-3000:]
    assert "\r" not in text and "\x1b" not in text
    assert "Token authentication" not in text  # the run's own loopback cluster starts without Ray's token warning
    for phase in ("starting worker groups: actor", "worker group actor up", "validation (greedy): 8 prompts",
                  "validation (greedy): 8/8 prompts (100%)", "saving the checkpoint of step 2",
                  "train: 2/2 steps (100%)"):
        assert phase in text, phase
    assert re.search(r"^step 2 \| reward", text, re.MULTILINE)  # the per-step line is still there
    step_lines = re.findall(r"^step \d+ \|.*$", text, re.MULTILINE)
    assert len(step_lines) == 3 and max(map(len, step_lines)) <= 200, step_lines  # steps 0 (validation), 1, 2
    # the run's last log record says where its weights are: the checkpoint of its last step
    records = re.findall(r"^\S+ \S+ (?:INFO|WARNING) hybridflow\S*: (.*)$", text, re.MULTILINE)
    assert records[-1].startswith(f"latest checkpoint: {quickstart_run.run_dir / 'global_step_2'} "), records[-3:]


def _reader(fd: int, chunks: list[bytes]) -> None:
    while True:
        try:
            data = os.read(fd, 4096)
        except OSError:
            return
        if not data:
            return
        chunks.append(data)


def test_ctrl_c_on_a_terminal(tmp_path):
    out = tmp_path / "run"
    argv = ["hybridflow", "train", "quickstart", "trainer.total_training_steps=50", "trainer.save_freq=1",
            "trainer.test_freq=-1", "trainer.val_before_train=false", *SMALL, f"trainer.default_local_dir={out}"]
    pid, fd = pty.fork()  # the child runs on a new terminal, as its foreground process group
    if pid == 0:
        os.chdir(REPO)
        # as from an interactive shell: a suite started in the background (`cmd &` without job control) inherits
        # SIGINT ignored, and Python then installs no KeyboardInterrupt handler
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.execv(sys.executable, [sys.executable, "-m", *argv])
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    chunks: list[bytes] = []
    threading.Thread(target=_reader, args=(fd, chunks), daemon=True).start()
    try:
        deadline = time.time() + 600
        while not (out / "global_step_1" / "trainer_state.pt").exists():
            assert time.time() < deadline, b"".join(chunks).decode(errors="replace")[-3000:]
            time.sleep(0.5)
        run_tree = psutil.Process(pid).children(recursive=True)
        os.write(fd, b"\x03")  # Ctrl-C: the terminal sends SIGINT to the whole foreground process group
        deadline = time.time() + 180
        while (status := os.waitpid(pid, os.WNOHANG))[0] == 0:
            assert time.time() < deadline, "no exit within 180 s of Ctrl-C"
            time.sleep(0.5)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    time.sleep(1)  # the reader drains what is left
    text = b"".join(chunks).decode(errors="replace")
    assert os.waitstatus_to_exitcode(status[1]) == 130, text[-3000:]
    assert "Traceback" not in text, text[-5000:]
    assert re.search(r"train: .*\b[1-9]\d*/50\b", text), text[-3000:]  # the run's bar: step N/total
    latest = CheckpointManager(str(out)).latest()
    step = load_trainer_state(latest)["global_step"]
    lines = [line for line in text.splitlines() if line.startswith("interrupted after step")]
    assert len(lines) == 1, text[-3000:]
    assert f"latest complete checkpoint: {latest};" in lines[0]
    # the last logged step: the checkpoint's, or one less when Ctrl-C came between its save and its metrics row
    assert re.match(r"interrupted after step (\d+)/50", lines[0]).group(1) in (str(step - 1), str(step))
    assert lines[0].endswith("resume with: " + " ".join(argv))
    # nothing of the run is left: Ray's processes exit within seconds of the driver
    deadline = time.time() + 30
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in run_tree) and time.time() < deadline:
        time.sleep(0.5)
    assert not [p.pid for p in run_tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

"""The run directory's lock: a live run refuses a second one (naming its pid, host, start time and lock file), a
stale lock is taken over, and the lock is released on every exit of the ``with`` block."""

import fcntl
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.errors import UserError
from hybridflow.trainer.run_lock import LOCK_FILE, RunDirInUseError, run_dir_lock

REPO = Path(__file__).resolve().parents[2]
HOLD = ("import sys, time; from hybridflow.trainer.run_lock import run_dir_lock; "
        "lock = run_dir_lock(sys.argv[1]); lock.__enter__(); print('locked', flush=True); time.sleep(120)")


def _dead_pid() -> int:
    """The pid of a process that has exited (and was reaped)."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def _free(path: Path) -> bool:
    """Whether another open file of ``path`` can take the flock (no one holds it)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_a_live_run_in_another_process_is_refused_naming_it_then_its_crash_leaves_a_stale_lock(tmp_path, caplog):
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert child.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirInUseError) as err:
            with run_dir_lock(str(tmp_path)):
                pass
        line = str(err.value)
        assert isinstance(err.value, UserError) and "\n" not in line
        assert f"pid {child.pid} " in line and f"host {socket.gethostname()}" in line
        assert f"lock file {tmp_path / LOCK_FILE}" in line and f"trainer.default_local_dir={tmp_path}" in line
        started = json.loads((tmp_path / LOCK_FILE).read_text())["started"]
        assert f"started {started}" in line and started.endswith("+00:00")
    finally:
        child.kill()  # a crash: no clean-up, the lock file stays with the child's body
        child.wait()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == child.pid
    with caplog.at_level(logging.INFO, logger="hybridflow.trainer.run_lock"):
        with run_dir_lock(str(tmp_path)) as path:
            assert json.loads(Path(path).read_text())["pid"] == os.getpid()
    assert f"left by pid {child.pid} " in caplog.text and "no longer running" in caplog.text


def test_a_held_lock_whose_pid_is_dead_on_this_host_is_taken_over(tmp_path, caplog):
    # the flock is held (e.g. by a descriptor a child inherited) but the pid in the body is gone
    dead = _dead_pid()
    holder = os.open(tmp_path / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(holder, json.dumps({"pid": dead, "host": socket.gethostname(), "started": "then"}).encode())
        with caplog.at_level(logging.WARNING, logger="hybridflow.trainer.run_lock"):
            with run_dir_lock(str(tmp_path)) as path:
                assert json.loads(Path(path).read_text())["pid"] == os.getpid()
                assert not _free(tmp_path / LOCK_FILE)
        assert f"stale lock {tmp_path / LOCK_FILE}: pid {dead} " in caplog.text
    finally:
        os.close(holder)


def test_a_held_lock_of_a_live_pid_or_another_host_is_refused(tmp_path):
    holder = os.open(tmp_path / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        body = {"pid": _dead_pid(), "host": "elsewhere.example", "started": "t0", "command": "hybridflow train x"}
        os.write(holder, json.dumps(body).encode())
        with pytest.raises(RunDirInUseError, match="on host elsewhere.example .*hybridflow train x"):
            with run_dir_lock(str(tmp_path)):
                pass
    finally:
        os.close(holder)


@pytest.mark.parametrize("leave", ["return", "error", "ctrl_c"])
def test_the_lock_is_released_and_its_file_removed_on_every_exit(tmp_path, leave):
    raised = {"return": None, "error": RuntimeError, "ctrl_c": KeyboardInterrupt}[leave]
    try:
        with run_dir_lock(str(tmp_path)):
            assert not _free(tmp_path / LOCK_FILE)
            if raised:
                raise raised()
    except BaseException as exc:  # noqa: B036 - KeyboardInterrupt is the case under test
        assert type(exc) is raised
    assert not (tmp_path / LOCK_FILE).exists()
    with run_dir_lock(str(tmp_path)):  # the next run takes it at once
        pass


def test_a_read_only_run_directory_is_one_line(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only directories")
    tmp_path.chmod(0o555)
    try:
        with pytest.raises(UserError, match="cannot create the run directory's lock file"):
            with run_dir_lock(str(tmp_path)):
                pass
    finally:
        tmp_path.chmod(0o755)


@pytest.mark.parametrize("argv, command", [
    (["/venv/bin/hybridflow", "train", "quickstart", "trainer.default_local_dir=/my runs/a"],
     "hybridflow train quickstart 'trainer.default_local_dir=/my runs/a'"),
    (["/src/hybridflow/__main__.py", "train", "x.yaml"], "python -m hybridflow train x.yaml"),
])
def test_the_lock_body_names_the_command_as_typed(monkeypatch, argv, command):
    from hybridflow.trainer.run_lock import lock_body

    monkeypatch.setattr(sys, "argv", argv)
    body = lock_body()
    assert body["command"] == command and body["pid"] == os.getpid() and body["host"] == socket.gethostname()

"""One live run per run directory: ``hybridflow train`` holds an ``fcntl.flock`` on ``<run dir>/run.lock`` while it
runs, so a second run started into the same ``trainer.default_local_dir`` is refused before Ray starts instead of
overwriting the first one's checkpoints and metrics.

The lock is the ``flock`` (the kernel releases it when the holder's process ends, even by a crash); the file's
JSON body (pid, host, start time, command) only serves the message that names the other run. A clean exit removes
the file. A body left by a run that crashed, or naming a pid no longer alive on this host, is a stale lock and is
taken over with a log line. A resume of a run that is not running is not affected: the lock is about live runs.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import shlex
import socket
import sys
import time
from typing import Iterator, Optional

from hybridflow.errors import UserError

logger = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
_BODY_READS = 20  # a holder writes its body right after locking: re-read an empty body this often ...
_BODY_WAIT_S = 0.05  # ... this long apart


class RunDirInUseError(UserError):
    """Another live run holds the run directory's lock; ``str(error)`` names it (pid, host, start time, lock)."""


def lock_body() -> dict:
    """What this process writes into the lock file: ``pid``, ``host``, ``started`` (UTC, ISO 8601), ``command``."""
    program = os.path.abspath(sys.argv[0]) if sys.argv[0] else "python"
    if os.path.basename(program) == "__main__.py":  # python -m <package>
        words = ["python", "-m", os.path.basename(os.path.dirname(program))]
    else:
        words = [os.path.basename(program)]
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join(words + sys.argv[1:])}


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (one owned by another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def run_dir_lock(run_dir: str) -> Iterator[str]:
    """Hold the lock of ``run_dir`` (an existing directory) for the ``with`` block; yields the lock file's path.
    The lock is released and its file removed when the block exits, by return, exception or Ctrl-C.

    Raises:
        RunDirInUseError: a live run holds the lock (one line naming its pid, host, start time and the lock file).
        UserError: the lock file cannot be created (e.g. a read-only directory).
    """
    path = os.path.join(run_dir, LOCK_FILE)
    fd = _acquire(path)
    try:
        yield path
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)  # while still locked: a run waiting on the old file retries on the new one
        os.close(fd)


def _acquire(path: str) -> int:
    """Lock ``path`` (created if missing), write this run's body, return the open descriptor.

    Raises:
        RunDirInUseError, UserError: see :func:`run_dir_lock`.
    """
    for _ in range(10):  # the file may be removed or replaced between our open and our flock: retry then
        fd = _open(path)
        try:
            locked = _try_flock(fd)
            body = _read_body(fd, wait=not locked)
            if not locked:
                if not _stale(body):
                    raise RunDirInUseError(_in_use_line(path, body))
                logger.warning("taking over the stale lock %s: %s is no longer running", path, _describe(body))
                with contextlib.suppress(OSError):
                    os.unlink(path)  # its holder is gone but the lock is held (an inherited descriptor)
                os.close(fd)
                continue
            if not _same_file(fd, path):
                os.close(fd)
                continue
            if body:
                logger.info("taking over the lock %s left by %s, which is no longer running", path, _describe(body))
            _write_body(fd)
            return fd
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
    raise UserError(f"{path}: could not take the run directory's lock (another run keeps replacing it)")


def _open(path: str) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise UserError(f"{path}: cannot create the run directory's lock file ({exc.strerror or exc})") from None


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return False
        raise
    return True


def _same_file(fd: int, path: str) -> bool:
    """Whether ``fd`` is still the file at ``path`` (not removed or replaced by a run that released it)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _read_body(fd: int, wait: bool) -> Optional[dict]:
    """The lock file's JSON body, or None when empty or unreadable; with ``wait`` an empty body (a holder between
    its lock and its write) is read again a few times."""
    for attempt in range(_BODY_READS if wait else 1):
        raw = os.pread(fd, 1 << 16, 0)
        if raw.strip():
            try:
                body = json.loads(raw)
            except ValueError:
                return None
            return body if isinstance(body, dict) else None
        if attempt + 1 < _BODY_READS and wait:
            time.sleep(_BODY_WAIT_S)
    return None


def _write_body(fd: int) -> None:
    data = json.dumps(lock_body()).encode() + b"\n"
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def _stale(body: Optional[dict]) -> bool:
    """A held lock whose body names a process of this host that no longer exists."""
    if not body or body.get("host") != socket.gethostname() or not isinstance(body.get("pid"), int):
        return False
    return not pid_alive(body["pid"])


def _describe(body: dict) -> str:
    return f"pid {body.get('pid', '?')} on host {body.get('host', '?')} (started {body.get('started', '?')})"


def _in_use_line(path: str, body: Optional[dict]) -> str:
    run_dir = os.path.dirname(path)
    who = f"another run ({_describe(body)}: {body.get('command', '?')})" if body else "another run"
    return (f"trainer.default_local_dir={run_dir} is in use by {who}; lock file {path}; wait for that run to end "
            "or choose another trainer.default_local_dir")

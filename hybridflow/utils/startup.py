"""Where a run's start-up goes: named phases from the start of the process (or of ``run_ppo``) to the first step,
logged once as one line (``start-up 28.6 s to the first step: imports 2.1 s, config 0.4 s, ...``).

The clock is per process: ``hybridflow train`` begins it at the process's start (so the interpreter and the
command line's imports count), an in-process ``run_ppo`` (a test, a notebook) when it starts. Each
:func:`mark` closes the phase since the previous mark; :func:`summary` gives the line and resets the clock.
"""

from __future__ import annotations

import os
import time
from typing import Optional

_clock: dict = {"start": None, "last": None, "phases": []}


def _process_age_s() -> Optional[float]:
    """Seconds since this process started (Linux ``/proc``), or None where that is not readable."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def begin(from_process_start: bool = False) -> None:
    """Start the clock now, or at the process's start (``from_process_start``, where the OS tells it)."""
    now = time.monotonic()
    age = _process_age_s() if from_process_start else None
    _clock.update(start=now - (age or 0.0), last=now - (age or 0.0), phases=[])


def begin_if_idle() -> None:
    """:func:`begin` now unless a clock is already running (the command line began it)."""
    if _clock["start"] is None:
        begin()


def mark(name: str) -> None:
    """Close the phase ``name``: the time since the previous mark (or the start). No-op when no clock runs."""
    if _clock["start"] is None:
        return
    now = time.monotonic()
    _clock["phases"].append((name, now - _clock["last"]))
    _clock["last"] = now


def summary() -> Optional[str]:
    """``start-up X s to the first step: <phase> Y s, ...`` (the phases in order), and the clock stops; None when
    no clock runs."""
    if _clock["start"] is None:
        return None
    total = time.monotonic() - _clock["start"]
    phases = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in _clock["phases"])
    _clock.update(start=None, last=None, phases=[])
    return f"start-up {total:.1f} s to the first step: {phases}"

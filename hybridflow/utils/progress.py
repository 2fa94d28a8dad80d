"""Progress of long phases (a training run, validation, ``hybridflow eval``, starting the worker groups).

On a terminal (``sys.stderr.isatty()``) a phase is a tqdm bar on stderr with its count, rate and ETA; the
per-step console line and log records are written above the bars (:func:`write_line`,
:func:`terminal_logging`), so they coexist. Anywhere else (CI, ``ray job submit``, output piped to a file) a phase
is plain log lines, ``<desc>: <n>/<total> <unit> (<pct>%), <elapsed> elapsed, ETA <eta>[, <postfix>]``, on its
first update, then at most every :data:`PLAIN_INTERVAL_S` seconds, and at its end: no carriage return, no ANSI
escape codes.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any, Optional, TextIO

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

logger = logging.getLogger(__name__)

PLAIN_INTERVAL_S = 30.0  # seconds between two plain progress lines of one phase (off a terminal)
RUN_VAL_METRIC = "val/score"  # the validation metric shown on the run's bar


def on_terminal(stream: Optional[TextIO] = None) -> bool:
    """Whether ``stream`` (default: the current ``sys.stderr``, where bars are drawn) is a terminal."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def write_line(text: str, file: Optional[TextIO] = None) -> None:
    """Print ``text`` and a newline to ``file`` (default: the current ``sys.stdout``) above any open bar."""
    file = sys.stdout if file is None else file
    tqdm.write(text, file=file)  # with a bar open, tqdm clears it, writes the line and redraws it
    file.flush()


@contextlib.contextmanager
def terminal_logging() -> Iterator[None]:
    """While open, the root logger's console handlers write through tqdm on a terminal (records appear above the
    bars instead of through them); a no-op elsewhere."""
    if not on_terminal():
        yield
        return
    with logging_redirect_tqdm():
        yield


def _fmt_value(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


class Progress:
    """A phase of ``total`` units; use as a context manager (closing it ends the bar / prints the last line).

    Args:
        desc: what the phase does, e.g. ``validation (greedy)``.
        total: units in the phase (prompts, steps, worker groups).
        unit: name of one unit, shown after the count.
        initial: units already done when the phase starts (a resumed run's steps).
        leave: keep the bar on screen after it closes (False for phases nested in the run).
        interval_s: seconds between plain lines off a terminal.
    """

    def __init__(self, desc: str, total: int, unit: str, initial: int = 0, leave: bool = True,
                 interval_s: float = PLAIN_INTERVAL_S) -> None:
        self.desc, self.total, self.unit, self.n = desc, int(total), unit, int(initial)
        self.interval_s = interval_s
        self._initial = int(initial)
        self._start = time.monotonic()
        self._last_line: Optional[float] = None
        self._postfix: dict[str, Any] = {}
        self._bar = (tqdm(total=self.total, initial=self.n, desc=desc, unit=f" {unit}", file=sys.stderr,
                          leave=leave, dynamic_ncols=True) if on_terminal() else None)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def update(self, n: int = 1, postfix: Optional[Mapping[str, Any]] = None) -> None:
        """Add ``n`` done units; ``postfix`` (name -> value) replaces the values shown after the count."""
        self.advance_to(self.n + n, postfix)

    def advance_to(self, n: int, postfix: Optional[Mapping[str, Any]] = None) -> None:
        """Set the done units to ``n`` (e.g. the step just logged); ``postfix`` as in :meth:`update`."""
        if postfix is not None:
            self._postfix = {k: _fmt_value(v) for k, v in postfix.items()}
        delta, self.n = n - self.n, n
        if self._bar is not None:
            self._bar.set_postfix(self._postfix, refresh=False)
            self._bar.update(delta)
            return
        now = time.monotonic()
        if self._last_line is None or now - self._last_line >= self.interval_s or self.n >= self.total:
            self._last_line = now
            logger.info("%s", self.line())

    def line(self) -> str:
        """The plain progress line (see the module docstring)."""
        elapsed = time.monotonic() - self._start
        done = self.n - self._initial
        if done > 0 and self.total > self.n:
            eta = tqdm.format_interval(elapsed / done * (self.total - self.n))
        else:
            eta = tqdm.format_interval(0) if self.n >= self.total else "?"
        pct = 100.0 * self.n / self.total if self.total else 100.0
        text = (f"{self.desc}: {self.n}/{self.total} {self.unit} ({pct:.0f}%), "
                f"{tqdm.format_interval(elapsed)} elapsed, ETA {eta}")
        return text + "".join(f", {k} {v}" for k, v in self._postfix.items())

    def close(self) -> None:
        """End the phase; safe to call twice."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

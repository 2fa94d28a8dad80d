"""Errors that report a problem in what the user gave (data files, paths, their own code), not a bug.

The command line prints a :class:`UserError` as one line (``error: <message>``) and exits with 1, without a
traceback; every other exception keeps its traceback. A message names where the problem is (the config key, the
file, the row) and what was expected. A :class:`UserCodeError` (an exception raised in the user's own reward
function, plugin or worker code) adds the user's own frames under that line. This module imports nothing from
hybridflow (only the standard library), so every layer may raise these.
"""

from __future__ import annotations

import functools
import os
import traceback
from typing import Optional, Sequence


class UserError(Exception):
    """A problem in the user's input; ``str(error)`` is the one line the CLI prints."""


class DataError(UserError, ValueError):
    """A data file or row the run cannot use: a missing column, an empty file, an over-long prompt with
    ``truncation=error``, a ``data_source`` without a registered reward. Also a ``ValueError``, so code written
    against the older contract keeps working.

    Args:
        reason: what is wrong (naming the file where known).
        row: index of the offending row in the rows the raiser was given (None: not about one row); the message
            is then ``row <row>: <reason>``. A caller that concatenated several files uses ``row`` and ``reason``
            to name the file and the row inside it instead.
    """

    def __init__(self, reason: str, row: Optional[int] = None) -> None:
        super().__init__(reason if row is None else f"row {row}: {reason}")
        self.reason, self.row = reason, row


class TrainingInterrupted(Exception):
    """``hybridflow train`` was stopped by Ctrl-C (SIGINT) after cleaning up (workers ended, Ray shut down).

    Args:
        step: the last training step whose metrics were logged (0: none).
        total: the run's total number of steps.
        checkpoint: the latest complete checkpoint directory in the run directory, or None.
    """

    def __init__(self, step: int, total: int, checkpoint: Optional[str]) -> None:
        super().__init__(f"interrupted after step {step}/{total}; latest complete checkpoint: {checkpoint or 'none'}")
        self.step, self.total, self.checkpoint = step, total, checkpoint


class TrainingTimedOut(TrainingInterrupted):
    """``hybridflow train`` stopped itself (after the same cleanup as :class:`TrainingInterrupted`) because a
    worker-group call did not finish within ``trainer.call_timeout_s``.

    Args:
        reason: one line naming the group, the method and the ranks that did not answer, and the limit.
        step, total, checkpoint: as :class:`TrainingInterrupted`.
    """

    def __init__(self, reason: str, step: int, total: int, checkpoint: Optional[str]) -> None:
        super().__init__(step, total, checkpoint)
        self.reason = reason
        self.args = (f"{reason}; stopped after step {step}/{total}; latest complete checkpoint: "
                     f"{checkpoint or 'none'}",)


class EvalInterrupted(KeyboardInterrupt):
    """``hybridflow eval`` was stopped by Ctrl-C; a ``KeyboardInterrupt``, so callers that stop on Ctrl-C still
    stop. ``str(error)`` is the one line the command line prints.

    Args:
        scored: pass name -> prompts scored in it so far (passes in run order).
        total: prompts per pass.
        output: the JSONL file that holds the responses scored so far, or None (none was asked for).
        written: responses written to ``output``.
    """

    def __init__(self, scored: dict[str, int], total: int, output: Optional[str], written: int) -> None:
        passes = ", ".join(f"{count}/{total} prompts in pass {name}" for name, count in scored.items())
        where = (f"the partial output ({written} responses) is in {output}" if output is not None
                 else "no --output was given, so nothing was written")
        super().__init__(f"interrupted: scored {passes}; {where}")
        self.scored, self.total, self.output, self.written = scored, total, output, written


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep  # hybridflow's own code
_LIBRARY_PARTS = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")


@functools.lru_cache(maxsize=1)
def _library_dirs() -> tuple[str, ...]:
    """The standard library's and the installed packages' directories (read once, when first needed)."""
    import sysconfig

    paths = sysconfig.get_paths()
    return tuple(sorted({os.path.abspath(paths[name]) + os.sep
                         for name in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(name)}))


def is_user_file(filename: str) -> bool:
    """Whether a traceback entry's file is the user's own code: not in the hybridflow package, not in the standard
    library or an installed package (site-packages), not Python's frozen or generated modules (``<...>``)."""
    if filename.startswith("<"):
        return False
    path = os.path.abspath(filename)
    if path.startswith(_PACKAGE_DIR) or path.startswith(_library_dirs()):
        return False
    return not any(part in path for part in _LIBRARY_PARTS)


def user_frames(exc: BaseException) -> list[str]:
    """The entries of ``exc``'s traceback that are in the user's own files (:func:`is_user_file`), outermost
    first, each as two lines: ``  <file>:<line> in <function>`` and the source line indented (when readable)."""
    lines = []
    for frame in traceback.extract_tb(exc.__traceback__):
        if is_user_file(frame.filename):
            lines.append(f"  {frame.filename}:{frame.lineno} in {frame.name}")
            if frame.line:
                lines.append(f"    {frame.line.strip()}")
    return lines


class UserCodeError(UserError, RuntimeError):
    """An exception raised in the user's own code (a ``reward_model.compute_score`` function, a plugin, a worker
    class): ``str(error)`` is the one line ``<where>: <ExceptionType>[: <message>][; <hint>]`` and :attr:`frames`
    the user's own traceback entries (:func:`user_frames`), which the CLI prints under it instead of the full
    traceback. Also a ``RuntimeError``, as the reward errors it replaces. Picklable with its fields, so it
    crosses Ray's process boundary (``RayTaskError.cause``).

    Args:
        where: what was running, e.g. ``reward function compute_score on sample index=3 (data_source='x')``.
        exc_type: the original exception's class name.
        message: the original exception's message.
        frames: the lines of :func:`user_frames`.
        hint: what the user can do instead (optional).
    """

    def __init__(self, where: str, exc_type: str, message: str, frames: Sequence[str] = (), hint: str = "") -> None:
        super().__init__(f"{where}: {exc_type}" + (f": {message}" if message else "") + (f"; {hint}" if hint else ""))
        self.where, self.exc_type, self.message, self.frames, self.hint = where, exc_type, message, list(frames), hint

    def __reduce__(self):  # keep the fields when pickled (Ray ships errors between processes)
        return (UserCodeError, (self.where, self.exc_type, self.message, self.frames, self.hint))

    @classmethod
    def wrap(cls, exc: BaseException, where: str, hint: str = "") -> Optional["UserCodeError"]:
        """``exc`` as a UserCodeError when it was raised in the user's own code: the innermost entry of its
        traceback outside the standard library and installed packages is in a user's file (so a library call
        the user's code made counts as theirs); None otherwise (raised in hybridflow, even when called from the
        user's code: a bug or a misuse hybridflow reports itself, which keeps its full traceback)."""
        if not _raised_in_user_code(exc):
            return None
        return cls(where, type(exc).__name__, " ".join(str(exc).split()), user_frames(exc), hint)  # on one line


def _raised_in_user_code(exc: BaseException) -> bool:
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):  # innermost first
        if is_user_file(frame.filename):
            return True
        if os.path.abspath(frame.filename).startswith(_PACKAGE_DIR):
            return False
    return False


def report_lines(error: BaseException, where: str = "") -> list[str]:
    """What the CLI prints for a user error: ``error: [<where>: ]<message>`` and, for a :class:`UserCodeError`,
    its frames (one line each)."""
    return [f"error: {where + ': ' if where else ''}{error}", *getattr(error, "frames", ())]

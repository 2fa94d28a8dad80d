"""Errors that report a problem in what the user gave (data files, paths), not a bug.

The command line prints a :class:`UserError` as one line (``error: <message>``) and exits with 1, without a
traceback; every other exception keeps its traceback. A message names where the problem is (the config key, the
file, the row) and what was expected. This module imports nothing, so every layer may raise these.
"""

from __future__ import annotations

from typing import Optional


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

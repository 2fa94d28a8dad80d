"""File modes of the model directories hybridflow writes.

``safetensors`` writes its file through a private temporary file and renames it into place, so a saved
``model.safetensors`` is ``0600`` whatever the umask, while the ``config.json`` and tokenizer files beside it are
``0644`` under the usual umask ``022``: another user (or a serving container running as another uid) can read the
config but not the weights. :func:`match_umask` gives the weights the mode of their siblings.
"""

from __future__ import annotations

import os
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors",)


def umask_file_mode() -> int:
    """The mode a new regular file gets from ``open()`` in this process: ``0o666`` without the umask's bits."""
    mask = os.umask(0o022)  # the only portable way to read the umask is to set it; put it back at once
    os.umask(mask)
    return 0o666 & ~mask


def match_umask(directory: str | os.PathLike) -> list[Path]:
    """Give each weight file directly in ``directory`` (``*.safetensors``) the mode an ordinary new file gets
    (:func:`umask_file_mode`, ``0644`` under umask ``022``); returns the files changed.

    Raises:
        OSError: a weight file cannot be chmod-ed (e.g. it belongs to another user).
    """
    mode, changed = umask_file_mode(), []
    for path in sorted(Path(directory).iterdir()):
        if path.is_file() and path.name.endswith(WEIGHT_SUFFIXES) and (path.stat().st_mode & 0o777) != mode:
            path.chmod(mode)
            changed.append(path)
    return changed

"""A fault hook for the commit of a checkpoint (importable, so it pickles under spawn).

``fail_at(stage, path)`` raises ``OSError(EIO)`` at one step of a commit,
chosen by the file ``FAULT`` in the directory being written: its text is
``<stage>:<file>``, stage ``fsync`` or ``rename``, file ``model``, ``optim``,
``data``, ``meta`` or ``dir`` (the directory's own fsync). Without the file it does nothing.
"""

from __future__ import annotations

import errno
import os

FLAG = "FAULT"


def _which(path: str) -> tuple[str, str]:
    """(directory, which file of a checkpoint) for a path the writer touches."""
    if os.path.isdir(path):
        return path, "dir"
    name = os.path.basename(path)
    kind = ("meta" if ".meta" in name else "optim" if ".optim.fdl" in name
            else "data" if ".fdl.data" in name else "model")
    return os.path.dirname(path), kind


def fail_at(stage: str, path: str) -> None:
    directory, kind = _which(path)
    try:
        with open(os.path.join(directory, FLAG)) as f:
            wanted = f.read()
    except (FileNotFoundError, NotADirectoryError):
        return
    if wanted == f"{stage}:{kind}":
        raise OSError(errno.EIO, f"injected EIO at {stage} of the {kind} file", path)

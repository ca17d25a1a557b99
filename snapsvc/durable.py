"""Durable file writes: temp file in the same directory, fsync, rename, fsync dir.

A reader of the final name sees either the previous complete file or the new
complete file, never a partial one, whatever happens to this process. Temp
files carry :data:`TMP_SUFFIX` so a restarted writer can find and remove the
ones a dead writer left behind.
"""

from __future__ import annotations

import os
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import BinaryIO, Iterator

__all__ = ["TMP_SUFFIX", "DurableFile", "atomic_write", "fsync_dir"]

TMP_SUFFIX = ".snapsvc-tmp"


@dataclass
class DurableFile:
    """What :func:`atomic_write` yields; the timings are filled in on exit."""

    file: BinaryIO
    path: str
    tmp_path: str
    fsync_s: float = 0.0


def fsync_dir(directory: str) -> None:
    """fsync a directory so a rename inside it survives a power cut."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_write(path: str | os.PathLike[str]) -> Iterator[DurableFile]:
    """Yield a :class:`DurableFile` whose ``file`` becomes ``path`` on success.

    On any exception the temp file is removed and ``path`` is left as it was.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=TMP_SUFFIX,
                               dir=directory)
    try:
        with os.fdopen(fd, "wb", buffering=1 << 20) as f:
            out = DurableFile(f, path, tmp)
            yield out
            f.flush()
            t0 = time.perf_counter()
            os.fsync(f.fileno())
            out.fsync_s = time.perf_counter() - t0
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    t0 = time.perf_counter()
    fsync_dir(directory)
    out.fsync_s += time.perf_counter() - t0

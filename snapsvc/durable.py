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
from typing import BinaryIO, Iterator

from isal import isal_zlib

__all__ = ["TMP_SUFFIX", "DurableFile", "atomic_write", "fsync_dir", "remove_stale_temps"]

TMP_SUFFIX = ".snapsvc-tmp"


class DurableFile:
    """What :func:`atomic_write` yields: a write-only file that keeps the
    CRC-32 and size of every byte written, and the seconds spent in the OS."""

    def __init__(self, file: BinaryIO, path: str, tmp_path: str) -> None:
        self._file = file
        self.path = path
        self.tmp_path = tmp_path
        self.size = 0
        self.crc32 = 0
        self.write_s = 0.0
        self.fsync_s = 0.0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        t0 = time.perf_counter()
        n = self._file.write(data)
        self.write_s += time.perf_counter() - t0
        self.crc32 = isal_zlib.crc32(data, self.crc32)
        self.size += n
        return n

    def flush(self) -> None:
        self._file.flush()


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
    # The pid in the name lets remove_stale_temps tell a dead writer's leftovers
    # from a live writer's work in progress.
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.{os.getpid()}.",
                               suffix=TMP_SUFFIX, dir=directory)
    try:
        with os.fdopen(fd, "wb", buffering=1 << 20) as f:
            out = DurableFile(f, path, tmp)
            yield out
            t0 = time.perf_counter()
            f.flush()
            out.write_s += time.perf_counter() - t0
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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(directory: str | os.PathLike[str]) -> list[str]:
    """Delete temp files in ``directory`` whose writing process is dead; return them."""
    removed = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for name in names:
        if not (name.startswith(".") and name.endswith(TMP_SUFFIX)):
            continue
        parts = name[: -len(TMP_SUFFIX)].rsplit(".", 2)  # [".<base>", pid, random]
        if len(parts) != 3 or not parts[1].isdigit() or _alive(int(parts[1])):
            continue
        path = os.path.join(directory, name)
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed

"""What ``submit()`` returns: a :class:`WriteHandle`, the future of a :class:`WriteReport`."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["WriteReport", "WriteHandle"]


@dataclass
class WriteReport:
    """How one submitted snapshot went. Times are seconds."""

    path: str
    bytes: int = 0          # file size on disk
    entries: int = 0
    skipped: bool = False   # policy "skip" found no slot, or "latest" replaced it
    stage_s: float = 0.0    # submit(): the training loop's stall
    queue_s: float = 0.0    # message sent -> writer starts
    encode_s: float = 0.0   # encoding and compression
    write_s: float = 0.0    # in the OS's write calls
    fsync_s: float = 0.0    # fsyncs of file, metadata and directory
    total_s: float = 0.0    # submit() called -> report received
    seq: int = 0


class WriteHandle:
    """A pending write, like a ``concurrent.futures.Future`` of a :class:`WriteReport`."""

    def __init__(self, seq: int, path: str) -> None:
        self.seq = seq
        self.path = path
        self._future: Future[WriteReport] = Future()

    def result(self, timeout: float | None = None) -> WriteReport:
        """The report; raises the write's error, or ``TimeoutError`` after ``timeout``."""
        return self._future.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    def done(self) -> bool:
        return self._future.done()

    def add_done_callback(self, fn: Callable[["WriteHandle"], Any]) -> None:
        """Call ``fn(handle)`` when done (at once if already done)."""
        self._future.add_done_callback(lambda _f: fn(self))

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<WriteHandle seq={self.seq} {self.path!r} {state}>"

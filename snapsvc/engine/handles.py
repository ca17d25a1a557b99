"""What ``submit()`` returns: a :class:`WriteHandle`, the future of a :class:`WriteReport`."""

from __future__ import annotations

import logging
import traceback
from concurrent.futures import Future, InvalidStateError, TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import UnsafeCallError, UploadError

__all__ = ["WriteReport", "WriteHandle"]

log = logging.getLogger("snapsvc")


@dataclass
class WriteReport:
    """How one submitted snapshot went. Times are seconds."""

    path: str
    bytes: int = 0          # file size on disk
    entries: int = 0
    skipped: bool = False   # policy "skip" found no slot, or "latest" replaced it
    stage_s: float = 0.0    # submit(): the training loop's stall
    slot_wait_s: float = 0.0  # of stage_s, waiting for a free slot (policy "block"): the
                              # sidecar was still writing earlier snapshots (backpressure)
    queue_s: float = 0.0    # message sent -> writer starts
    encode_s: float = 0.0   # encoding and compression
    write_s: float = 0.0    # in the OS's write calls
    fsync_s: float = 0.0    # fsyncs of file, metadata and directory
    total_s: float = 0.0    # submit() called -> report received
    seq: int = 0
    in_memory: bool = False  # persist=False: held in the sidecar's RAM, not on disk


def _never() -> bool:
    return False


class WriteHandle:
    """A pending write, like a ``concurrent.futures.Future`` of a :class:`WriteReport`.

    ``on_reader``: true on the thread that resolves handles (where
    done-callbacks run), on which a wait would wait for itself.
    """

    def __init__(self, seq: int, path: str, on_reader: Callable[[], bool] = _never, *,
                 remote: bool = False) -> None:
        self.seq = seq
        self.path = path
        self._future: Future[WriteReport] = Future()
        self._on_reader = on_reader
        # the remote copy's URL, with SnapshotWriter(remote=...); else None at once
        self._upload: Future[str | None] = Future()
        if remote:
            self._future.add_done_callback(self._local_done)
        else:
            self._upload.set_result(None)

    def _local_done(self, future: Future[WriteReport]) -> None:
        """A write that failed or was skipped locally will not be uploaded: say so."""
        error = future.exception()
        if error is not None:
            self.fail_upload(f"not uploaded: the local write failed: {error}")
        elif future.result().skipped:
            self.fail_upload("not uploaded: the snapshot was skipped (policy 'skip' or "
                             "'latest')", skipped=True)

    def fail_upload(self, why: str, *, skipped: bool = False) -> None:
        """Resolve :meth:`uploaded` with an UploadError, unless it is resolved already."""
        try:
            self._upload.set_exception(UploadError(f"{self.path}: {why}", path=self.path,
                                                   skipped=skipped))
        except InvalidStateError:
            pass

    def result(self, timeout: float | None = None) -> WriteReport:
        """The report; raises the write's error, or ``TimeoutError`` after ``timeout``.
        Inside a done-callback, on a handle not done: :class:`UnsafeCallError` at once."""
        self._no_wait_on_reader("result")
        return self._future.result(timeout)

    def uploaded(self, timeout: float | None = None) -> str | None:
        """The remote URL of the checkpoint's main file once its remote copy is
        committed (its ``.meta`` written last); None for a writer without ``remote``.

        Raises :class:`~snapsvc.errors.UploadError` if it never will be (failed
        after retries or past ``remote_timeout``, skipped, or the writer
        stopped first), ``TimeoutError`` after ``timeout`` seconds.
        :meth:`result` still means durable locally.
        """
        self._no_wait_on_reader("uploaded", self._upload)
        try:
            return self._upload.result(timeout)
        except FutureTimeout:  # a distinct class before Python 3.11
            raise TimeoutError(f"{self.path}: not uploaded yet after {timeout} s") from None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The write's error, or None if it succeeded; waits as :meth:`result` does."""
        self._no_wait_on_reader("exception")
        return self._future.exception(timeout)

    def done(self) -> bool:
        """Whether the write has finished, written or failed (never waits)."""
        return self._future.done()

    def add_done_callback(self, fn: Callable[["WriteHandle"], Any]) -> None:
        """Call ``fn(handle)`` when done (at once, on this thread, if already done).

        On the thread that delivers reports whatever ``fn`` raises is logged
        and dropped, ``SystemExit`` and ``KeyboardInterrupt`` too: no callback
        can stop the reports. On another thread, as ``concurrent.futures``
        does: an ``Exception`` is logged, anything else propagates.
        """
        def call(_f: Future[WriteReport]) -> None:
            try:
                fn(self)
            except BaseException as e:  # noqa: BLE001 - see above
                if not isinstance(e, Exception) and not self._on_reader():
                    raise
                # Formatted, not exc_info: a kept traceback would keep the reader's frames alive.
                log.error("a done-callback of %r raised; ignored:\n%s", self,
                          "".join(traceback.format_exception(e)).rstrip())

        self._future.add_done_callback(call)

    def _no_wait_on_reader(self, what: str, future: Future[Any] | None = None) -> None:
        if not (future or self._future).done() and self._on_reader():
            raise UnsafeCallError(f"{what}() of {self!r} inside a done-callback would deadlock: "
                                  "callbacks run on the thread that delivers reports; wait on "
                                  "another thread")

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<WriteHandle seq={self.seq} {self.path!r} {state}>"

"""Starting, restarting and stopping one writer's sidecar, one thread at a time.

``lock`` serializes the three; it may be taken before the book's ``cond``,
never after. A dead sidecar is restarted by the next submit (when the
writer allows it): the copier first drops what it held for the dead one,
stale temp files of the directories written to are removed, and the new
sidecar learns which files ``keep_last`` still rotates.

Leaving the interpreter with writes in flight: SIGTERM's default kills the
trainer at once; while a writer is open it is turned into ``SystemExit`` so
``with`` blocks and the exit drain run. An interpreter that exits without
``close()`` lets each sidecar drain, bounded by the writer's ``drain_timeout``.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
import weakref
from typing import Any

from ..files.durable import remove_stale_temps
from ..format import protocol
from .attach import take_over
from .book import Book
from .copier import Copier
from .link import Sidecar
from .pools import SlotPools

__all__ = ["Life", "live", "exit_on_sigterm", "restore_sigterm"]

log = logging.getLogger("snapsvc")


class Life:
    """The sidecar's life cycle for ``owner`` (a SnapshotWriter: its directory,
    restart and sigterm settings)."""

    def __init__(self, owner: Any, book: Book, sidecar: Sidecar, copier: Copier,
                 pools: SlotPools, options: dict[str, Any]) -> None:
        self.owner = owner
        self.book = book
        self.sidecar = sidecar
        self.copier = copier
        self.pools = pools
        self.options = options  # the sidecar's; a restart adds the files keep_last still rotates
        self.lock = threading.Lock()

    def ensure_running(self) -> None:
        """Start the sidecar, or restart a dead one."""
        book = self.book
        with self.lock:
            with book.cond:
                book.check_open()
                broken, started = book.broken, self.sidecar.proc is not None
            if started and broken is None and self.sidecar.exited():
                # Died with nothing pending, and the reader has not said so yet:
                # let it, rather than queue this snapshot to a dead process.
                self.sidecar.join_reader(5)
                with book.cond:
                    broken = book.broken
            if started and broken is None:
                return
            if broken is not None:
                if not self.owner.restart:
                    raise broken
                self.copier.wait()  # the copier drops what it held for the dead writer first
                self.sidecar.reap()
                log.warning("restarting the writer sidecar after: %s", broken)
            with book.cond:
                dirs = set(book.dirs)
            if self.owner.directory is not None:
                os.makedirs(self.owner.directory, exist_ok=True)
                dirs.add(self.owner.directory)
            for d in dirs:
                for path in remove_stale_temps(d):
                    log.warning("removed %s left by a dead writer", path)
            with book.cond:
                if book.kept is not None:
                    self.options["written"] = list(book.kept)
            if not started and self.owner.directory is not None:  # the first start only
                self.owner.attached = take_over(self.owner.directory,
                                                self.options.get("linger", 0.0), self.options)
                if self.owner.attached is not None and book.kept is not None:
                    with book.cond:
                        book.kept = list(self.options["written"])
            self.sidecar.start()
            self.options.pop("held", None)  # the first sidecar owns them now
            with book.cond:
                book.broken = None
                if broken is not None:
                    book.counts["restarts"] += 1
                if self.owner.directory is not None:
                    book.dirs.add(self.owner.directory)
                book.cond.notify_all()
            live.add(self.owner)
            if self.owner.sigterm:
                exit_on_sigterm()


    def stop(self, timeout: float | None) -> None:
        """Drain what is queued (bounded by ``timeout``), then stop the sidecar."""
        book = self.book
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            with book.cond:
                if book.closed:
                    return
                book.closing = True
                book.cond.notify_all()  # submits waiting for a slot give up
                while (book.pending or book.active) and book.broken is None:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    book.cond.wait(0.5 if left is None else min(left, 0.5))
                late = [p.handle.path for p in book.pending.values()]
            if late:
                log.error("snapsvc: %d snapshot(s) not written within %.1f s: %s",
                          len(late), timeout, ", ".join(late))
            self.copier.shutdown()  # overlap copies finish (memcpy) before STOP goes out
            if self.sidecar.proc is not None:
                # posted, not waited for: behind a WRITE that a hung sidecar never
                # reads, the deadline below still holds
                self.sidecar.post(protocol.pack(protocol.STOP))
                left = None if deadline is None else max(0.1, deadline - time.monotonic())
                if not self.sidecar.wait_exit(left):
                    self.sidecar.kill()
                self.sidecar.reap()
            with book.cond:
                book.closed = True
                if not book.active:  # else the last submit still copying releases them
                    self.pools.clear()
            live.discard(self.owner)
            restore_sigterm()


# -- leaving the interpreter ------------------------------------------------------
live: "weakref.WeakSet[Any]" = weakref.WeakSet()  # open writers (finish(timeout) each)


def _sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def exit_on_sigterm() -> None:
    """Make SIGTERM unwind like an exception, so pending writes drain (main thread only)."""
    if threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _sigterm)


def restore_sigterm() -> None:
    """Put SIGTERM's default back once no writer is left (main thread only)."""
    if not live and threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGTERM) is _sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@atexit.register
def _close_at_exit() -> None:
    """An interpreter that exits without close(): let each sidecar drain, bounded."""
    for w in list(live):
        try:
            w.finish(timeout=w.drain_timeout)
        except Exception:  # never block interpreter exit on a checkpoint
            log.exception("closing a snapsvc writer at exit failed")

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

The restart tier on this side: attaching a new writer to a sidecar that
lingers after its trainer died (``take_over``) or to a ``snapsvc serve``
service (``service=``, or one registered for the directory: it is tried
first, and when it is gone or busy a sidecar of our own starts), and
``persist_every``'s count (``Cadence``).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from ..errors import UnsafePathError
from ..files.durable import remove_stale_temps
from ..files.ramtier import ram_path, series
from ..files.rendezvous import attach, service_socket, unregister_service
from ..format import protocol
from .book import Book
from .copier import Copier
from .link import ServiceUnavailable, Sidecar
from .pools import SlotPools

__all__ = ["Life", "live", "exit_on_sigterm", "restore_sigterm", "AttachReport", "Cadence", "take_over"]

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
        book.ram_keep = options.get("keep_in_memory", 1)
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
            if not self._serve(first=not started):
                if not started and self.owner.directory is not None:  # the first start only
                    self.owner.attached = take_over(self.options.get("linger_key",
                                                                     self.owner.directory),
                                                    self.options.get("linger", 0.0), self.options)
                    if self.owner.attached is not None and book.kept is not None:
                        with book.cond:
                            book.kept = list(self.options["written"])
                self.pools.memory_limit = self.options.get("memory_limit")  # not a service's
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


    def _serve(self, first: bool) -> bool:
        """Attach to ``service=``, else to a service registered for the directory
        (``snapsvc serve``); False when there is none to attach to."""
        path = self.owner.service
        if path is None and self.owner.directory is not None:
            try:
                path = service_socket(self.owner.directory)
            except UnsafePathError as e:
                log.warning("not looking for a snapsvc service: %s", e)
        if path is None:
            return False
        try:
            self.sidecar.start(service=path)
        except ServiceUnavailable as e:
            if first and self.owner.service is not None:
                raise
            if e.dead:
                self._bury(path)
            log.warning("%s; starting a writer sidecar of this trainer's own", e)
            return False
        info = self.sidecar.service_info or {}
        self.pools.memory_limit = lower(self.options.get("memory_limit"), info.get("memory"))
        with self.book.cond:
            for held, _ in info.get("held", ()):
                self.book.note_ram(held)
        if first:
            self.owner.attached = AttachReport(info["pid"], [p for p, _ in info["held"]],
                                               [(f["path"], f["error"]) for f in info["failures"]])
        for f in info["failures"]:
            log.error("while no trainer was attached, writing %s failed: %s", f["path"], f["error"])
        return True

    def _bury(self, sock: str) -> None:
        """The service on ``sock`` is gone (nothing listens): its record and socket file
        go, and the RAM copies it held for this writer pass to the sidecar started next,
        which drops them when it ends (a RAM copy lives as long as its writer)."""
        if self.owner.directory is not None:
            unregister_service(self.owner.directory, sock)
        try:
            os.unlink(sock)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("could not remove the dead service's socket %s: %s", sock, e)
        with self.book.cond:
            paths = [p for mine in self.book.in_ram.values() for p in mine]
        held = [(p, ram) for p in paths if (ram := ram_path(p)) is not None and os.path.exists(ram)]
        if held:
            self.options["held"] = held

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

@dataclass
class AttachReport:
    """What a new :class:`~snapsvc.SnapshotWriter` took over from a sidecar that
    outlived its trainer (``linger``): ``writer.attached``, None when it found none.

    ``held``: the memory-only snapshots (their paths) still in RAM, readable with
    :func:`snapsvc.load`/``restore``; ``failures``: (path, error) of each write
    that failed while no trainer was attached; ``pid``: that sidecar's process.
    """

    pid: int
    held: list[str] = field(default_factory=list)
    failures: list[tuple[str, str]] = field(default_factory=list)


def take_over(directory: str, linger: float, options: dict) -> AttachReport | None:
    """Attach to a sidecar lingering on ``directory``: its RAM copies and
    ``keep_last`` files go into ``options`` for the new sidecar."""
    try:
        state = attach(directory)
    except UnsafePathError:
        if linger:  # this writer would linger there: the user must fix it
            raise
        log.warning("not looking for a lingering sidecar", exc_info=True)
        return None
    if state is None:
        return None
    options["held"] = [tuple(pair) for pair in state["held"]]
    written = list(options.get("written") or ())
    options["written"] = written + [p for p in state["written"] if p not in written]
    report = AttachReport(state["pid"], [p for p, _ in state["held"]],
                          [(f["path"], f["error"]) for f in state["failures"]])
    for path, error in report.failures:
        log.error("while no trainer was attached, writing %s failed: %s", path, error)
    return report


def lower(*limits: int | None) -> int | None:
    """The lowest of the memory limits given (None: no limit)."""
    given = [v for v in limits if v is not None]
    return min(given) if given else None


class Cadence:
    """``persist_every``: which submits of each series are persisted (the K-th, 2K-th, ...)."""

    def __init__(self, every: int | None) -> None:
        self.every = every
        self._counts: dict[tuple[str, str], int] = {}  # submits per series, this writer's
        self._lock = threading.Lock()

    def persist(self, path: str) -> bool:
        if self.every is None:
            return True
        key = series(path)
        with self._lock:
            n = self._counts[key] = self._counts.get(key, 0) + 1
        return n % self.every == 0

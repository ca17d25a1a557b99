"""The writer's books: pending writes, flags and counters, under one lock.

``cond`` (one lock) guards every piece of shared state of a
:class:`~snapsvc.engine.writer.SnapshotWriter`: the pending writes kept
here, the slots, pools and plans (:mod:`.pools`), the broken/closing flags
and the counters. Reports from the sidecar resolve pending writes here, on
the reader thread; no lock is held while a handle's callbacks run.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import BrokenWriterError, WriteFailedError, WriterClosedError
from ..files.ramtier import held, ram_series
from ..format import protocol
from .handles import WriteHandle, WriteReport
from .pools import Slot
from .link import describe

__all__ = ["Book", "Pending"]

log = logging.getLogger("snapsvc")


@dataclass
class Pending:
    handle: WriteHandle
    slot: Slot
    started: float
    stage_s: float
    gen: int
    slot_wait_s: float = 0.0
    ram: bool = False  # memory-only: its RAM copy is all there will be


class Book:
    """Shared state of one writer; see the module docstring for the lock."""

    def __init__(self, on_reader: Callable[[], bool], keep_last: bool = False,
                 remote: bool = False) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.on_reader = on_reader  # given to each handle: no wait inside a done-callback
        # keep_last: the files written and not yet rotated away, oldest first, so
        # a restarted sidecar goes on rotating the series an earlier one began
        self.kept: list[str] | None = [] if keep_last else None
        self.remote = remote
        self.pending: dict[int, Pending] = {}
        # written locally, remote copy not yet reported: seq -> (handle, sidecar gen)
        self.uploading: dict[int, tuple[WriteHandle, int]] = {}
        self.dirs: set[str] = set()  # made already: see make_dir
        self.seq = 0
        self.active = 0          # submits past the open check, not yet queued or failed
        self.broken: BrokenWriterError | None = None
        self.closing = False
        self.closed = False
        self.counts = {"submitted": 0, "written": 0, "skipped": 0, "failed": 0,
                       "broken": 0, "restarts": 0, "bytes": 0, "staged_bytes": 0,
                       "uploaded": 0, "upload_failed": 0}
        self.stalls: deque[float] = deque(maxlen=10_000)
        # the memory-only snapshots held for this writer, the newest ``ram_keep`` of each
        # series (the sidecar's keep_in_memory): what a dead service's successor adopts
        self.in_ram: dict[tuple[str, str, str], list[str]] = {}
        self.ram_keep = 1

    def make_dir(self, directory: str) -> None:
        """Make a checkpoint's directory, once per writer (submit's hot path
        skips the ``makedirs`` system calls after the first)."""
        with self.cond:
            if directory in self.dirs:
                return
        os.makedirs(directory, exist_ok=True)
        with self.cond:
            self.dirs.add(directory)

    def check_open(self) -> None:
        """Raise if closing (cond held)."""
        if self.closing or self.closed:
            raise WriterClosedError("this SnapshotWriter is closed; make a new one")

    def wait_until(self, ready: Callable[[], bool], timeout: float | None, what: str) -> None:
        """Wait on ``cond`` for ``ready()``; the sidecar's death ends it too."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while not ready():
                if self.broken is not None:
                    return
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"{what} after {timeout} s")
                self.cond.wait(0.5 if left is None else min(left, 0.5))

    def add(self, slot: Slot, path: str, started: float, stage_s: float, gen: int,
            slot_wait_s: float = 0.0, ram: bool = False) -> int:
        """Book a staged write (cond held); its seq."""
        self.seq += 1
        self.counts["submitted"] += 1  # refused submits never get this far
        slot.seq = self.seq
        handle = WriteHandle(self.seq, path, self.on_reader, remote=self.remote)
        self.pending[self.seq] = Pending(handle, slot, started, stage_s, gen, slot_wait_s, ram)
        return self.seq

    def durable(self, path: str, gen: int) -> WriteHandle:
        """A handle for uploading ``path``, durable already (cond held): its
        ``result()`` is resolved; its ``uploaded()`` waits for an UPLOADED report
        from the sidecar of generation ``gen``, or fails with it."""
        self.seq += 1
        handle = WriteHandle(self.seq, path, self.on_reader, remote=True)
        handle._future.set_result(WriteReport(path=path, seq=handle.seq))
        if self.broken is not None:  # book.lose has run for that sidecar already
            handle.fail_upload(f"not uploaded: {self.broken}")
        else:
            self.uploading[handle.seq] = (handle, gen)
        return handle

    def skipped(self, path: str, started: float) -> WriteHandle:
        """A handle already resolved as skipped (policy "skip" found no slot)."""
        stall = time.monotonic() - started
        with self.cond:
            self.seq += 1
            handle = WriteHandle(self.seq, path, self.on_reader, remote=self.remote)
            self.counts["submitted"] += 1
            self.counts["skipped"] += 1
            self.stalls.append(stall)
        handle._future.set_result(WriteReport(path=path, skipped=True, stage_s=stall,
                                              total_s=stall, seq=handle.seq))
        return handle

    def report(self, gen: int, msg: dict[str, Any], slot_of: Callable[[int], Slot | None]) -> None:
        """One report from the sidecar of generation ``gen`` (reader thread)."""
        op = msg["op"]
        if op == protocol.SLOT_OK:
            with self.cond:
                slot = slot_of(msg["slot"])
                if slot is not None:
                    slot.gen = gen
                self.cond.notify_all()
        elif op == protocol.DONE:
            self.resolve(msg)
        elif op == protocol.UPLOADED:
            self.upload_done(msg)
        else:
            log.error("unexpected message from the writer: %r", op)

    def resolve(self, msg: dict[str, Any]) -> None:
        """A DONE report from the sidecar (reader thread)."""
        with self.cond:
            p = self.pending.pop(msg["seq"], None)
            if p is None:  # superseded under "latest": already resolved at submit
                return
            p.slot.seq = None
            ok = msg["ok"]
            skipped = ok and msg.get("superseded", False)
            ram = ok and not skipped and msg.get("ram", False)  # memory-only: no file, no upload
            self.counts["skipped" if skipped else "written" if ok else "failed"] += 1
            self.counts["bytes"] += msg.get("bytes", 0) if ok else 0
            if self.kept is not None and ok and not skipped and not ram:
                gone = {msg["path"], *msg.get("removed", ())}
                self.kept = [k for k in self.kept if k not in gone] + [msg["path"]]
            if ram:
                self.note_ram(msg["path"])
            if self.remote and ok and not skipped and not ram:  # outcome: an UPLOADED report
                self.uploading[msg["seq"]] = (p.handle, p.gen)
            self.cond.notify_all()
        if ok:
            p.handle._future.set_result(WriteReport(
                path=msg["path"], bytes=msg.get("bytes", 0), entries=msg.get("entries", 0),
                skipped=skipped, stage_s=p.stage_s, slot_wait_s=p.slot_wait_s,
                queue_s=msg["queue_s"],
                encode_s=msg.get("encode_s", 0.0), write_s=msg.get("write_s", 0.0),
                fsync_s=msg.get("fsync_s", 0.0), total_s=time.monotonic() - p.started,
                seq=msg["seq"], in_memory=ram))
            if ram and self.remote:
                p.handle.fail_upload("a memory-only snapshot (persist=False) is not uploaded",
                                     skipped=True)
        else:
            p.handle._future.set_exception(WriteFailedError(
                msg["errno"] or 0, f"{msg['error']} (writing checkpoint)", msg["filename"]))

    def note_ram(self, path: str) -> None:
        """``path`` is held in RAM for this writer (under ``cond``)."""
        mine = self.in_ram.setdefault(ram_series(path), [])
        if path in mine:
            mine.remove(path)
        mine.append(path)
        mine[:-1] = [p for p in mine[:-1] if held(p) is not None]   # dropped by their trainer
        del mine[:-self.ram_keep]

    def upload_done(self, msg: dict[str, Any]) -> None:
        """An UPLOADED report (reader thread); seq None: found at the sidecar's start."""
        if msg["seq"] is None:
            if msg["error"] is None:
                log.info("uploaded %s (durable locally before the restart)", msg["url"])
            return  # the sidecar logged the failure
        with self.cond:
            entry = self.uploading.pop(msg["seq"], None)
            if entry is None:  # already failed with its writer's exit
                return
            self.counts["uploaded" if msg["error"] is None else "upload_failed"] += 1
            self.cond.notify_all()
        if msg["error"] is None:
            entry[0]._upload.set_result(msg["url"])
        else:
            entry[0].fail_upload(msg["error"], skipped=msg.get("skipped", False))

    def lose(self, gen: int, proc: Any, current: int) -> None:
        """The sidecar of generation ``gen`` exited (reader thread): fail what it held."""
        with self.cond:
            failed = [p for p in self.pending.values() if p.gen == gen]
            orderly = self.closing or self.closed  # any other exit is a death
            err = BrokenWriterError(f"the writer sidecar {describe(proc)}; "
                                    f"{len(failed)} pending write(s) lost to it")
            if (not orderly or failed) and gen == current:
                self.broken = err
            for p in failed:
                del self.pending[p.handle.seq]
                if not p.slot.copying:  # else the copier frees it when done
                    p.slot.seq = None
            self.counts["broken"] += len(failed)
            unsent = [h for s, (h, g) in list(self.uploading.items()) if g == gen
                      and self.uploading.pop(s)]
            self.counts["upload_failed"] += len(unsent)
            self.cond.notify_all()
        if failed:
            log.error("%s: %s", err, ", ".join(p.handle.path for p in failed))
        for p in failed:
            p.handle._future.set_exception(err)
        if unsent:
            log.error("not uploaded before the writer sidecar stopped (%s); a restarted writer "
                      "uploads them from the local tier: %s", describe(proc),
                      ", ".join(h.path for h in unsent))
        for h in unsent:
            h.fail_upload(f"not uploaded: the writer sidecar {describe(proc)} before the "
                            "upload committed; a writer started on this directory uploads it")

    def figures(self) -> tuple[dict[str, int], int, list[float]]:
        """(counts, pending writes, sorted stalls); cond held."""
        return dict(self.counts), len(self.pending), sorted(self.stalls)


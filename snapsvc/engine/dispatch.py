"""From a reserved slot to the sidecar: copy, book the write, send WRITE.

::

    stage(pool, sources)  -> broker.register + broker.acquire   (slots.py)
      | copier.stage: copy sources -> slot                     (copier.py)
      | book.add: seq, pending handle                          (book.py)
      | blocking: send now;  overlap: the copier thread finishes the copy,
      v           then sends                                    (send below)
    send: claim[k] = seq under the claim lock, then {WRITE seq, k, path, body,
          and the slot's layout if the sidecar last heard another for it: only
          its names where that one placed every tensor where this one does}
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from ..errors import BrokenWriterError
from ..files.durable import current_umask
from ..format import protocol
from .book import Book
from .copier import Copier
from .handles import WriteHandle
from .pools import ROOM, Plan, Pool, Slot, SlotPools
from .link import Sidecar
from .slots import SlotBroker
from ..state.tree import check_plain
from .plan import Request, find_pool, pack_body, request

__all__ = ["Dispatcher", "Held", "using", "hold", "send_held", "release_held"]


@dataclass
class Held:
    """A slot :meth:`Dispatcher.take` reserved and filled, not yet sent (``rest``:
    the copy's remainder in overlap mode)."""

    pool: Pool
    slot: Slot
    gen: int
    rest: Callable[[], None] | None
    started: float
    stage_s: float
    slot_wait_s: float
    tree: Any = None     # the state tree of its metadata
    info: Any = None     # what the caller keeps with it (the distributed writer: its records)
    done: bool = False   # booked or given back: the slot is no longer this copy's


class Dispatcher:
    """Stages a submit into a slot and queues it for the sidecar."""

    def __init__(self, book: Book, sidecar: Sidecar, broker: SlotBroker, copier: Copier,
                 overlap: bool, pools: SlotPools) -> None:
        self.pools = pools  # their memory_limit bounds memory-only snapshots (SlotBroker.acquire)
        self.book = book
        self.sidecar = sidecar
        self.broker = broker
        self.copier = copier
        self.overlap = overlap
        self._order = threading.Lock()

    def stage(self, pool: Pool, sources: list[torch.Tensor], plan: Plan | None, path: str,
              body: bytes, started: float, timeout: float | None,
              persist: bool = True) -> WriteHandle:
        """Take a slot, copy into it, book the write and send it (or have the copier send it)."""
        # a memory-only snapshot's RAM copy: its tensors, metadata and headers (ROOM)
        ram = 0 if persist else pool.layout.nbytes + len(body) + ROOM
        held = self.take(pool, sources, plan, started, timeout, ram)
        if held is None:
            return self.book.skipped(path, started)
        return self.queue(held, path, body, persist)

    def take(self, pool: Pool, sources: list[torch.Tensor], plan: Plan | None, started: float,
             timeout: float | None, ram: int = 0) -> Held | None:
        """Reserve a slot of ``pool`` and copy ``sources`` into it (None: policy "skip"
        found none). The slot stays reserved until :meth:`queue` or :meth:`release`.
        ``ram``: the bytes a memory-only copy will hold, counted against memory_limit."""
        gen = self.broker.register(pool, timeout)
        asked = time.monotonic()
        slot = self.broker.acquire(pool, timeout, ram, self.pools)
        slot_wait_s = time.monotonic() - asked
        if slot is None:
            return None
        try:
            slot.copying = self.overlap
            rest, copied = self.copier.stage(slot, sources, plan)
        except BaseException:
            self.broker.free(slot)
            raise
        stage_s = time.monotonic() - started
        with self.book.cond:
            self.book.counts["staged_bytes"] += copied
            self.book.stalls.append(stage_s)
        return Held(pool, slot, gen, rest, started, stage_s, slot_wait_s)

    def queue(self, held: Held, path: str, body: bytes, persist: bool = True) -> WriteHandle:
        """Book the write of a slot :meth:`take` filled and send it to the sidecar."""
        book, slot, gen = self.book, held.slot, held.gen
        with book.cond:
            assert not held.done, "a held copy is sent once"
            held.done = True
            if book.broken is not None or self.sidecar.gen != gen or book.closed:
                # died (or was restarted, or closed at its timeout) while we copied:
                # nobody would resolve it, and the slot may hold half a copy
                slot.seq = None
                slot.copying = False
                slot.held = None
                book.cond.notify_all()
                raise book.broken or BrokenWriterError(
                    "the writer sidecar stopped while this snapshot was copied; submit again")
            seq = book.add(slot, path, held.started, held.stage_s, gen, held.slot_wait_s,
                           not persist)
            handle = book.pending[seq].handle
        msg = {"path": path, "body": body, "umask": current_umask()}  # the files' mode of now
        if not persist:  # the sidecar holds it in the RAM tier (snapsvc.files.ramtier)
            msg["ram"] = True
        if held.rest is None:
            self.send(slot, seq, msg)
        else:
            self.copier.later(self._finish_copy, held.rest, slot, seq, msg)
        return handle

    def release(self, held: Held) -> None:
        """Give back the slot of a copy that will not be written (once; no-op after queue)."""
        with self.book.cond:
            if held.done:
                return
            held.done = True
        self.broker.free(held.slot)

    def send(self, slot: Slot, seq: int, msg: dict[str, Any]) -> None:
        """The slot holds the snapshot: let the writer claim it, then tell it.

        If the sidecar is gone (dead, or reaped by a close that timed out),
        the handle fails here, unless the reader thread already failed it.
        A signal (Ctrl-C, SIGTERM) before the WRITE is posted drops the write
        and frees its slot; once posted, the message goes out whole and is
        written, whatever interrupts the wait for it (see :mod:`.link`).
        """
        job = None
        try:
            lock = self.sidecar.claim_lock
            if lock is not None:
                # One post at a time, so the sidecar hears each slot's layouts in
                # the order ``slot.told`` records them.
                with self._order:
                    with lock:
                        slot.claim.fill_(seq)
                    told = (self.sidecar.gen, slot.layout)
                    if slot.told is None or slot.told[0] != told[0] \
                            or not slot.told[1].placed_like(told[1]):
                        msg = {**msg, "layout": told[1].to_msg()}
                    elif slot.told[1] is not told[1]:   # new headers, the tensor bytes in place
                        msg = {**msg, "renamed": told[1].renamed_msg()}
                    job = self.sidecar.post(protocol.pack(protocol.WRITE, seq=seq, slot=slot.id,
                                                          sent_at=time.monotonic(), **msg))
                    if job is not None:
                        slot.told = told
            if job is not None and job.wait():
                return
        except BaseException:
            if job is None:  # never posted: nobody would resolve it
                self._drop(slot, seq, None)
            raise
        self._drop(slot, seq, BrokenWriterError(
            "the writer sidecar is gone (closed or dead); this snapshot was not written"))

    def _drop(self, slot: Slot, seq: int, err: BaseException | None) -> None:
        """Fail a booked write the sidecar never heard of (``err`` None: interrupted, free its slot)."""
        book = self.book
        with book.cond:
            p = book.pending.pop(seq, None)
            if p is not None:
                slot.seq = None
                book.counts["broken" if err is not None else "failed"] += 1
                book.cond.notify_all()
            if err is not None:
                err = book.broken or err
        if err is None:
            self.broker.free(slot)
            err = BrokenWriterError("this submit was interrupted before its snapshot "
                                    "reached the writer; it was not written")
        if p is not None:
            p.handle._future.set_exception(err)

    def _finish_copy(self, rest: Callable[[], None], slot: Slot, seq: int,
                     msg: dict[str, Any]) -> None:
        """Overlap mode, on the copier thread: complete the copy, then send."""
        book = self.book
        try:
            rest()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's handle
            with book.cond:
                p = book.pending.pop(seq, None)
                if p is not None:
                    book.counts["failed"] += 1
            self.broker.free(slot)
            if p is not None:
                p.handle._future.set_exception(e)
            return
        with book.cond:
            slot.copying = False
            p = book.pending.get(seq)
            if p is None or p.gen != self.sidecar.gen:  # the writer died; handle failed
                slot.seq = None
                book.cond.notify_all()
                return
            book.cond.notify_all()
        self.send(slot, seq, msg)


# -- a copy held in a slot, sent later ---------------------------------------------------
# DCP's AsyncStager.stage() copies the state before the save knows where it goes (the
# checkpoint id comes with the save): hold() takes a slot and copies into it (the same
# pools, kept walks and copier as submit) and keeps it reserved; send_held() books and
# sends the write once the path is known; release_held() gives the slot back when the
# save is abandoned (snapsvc.dcp). ``writer`` is a SnapshotWriter (not imported: it imports this).

@contextmanager
def using(writer: Any, req: Request
          ) -> Iterator[tuple[Pool, list[torch.Tensor], Plan | None]]:
    """The pool, copy sources and plan of ``req`` for ``writer``, the pool kept (and
    counted active) while the caller copies."""
    writer._life.ensure_running()
    book = writer._book
    gone: list[Slot] = []
    try:
        with book.cond:
            book.check_open()
            try:
                pool, sources, plan = find_pool(writer._pools, req)
            finally:  # a refused layout may have released idle pools first
                gone = writer._pools.take_released()
            pool.users += 1  # not trimmed while this submit uses it
            book.active += 1
    finally:
        if gone:  # the sidecar unmaps them; their memory is freed on both sides
            writer._sidecar.send(protocol.pack(protocol.FREE, slots=[s.id for s in gone]))
    try:
        yield pool, sources, plan
    finally:
        with book.cond:
            book.active -= 1
            pool.users -= 1
            if book.closed and not book.active:  # close() timed out while we copied
                writer._pools.clear()
            book.cond.notify_all()


def hold(writer: Any, state: Any, timeout: float | None = None) -> Held:
    """Copy the tensors of ``state`` (a state mapping, or a :class:`~snapsvc.state.tree.Flat`)
    into a slot of ``writer`` and keep it reserved, unsent."""
    started = time.monotonic()
    writer._check_caller("stage")
    if writer.overlap or writer.policy != "block":
        raise ValueError("a held copy needs a writer with overlap=False and policy='block'")
    with writer._book.cond:
        writer._book.check_open()
    req = request(state, None, None, writer._pools.memo)
    with using(writer, req) as (pool, sources, plan):
        held = writer._dispatch.take(pool, sources, plan, started, timeout)
    assert held is not None   # policy "block" waits for a slot, or raises
    held.tree = req.tree
    return held


def send_held(writer: Any, held: Held, path: str | os.PathLike[str],
              extra: Any = None) -> WriteHandle:
    """Write the slot :func:`hold` filled to ``path`` (``extra``: plain data for its
    metadata); the slot is given back if this raises before sending."""
    try:
        writer._check_caller("submit")
        full = writer._resolve(path)
        body = pack_body(full, held.pool.buffer_bytes, False, epoch=0, metrics={},
                         extra=check_plain(extra, "extra"), optim=None, state=held.tree,
                         extra_state=None)
    except BaseException:
        release_held(writer, held)
        raise
    return writer._dispatch.queue(held, full, body)


def release_held(writer: Any, held: Held) -> None:
    """Give back the slot of a held copy that will not be written (a no-op once sent)."""
    writer._dispatch.release(held)

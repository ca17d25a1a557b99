"""Taking a slot for a submit: hand the pool to the sidecar, then pick a free slot.

A pool's shared memory is registered with the current sidecar once per
generation (all its slots at once, while the sidecar is likely idle: it
maps them in queue order). A free slot is then reserved by the writer's
policy when all are busy: ``"block"`` waits, ``"skip"`` gives up,
``"latest"`` takes back the newest queued, unstarted snapshot's slot (a
memory-only submit never takes a persisted one's). Under ``memory_limit`` a
memory-only submit also needs room for its RAM copy; while slots in flight
take it, the same policy applies. A pool
may hold slots it took busy from pools of other layouts (names that changed,
see :mod:`.pools`): the policy treats them as its own, and a slot is laid
out for the pool's layout once reserved.
"""

from __future__ import annotations

import time

from ..errors import BrokenWriterError
from ..format import protocol
from .book import Book, Pending
from .handles import WriteReport
from .pools import RESERVED, Pool, Slot, SlotPools
from .link import Sidecar
from .staging import slot_fd
from ..format.claims import REVOKED

__all__ = ["SlotBroker"]


class SlotBroker:
    """Registers pools with the sidecar and reserves their slots (see module docstring)."""

    def __init__(self, book: Book, sidecar: Sidecar, policy: str) -> None:
        self.book = book
        self.sidecar = sidecar
        self.policy = policy

    def register(self, pool: list[Slot], timeout: float | None) -> int:
        """Hand a pool's shared memory to the current sidecar; its generation."""
        book, sidecar = self.book, self.sidecar
        with book.cond:
            gen = sidecar.gen
            todo = [s for s in pool if s.gen != gen and s.registering != gen]
            for slot in todo:
                slot.registering = gen  # another thread submitting it now waits instead
                slot.told = (gen, slot.layout)  # the SLOT message carries it
        posted = []
        try:   # exactly the layout told: a WRITE may send only new names
            for slot in todo:
                assert slot.told is not None   # set above; never reset to None
                posted.append(sidecar.post(protocol.pack(protocol.SLOT, slot=slot.id,
                                                         layout=slot.told[1].to_msg()),
                                           slot_fd(slot.flat)))
        finally:  # a signal before a slot was posted: the next submit registers it again
            if len(posted) < len(todo):
                with book.cond:
                    for slot in todo[len(posted):]:
                        slot.registering = -1
        if not all(job is not None and job.wait() for job in posted):
            sidecar.join_reader(5)  # it sees the death and sets broken
        # Wait until the writer has mapped them: until then their fds live only
        # in this process, and a submit must not depend on it staying alive.
        book.wait_until(lambda: all(s.gen == gen for s in pool) or book.closed
                        or sidecar.gen != gen, timeout,
                        "the writer sidecar has not mapped the slots")
        with book.cond:
            if book.broken is not None:
                raise book.broken
            if sidecar.gen != gen or book.closed:
                raise BrokenWriterError("the writer sidecar restarted or closed while this "
                                        "submit handed it its slots; submit again")
        return gen

    def acquire(self, pool: Pool, timeout: float | None, ram: int = 0,
                pools: SlotPools | None = None) -> Slot | None:
        """A free slot of ``pool``, reserved for the caller, by the policy. ``ram``: the
        bytes of a memory-only snapshot's RAM copy, which must fit in ``pools``'
        ``memory_limit`` beside the slots (else the policy applies, as for a full pool)."""
        book = self.book
        deadline = None if timeout is None else time.monotonic() + timeout
        revoked = None
        with book.cond:
            while True:
                if book.broken is not None:
                    raise book.broken
                book.check_open()
                room = pools is None or pools.room_for_copy(pool, ram)
                slot = next((s for s in pool if s.seq is None and not s.copying), None) \
                    if room else None
                if slot is None and room and self.policy == "latest":
                    slot, revoked = self._revoke_newest(pool, bool(ram))
                if slot is not None:
                    slot.seq = RESERVED
                    pool.take(slot)
                    break
                if self.policy == "skip":
                    return None
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    if not room and pools is not None:
                        raise TimeoutError(
                            f"no room for this memory-only snapshot within {timeout} s: "
                            f"memory_limit={pools.memory_limit} is taken by slots of snapshots "
                            "still in flight; give submit a longer timeout, raise memory_limit "
                            "or persist it")
                    raise TimeoutError(f"no free slot within {timeout} s: the {len(pool)} slots "
                                       "that hold this snapshot are still being written; "
                                       "give submit a longer timeout or the writer more slots")
                book.cond.wait(0.5 if left is None else min(left, 0.5))
        if revoked is not None:
            revoked.handle._future.set_result(WriteReport(
                path=revoked.handle.path, skipped=True, stage_s=revoked.stage_s,
                total_s=time.monotonic() - revoked.started, seq=revoked.handle.seq))
        return slot

    def _revoke_newest(self, pool: Pool, memory_only: bool) -> tuple[Slot | None, Pending | None]:
        """Take back the newest queued, unstarted snapshot's slot (cond held): of this
        pool's layout, or of one placed like it (the same checkpoint, its names
        changed), never another model's, which "latest" does not supersede. For a
        ``memory_only`` snapshot, only a memory-only one: a snapshot on its way to
        disk is never dropped for one that would live in RAM only (it waits instead)."""
        pending = self.book.pending
        mine = [s for s in pool if s.seq and (s.layout is pool.layout
                                              or s.layout.placed_like(pool.layout))
                and not (memory_only and s.seq in pending and not pending[s.seq].ram)]
        lock = self.sidecar.claim_lock
        if lock is None:  # no live sidecar: nothing queued there to take back
            return None, None
        for slot in sorted(mine, key=lambda s: s.seq, reverse=True):
            if slot.copying:
                continue
            with lock:
                if int(slot.claim.item()) != slot.seq:
                    continue  # the writer already started it
                slot.claim.fill_(REVOKED)
            old = self.book.pending.pop(slot.seq)
            self.book.counts["skipped"] += 1
            return slot, old
        return None, None

    def free(self, slot: Slot) -> None:
        """Give back a slot whose copy did not complete (its contents are unknown)."""
        with self.book.cond:
            slot.seq = None
            slot.copying = False
            slot.held = None
            self.book.cond.notify_all()

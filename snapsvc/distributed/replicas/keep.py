"""Which steps a rank keeps in RAM with replicas: its own copies and the replicas it holds.

Eviction follows what the world agreed, never a count of writes: a step
becomes *complete* when it is committed and every replica of it was placed
(learnt at the next commit exchange, the same answer on every rank).
Once step N is complete, the RAM copies (this rank's own memory-only files
and the replicas it holds) of steps older than the ``keep``-th newest complete
step go. So the newest complete step is never dropped for a newer step still
being written, committed or replicated.

``memory_limit`` bounds a node's share: this rank's own RAM copies plus the
replicas it holds plus an incoming one. A holder short of room drops the
copies of steps older than the newest complete one first, oldest first; if the
replica still does not fit it refuses it (the origin's ``replicated()`` names
the holder and the limit, and the next step goes to another node).

Spares: a replica dropped by age leaves its files' pages behind, renamed into
a spare folder of the holder's RAM tier, and the next replica is received
into them: a transfer into fresh tmpfs pages costs one page fault and a
zeroed page per 4 KiB, about twice the copy itself. At most :data:`SPARES`
files are kept; ``memory_limit`` counts them and drops them first; a clean
close, and the next writer of the rank, drop them.
"""

from __future__ import annotations

import itertools
import logging
import os

from ...files.metafile import checkpoint_names, meta_path
from ...files.ramtier import claim, drop, held, ram_path, size_of, tidy
from ..manifest import step_dir, step_number
from .send import held_by

__all__ = ["Keeper"]

log = logging.getLogger("snapsvc")

SPARES = 4            # spare files a holder keeps for the next replicas
_MIN_SPARE = 64 << 10  # smaller files are not worth keeping
_names = itertools.count()


class Keeper:
    """One rank's RAM copies of a distributed writer's steps, dropped as they age out."""

    def __init__(self, directory: str, rank: int, world_size: int, keep: int,
                 memory_limit: int | None) -> None:
        self.directory = directory
        self.rank = rank
        self.world_size = world_size
        self.keep = keep
        self.memory_limit = memory_limit
        self.complete: list[int] = []   # steps complete in RAM, agreed, oldest first
        self.seen: set[int] = set()   # steps replicated here: their folders may be deleted
        self.clear_spares()   # an earlier trainer's of this rank: they are not counted

    def _steps(self) -> list[int]:
        """The steps this rank may hold copies of: those in the directory, and those
        replicated here (a user may delete a step's folder; its RAM copies stay ours)."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            names = []
        return sorted(self.seen.union(n for n in map(step_number, names) if n is not None))

    def copies(self, step: int) -> list[str]:
        """The RAM copies this rank holds of ``step``: its own file's, then replicas."""
        out = []
        for name in (f"rank{self.rank}.fdl", f"rank{self.rank}.fdl.gz"):
            own = held(os.path.join(step_dir(self.directory, step), name))
            if own is not None:
                out.append(own)
        return out + list(held_by(self.directory, step, self.rank, self.world_size).values())

    def _drop_step(self, step: int, why: str, spare: bool = True) -> None:
        own = len(self.copies(step)) - len(held_by(self.directory, step, self.rank,
                                                   self.world_size))
        for i, ram in enumerate(self.copies(step)):
            log.debug("snapsvc: rank %d drops %s (%s)", self.rank, ram, why)
            if spare and i >= own:   # a replica: its pages for the next one
                self._recycle(ram)
            drop(ram)

    # -- spares ------------------------------------------------------------------
    def _spare_folder(self, create: bool = False) -> str | None:
        path = os.path.join(self.directory, ".replicas-spare", f"held-by-{self.rank}", "x")
        ram = ram_path(path, create=create)
        if ram is not None and create:  # ours while we live; a killed holder's: swept
            claim(ram, path)
        return None if ram is None else os.path.dirname(ram)

    def spares(self) -> list[str]:
        """The spare files, largest first."""
        folder = self._spare_folder()
        if folder is None or not os.path.isdir(folder):
            return []
        paths = [os.path.join(folder, n) for n in os.listdir(folder) if not n.startswith(".")]
        return sorted(paths, key=lambda p: -os.path.getsize(p))

    def _recycle(self, ram: str) -> None:
        """The dropped replica ``ram``'s files into the spares (metadata removed first:
        the copy is no longer whole)."""
        try:
            os.unlink(meta_path(ram))
        except FileNotFoundError:
            return
        folder = self._spare_folder(create=True)
        for p in checkpoint_names(ram):
            if folder is not None and os.path.exists(p) and os.path.getsize(p) >= _MIN_SPARE:
                os.replace(p, os.path.join(folder, f"spare{os.getpid()}-{next(_names)}"))
        for extra in self.spares()[SPARES:]:
            os.unlink(extra)

    def take_spare(self, n: int) -> str | None:
        """A spare file for ``n`` bytes (the smallest as large, else the largest),
        no longer a spare; None when there is none."""
        spares = self.spares()
        fit = [p for p in spares if os.path.getsize(p) >= n]
        return (fit[-1] if fit else spares[0]) if spares and n >= _MIN_SPARE else None

    def clear_spares(self) -> None:
        """Drop every spare; the folder and this process's mark go with the last."""
        for p in self.spares():
            drop(p)
        folder = self._spare_folder()
        if folder is not None and os.path.isdir(folder):
            tidy(folder)  # no spare left (all taken): tidied all the same

    def completed(self, step: int) -> None:
        """``step`` is complete in RAM (every rank calls this, for the same steps):
        the copies of steps older than the ``keep`` newest complete ones go."""
        self.seen.add(step)
        if step not in self.complete:
            self.complete.append(step)
            self.complete.sort()
        del self.complete[:-self.keep]
        floor = self.complete[0]
        for n in self._steps():
            if n >= floor:
                break
            self._drop_step(n, f"step {floor} and newer are complete in RAM")
            self.seen.discard(n)

    def room(self, incoming: int) -> str | None:
        """Make room for ``incoming`` bytes of replica under ``memory_limit``: None,
        or why it does not fit (after dropping what may go). Called before each
        receive, before the replica's folder is made."""
        if self.memory_limit is None:
            return None
        steps = self._steps()
        held_bytes = {n: sum(map(size_of, self.copies(n))) for n in steps}
        spares = sum(os.path.getsize(p) for p in self.spares())
        if sum(held_bytes.values()) + spares + incoming > self.memory_limit:
            self.clear_spares()   # room before any copy goes
        newest = self.complete[-1] if self.complete else None
        for n in steps:   # oldest first; never the newest complete step, nor newer ones
            if sum(held_bytes.values()) + incoming <= self.memory_limit:
                return None
            if newest is None or n >= newest:
                break
            log.warning("snapsvc: memory_limit=%d: rank %d drops its RAM copies of step %d "
                        "(older than step %d, the newest complete in RAM)", self.memory_limit,
                        self.rank, n, newest)
            self._drop_step(n, "memory_limit", spare=False)
            held_bytes[n] = 0
        used = sum(held_bytes.values())
        if used + incoming <= self.memory_limit:
            return None
        return (f"memory_limit={self.memory_limit} bytes: this rank holds {used} bytes of its "
                f"own RAM copies and replicas (none older than the newest step complete in "
                f"RAM) and the replica needs {incoming}; raise memory_limit on that rank")

    def reserve(self, received: list[int]) -> None:
        """Spare pages for the next round, reserved now, off the transfer's path: a
        file received into fresh tmpfs pages pays their allocation and zeroing, about
        twice the copy. A spare for each file this round received that no spare fits,
        within the keeper's count of spares and ``memory_limit`` (which drops spares
        before any copy)."""
        sizes = sorted((n for n in received if n >= _MIN_SPARE), reverse=True)
        have = sorted(os.path.getsize(p) for p in self.spares())
        need = []
        for n in sizes:
            fit = [s for s in have if s >= n]
            if fit:
                have.remove(fit[0])
            else:
                need.append(n)
        limit = self.memory_limit
        used = None if limit is None else sum(
            size_of(c) for n in self._steps() for c in self.copies(n))
        spares = self.spares()
        for n in need[:max(0, SPARES - len(spares))]:
            total = None if used is None else used + sum(map(os.path.getsize, spares)) + n
            if limit is not None and total is not None and total > limit:
                return
            folder = self._spare_folder(create=True)
            if folder is None:
                return
            path = os.path.join(folder, f"ready{os.getpid()}-{next(_names)}")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                os.posix_fallocate(fd, 0, n)
            except OSError as e:   # a full tmpfs: the next replica's receive finds out
                os.unlink(path)
                log.debug("snapsvc: no spare of %d bytes: %s", n, e)
                return
            finally:
                os.close(fd)
            spares.append(path)

"""Which steps a rank keeps in RAM with replicas: its own copies and the replicas it holds.

Eviction follows what the world agreed, never a count of writes: a step
becomes *complete* when it is committed and every replica of it was placed
(the replication round's closing exchange, the same answer on every rank).
Once step N is complete, the RAM copies (this rank's own memory-only files
and the replicas it holds) of steps older than the ``keep``-th newest complete
step go. So the newest complete step is never dropped for a newer step still
being written, committed or replicated.

``memory_limit`` bounds a node's share: this rank's own RAM copies plus the
replicas it holds plus an incoming one. A holder short of room drops the
copies of steps older than the newest complete one first, oldest first; if the
replica still does not fit it refuses it (the origin's ``replicated()`` names
the holder and the limit, and the next step goes to another node).
"""

from __future__ import annotations

import logging
import os

from ...files.metafile import checkpoint_names
from ...files.ramtier import drop, held
from ..manifest import step_dir, step_number
from .send import held_by

__all__ = ["Keeper"]

log = logging.getLogger("snapsvc")


def _bytes(ram: str) -> int:
    total = 0
    for p in checkpoint_names(ram):
        try:
            total += os.stat(p).st_size
        except FileNotFoundError:
            pass
    return total


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

    def _steps(self) -> list[int]:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        return sorted(n for n in map(step_number, names) if n is not None)

    def copies(self, step: int) -> list[str]:
        """The RAM copies this rank holds of ``step``: its own file's, then replicas."""
        out = []
        for name in (f"rank{self.rank}.fdl", f"rank{self.rank}.fdl.gz"):
            own = held(os.path.join(step_dir(self.directory, step), name))
            if own is not None:
                out.append(own)
        return out + list(held_by(self.directory, step, self.rank, self.world_size).values())

    def _drop_step(self, step: int, why: str) -> None:
        for ram in self.copies(step):
            log.debug("snapsvc: rank %d drops %s (%s)", self.rank, ram, why)
            drop(ram)

    def completed(self, step: int) -> None:
        """``step`` is complete in RAM (every rank calls this, for the same steps):
        the copies of steps older than the ``keep`` newest complete ones go."""
        if step not in self.complete:
            self.complete.append(step)
            self.complete.sort()
        del self.complete[:-self.keep]
        floor = self.complete[0]
        for n in self._steps():
            if n >= floor:
                break
            self._drop_step(n, f"step {floor} and newer are complete in RAM")

    def room(self, incoming: int) -> str | None:
        """Make room for ``incoming`` bytes of replica under ``memory_limit``: None,
        or why it does not fit (after dropping what may go)."""
        if self.memory_limit is None:
            return None
        steps = self._steps()
        held_bytes = {n: sum(map(_bytes, self.copies(n))) for n in steps}
        newest = self.complete[-1] if self.complete else None
        for n in steps:   # oldest first; never the newest complete step, nor newer ones
            if sum(held_bytes.values()) + incoming <= self.memory_limit:
                return None
            if newest is None or n >= newest:
                break
            log.warning("snapsvc: memory_limit=%d: rank %d drops its RAM copies of step %d "
                        "(older than step %d, the newest complete in RAM)", self.memory_limit,
                        self.rank, n, newest)
            self._drop_step(n, "memory_limit")
            held_bytes[n] = 0
        used = sum(held_bytes.values())
        if used + incoming <= self.memory_limit:
            return None
        return (f"memory_limit={self.memory_limit} bytes: this rank holds {used} bytes of its "
                f"own RAM copies and replicas (none older than the newest step complete in "
                f"RAM) and the replica needs {incoming}; raise memory_limit on that rank")

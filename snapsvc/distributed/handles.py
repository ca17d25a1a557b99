"""What ``DistributedSnapshotWriter.submit`` returns, and what its coordinator queues."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Any, Mapping

from ..engine.handles import WriteHandle, WriteReport

__all__ = ["DistributedWriteReport", "DistributedWriteHandle"]


@dataclass
class DistributedWriteReport(WriteReport):
    """A committed multi-rank checkpoint, as one rank sees it.

    ``path`` is the step directory; ``file`` is this rank's file in it.
    ``bytes``, ``entries`` and the timings up to ``fsync_s`` are this rank's
    write; ``coord_s`` is the exchange and manifest; ``total_s`` runs from
    submit() to the handle resolving.
    """

    step: int = 0
    file: str = ""
    manifest: str = ""
    rank: int = 0
    world_size: int = 1
    total_bytes: int = 0    # every rank's files together
    coord_s: float = 0.0


class DistributedWriteHandle(WriteHandle):
    """A pending multi-rank checkpoint; ``result()`` is a :class:`DistributedWriteReport`.

    It resolves on every rank only after rank 0 committed the manifest, or
    fails on every rank with :class:`DistributedCheckpointError`. With a remote
    tier, :meth:`uploaded` returns the step's remote URL on every rank once rank
    0 committed the remote manifest (after every rank's upload), or raises
    :class:`~snapsvc.errors.UploadError` on every rank. With ``replicas``,
    :meth:`replicated` waits for this rank's copies in its peers' RAM.
    """

    def __init__(self, seq: int, path: str, step: int, rank: int, file: str, *,
                 remote: bool = False, replicas: bool = False) -> None:
        super().__init__(seq, path, remote=remote)
        self.step = step
        self.rank = rank
        self.file = file
        self.local: WriteHandle | None = None   # this rank's SnapshotWriter handle
        # this rank's replicas: the ranks holding them, or why they are not held
        self._replicas: "concurrent.futures.Future[list[int]]" = concurrent.futures.Future()
        if not replicas:
            self._replicas.set_result([])

    def replicated(self, timeout: float | None = None) -> list[int]:
        """Wait until every replica of this rank's snapshot is held in a peer's RAM
        (``replicas=k``); the ranks holding them ([] without replicas).

        ``TimeoutError`` after ``timeout`` seconds; a :class:`~snapsvc.errors.SnapsvcError`
        naming the peer when a replica could not be placed (or the step failed).
        """
        try:
            return self._replicas.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"step {self.step}: the replicas of rank {self.rank} were not "
                               f"held within {timeout} s") from None

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<DistributedWriteHandle step={self.step} rank={self.rank} {self.path!r} {state}>"


@dataclass
class _Item:
    handle: DistributedWriteHandle
    step: int
    started: float
    metrics: Mapping[str, float] | None
    epoch: int | None
    error: BaseException | None = None
    stage_s: float = 0.0
    records: list[dict[str, Any]] | None = None   # sharded: this rank's pieces, in file order
    sharded: dict[str, Any] | None = None         # sharded: the model's (or state's) description
    what: str = "model"                           # "model", "sharded model" or "state mapping"
    tree: Any = None                              # state: its tree, as the metadata holds it
    outline: list[str] | None = None              # state: its structure (state.paths.outline)
    digests: tuple[str, str] | None = None        # state: of the outline, of the whole tree
    persist: bool = True                          # False: memory-only (RAM manifest, RAM files)


def _settle(handle: WriteHandle, result: Any = None, exc: BaseException | None = None) -> None:
    if handle.done():
        return
    try:
        if exc is not None:
            handle._future.set_exception(exc)
        else:
            handle._future.set_result(result)
    except Exception:  # InvalidStateError: a racing close() settled it first
        pass

"""The restart tier on the trainer's side: attaching a new writer to a sidecar
that lingers after its trainer died, and ``persist_every``'s count."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from ..errors import UnsafePathError
from ..files.ramtier import series
from ..files.rendezvous import attach

__all__ = ["AttachReport", "Cadence", "take_over"]

log = logging.getLogger("snapsvc")


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

"""Attaching a new writer to a sidecar that lingers after its trainer died."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..errors import UnsafePathError
from ..files.rendezvous import attach

__all__ = ["AttachReport", "take_over"]

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

"""``verify_step``: check a multi-rank checkpoint as a whole, as ``snapsvc verify STEP_DIR`` does."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..errors import FormatError
from ..files.verify import VerifyReport, verify
from .manifest import MANIFEST_NAME, Manifest, _STEP_RE, _committed, read_manifest
from .pieces import _globals

__all__ = ["StepReport", "verify_step"]


@dataclass
class StepReport:
    """What :func:`verify_step` found: problems of the manifest itself, and each
    rank file's :class:`VerifyReport`. ``ok`` only when none has a problem."""

    path: str                       # the manifest file
    problems: list[str] = field(default_factory=list)
    manifest: Manifest | None = None
    ranks: list[VerifyReport] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and all(r.ok for r in self.ranks)

    def __str__(self) -> str:
        if self.problems:
            head = self.problems
        else:
            m = self.manifest
            assert m is not None
            kind = ", sharded" if m.sharded is not None else ""
            head = [f"{self.path}: OK (step {m.step}, {m.world_size} ranks{kind})"]
        return "\n".join(head + [str(r) for r in self.ranks])


def verify_step(path: str | os.PathLike[str]) -> StepReport:
    """Check a ``step_<N>`` directory (or its manifest): the manifest decodes and names
    this step, every rank's file, optimizer file and data file is whole (structure, size and CRC-32
    against its metadata, as :func:`snapsvc.verify`), and each rank's metadata records
    the size and CRC-32 the manifest committed. Never raises for a bad checkpoint."""
    path = os.path.abspath(os.fspath(path))
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    report = StepReport(os.path.join(directory, MANIFEST_NAME))
    try:
        m = read_manifest(directory)
        if m.sharded is not None:
            _globals(m)   # the entry tables restore and consolidate read
    except (FormatError, OSError) as e:
        report.problems.append(str(e))
        return report
    report.manifest = m
    named = _STEP_RE.match(os.path.basename(directory))
    if named and int(named.group(1)) != m.step:
        report.problems.append(f"{report.path}: names step {m.step}, in directory "
                               f"{os.path.basename(directory)}")
    for r in m.ranks:
        rank = verify(os.path.join(m.path, r.file))
        report.ranks.append(rank)
        if rank.meta is None:
            continue
        for _, name, in_meta, in_manifest in _committed(r, rank.meta):
            if in_meta != in_manifest:
                report.problems.append(
                    f"{os.path.join(m.path, name)}: its metadata records size {in_meta[0]} and "
                    f"CRC-32 {in_meta[1]}, the manifest {in_manifest[0]} and {in_manifest[1]}: "
                    "the file changed after the checkpoint was committed")
    return report

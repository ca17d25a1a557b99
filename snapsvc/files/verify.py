"""``verify``: is a checkpoint whole, and is it what its metadata says?

One pass over the file: every byte goes through a CRC-32 (the same one the
writer recorded in the metadata) while the ``.fdl`` structure is decoded
without keeping the data. CRC-32 catches every single-byte corruption and
every burst up to 32 bits; the size, entry count, buffer names and hash in
the metadata are compared too. Structure only, no tensors: no torch either
(:mod:`snapsvc.remote`, which the writer sidecar's uploader is part of, uses it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ..errors import FormatError
from ..format.framing import FDL, Decoder, Framing, Header
from ..format.streams import open_source
from .metafile import Meta, companions, file_framing, read_meta

__all__ = ["VerifyReport", "verify"]


@dataclass
class VerifyReport:
    """What :func:`verify` found. ``ok`` is True only with no problems; each
    problem names the file it is about."""

    path: str
    problems: list[str] = field(default_factory=list)
    entries: int = 0
    size: int = 0
    crc32: int = 0
    meta: Meta | None = None

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems

    def __str__(self) -> str:
        if self.ok:
            return f"{self.path}: OK ({self.entries} entries, {self.size} bytes, crc32 {self.crc32:08x})"
        return "\n".join(self.problems)


def _scan(path: str, problems: list[str], framing: Framing = FDL
          ) -> tuple[int, int, int, Header | None]:
    """Decode ``path``'s structure and checksum every byte: (size, crc32, entries, header)."""
    entries, header = 0, None
    try:
        with open_source(path, checksum=True) as s:
            assert s.tap is not None
            dec = Decoder(s.stream, size=s.size, path=path, framing=framing)
            try:
                entries = sum(1 for _ in dec.entries(load=False))
                header = dec.header
            except FormatError as e:
                problems.append(str(e))
            s.tap.drain()  # checksum whatever the decoder did not read
    except OSError as e:
        problems.append(f"cannot open {path}: {e.strerror}")
        return 0, 0, 0, None
    return s.tap.size, s.tap.crc32, entries, header


def _compare(what: str, size: int, crc: int, expected: dict[str, Any], problems: list[str]
             ) -> None:
    if expected["size"] != size:
        problems.append(f"{what}: size {size} bytes, metadata says {expected['size']}")
    if expected["crc32"] != crc:
        problems.append(f"{what}: crc32 {crc:08x}, metadata says {expected['crc32']:08x}: the "
                        "file is corrupt or does not belong to this metadata")


def verify(path: str | os.PathLike[str], *, require_meta: bool = True) -> VerifyReport:
    """Check the structure of ``path`` and, from its metadata, its size and checksum
    (and those of the optimizer file and data file written beside it, if any).

    A missing metadata file is a problem (an unfinished write) unless
    ``require_meta=False``; a missing ``path`` is "no such file". A symlink is
    checked as the checkpoint it points at, as loads read it. Never raises
    for a bad file: problems are listed.
    """
    path = os.fspath(path)
    report = VerifyReport(path)
    problems = report.problems
    if not os.path.exists(path):  # a typo, not an unfinished write: say so
        problems.append(f"{path}: no such file")
        return report
    if os.path.isdir(path):
        problems.append(f"{path}: a directory, not a checkpoint file")
        return report
    if os.path.islink(path):  # ModelCheckpoint(save_last="link"): metadata and companions lie beside
        target = os.path.realpath(path)   # the checkpoint it points at, and loads read through it;
        if os.path.exists(target):        # not a /proc/self/fd link to an unnamed (memfd) file
            path = target
    try:
        report.meta = read_meta(path)
    except FormatError as e:
        if require_meta or os.path.exists(path + ".meta"):
            problems.append(str(e))
    try:  # given on its own (require_meta=False), a data file is read as one
        framing = FDL if report.meta is not None else file_framing(path)
    except OSError:
        framing = FDL  # _scan says why it cannot be read
    report.size, report.crc32, report.entries, header = _scan(path, problems, framing)
    meta = report.meta
    if meta is None:
        return report
    _compare(path, report.size, report.crc32, {"size": meta.size, "crc32": meta.crc32}, problems)
    if header is not None:
        if meta.entries != header.count:
            problems.append(f"{path}: {header.count} entries, metadata says {meta.entries}")
        file_hash = header.structural_hash.hex() if any(header.structural_hash) else None
        if meta.structural_hash is not None and file_hash is not None \
                and meta.structural_hash != file_hash:
            problems.append(f"{path}: structural hash {file_hash}, metadata says "
                            f"{meta.structural_hash}")
    try:
        beside = companions(path, meta)
    except FormatError as e:
        problems.append(str(e))
        beside = []
    for c in beside:
        cpath = os.path.join(os.path.dirname(path), c.name)
        size, crc, count, header = _scan(cpath, problems, c.framing)
        _compare(cpath, size, crc, {"size": c.size, "crc32": c.crc32}, problems)
        if header is not None and c.entries is not None and c.entries != count:
            problems.append(f"{cpath}: {count} entries, metadata says {c.entries}")
    return report

"""``verify``: is a checkpoint whole, and is it what its metadata says?

One pass over the file: every byte goes through a CRC-32 (the same one the
writer recorded in the metadata) while the ``.fdl`` structure is decoded
without keeping the data. CRC-32 catches every single-byte corruption and
every burst up to 32 bits; the size, entry count, buffer names and hash in
the metadata are compared too.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, field

from isal import isal_zlib

from . import fdl
from .errors import FormatError
from .meta import Meta, read_meta
from .streams import GZIP_MAGIC, GzipReader

__all__ = ["VerifyReport", "verify"]


@dataclass
class VerifyReport:
    """What :func:`verify` found. ``ok`` is True only with no problems."""

    path: str
    problems: list[str] = field(default_factory=list)
    entries: int = 0
    size: int = 0
    crc32: int = 0
    meta: Meta | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        if self.ok:
            return f"{self.path}: OK ({self.entries} entries, {self.size} bytes, crc32 {self.crc32:08x})"
        return "\n".join(f"{self.path}: {p}" for p in self.problems)


class _CrcReader(io.RawIOBase):
    """Counts and checksums every byte read from ``raw``."""

    def __init__(self, raw: io.BufferedReader) -> None:
        self._raw = raw
        self.size = 0
        self.crc32 = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # type: ignore[override]
        n = self._raw.readinto(b)
        if n:
            self.crc32 = isal_zlib.crc32(memoryview(b)[:n], self.crc32)
            self.size += n
        return n


def verify(path: str | os.PathLike[str], *, require_meta: bool = True) -> VerifyReport:
    """Check the structure of ``path`` and, from its metadata, its size and checksum.

    A missing metadata file is a problem (an unfinished write) unless
    ``require_meta=False``. Never raises for a bad file: problems are listed.
    """
    path = os.fspath(path)
    report = VerifyReport(path)
    try:
        report.meta = read_meta(path)
    except FormatError as e:
        if require_meta or os.path.exists(path + ".meta"):
            report.problems.append(e.reason)
    try:
        f = open(path, "rb")
    except OSError as e:
        report.problems.append(f"cannot open: {e.strerror}")
        return report
    header = None
    with f:
        tap = _CrcReader(f)
        buffered = io.BufferedReader(tap, 1 << 20)
        gz = path.endswith(".gz") or buffered.peek(2)[:2] == GZIP_MAGIC
        stream = GzipReader(buffered, path) if gz else buffered
        dec = fdl.Decoder(stream, size=None if gz else os.fstat(f.fileno()).st_size, path=path)
        try:
            report.entries = sum(1 for _ in dec.entries(load=False))
            header = dec.header
        except FormatError as e:
            report.problems.append(str(e).removeprefix(f"{path}: "))
        while buffered.read(1 << 20):  # checksum whatever the decoder did not read
            pass
    report.size, report.crc32 = tap.size, tap.crc32
    meta = report.meta
    if meta is not None:
        if meta.size != report.size:
            report.problems.append(f"size {report.size} bytes, metadata says {meta.size}")
        if meta.crc32 != report.crc32:
            report.problems.append(f"crc32 {report.crc32:08x}, metadata says {meta.crc32:08x}: "
                                   "the file is corrupt or does not belong to this metadata")
        if header is not None:
            if meta.entries != header.count:
                report.problems.append(f"{header.count} entries, metadata says {meta.entries}")
            file_hash = header.structural_hash.hex() if any(header.structural_hash) else None
            if meta.structural_hash is not None and file_hash is not None \
                    and meta.structural_hash != file_hash:
                report.problems.append(f"structural hash {file_hash}, metadata says "
                                       f"{meta.structural_hash}")
    return report

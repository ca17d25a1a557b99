"""Opening checkpoint sources and sinks: paths or file objects, plain or gzip.

gzip is isal's standard single-member gzip, which ``gzip -d`` and flodl's
reader accept. A path ending in ``.gz`` is gzip; on read, the gzip magic bytes
are recognised too, so a misnamed file still loads. gzip failures surface as
:class:`~snapsvc.errors.FormatError` naming the file and the offset in the
uncompressed stream.
"""

from __future__ import annotations

import io
import os
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import BinaryIO, Iterator, Union

from isal import igzip, isal_zlib

from .errors import FormatError

__all__ = [
    "GZIP_MAGIC",
    "DEFAULT_GZIP_LEVEL",
    "Source",
    "GzipReader",
    "PathOrFile",
    "is_gzip_path",
    "gzip_writer",
    "open_source",
]

PathOrFile = Union[str, "os.PathLike[str]", BinaryIO]

GZIP_MAGIC = b"\x1f\x8b"
# isal levels run 0..3. Measured by benchmarks/codec.py on 256 MiB (2026-11-29):
# on float32 weights levels 1-3 save ~7.6 % and level 0 *expands* them ~23 %;
# 1 and 2 compress equally fast (~460 MB/s, zlib-6: 30 MB/s), 2 is ~2 % smaller
# on int64 but ~5-8 % slower, and 3 is 2-20x slower for no gain. So 1.
DEFAULT_GZIP_LEVEL = 1


def is_gzip_path(path: object) -> bool:
    return isinstance(path, (str, os.PathLike)) and os.fspath(path).endswith(".gz")


@contextmanager
def gzip_writer(raw: BinaryIO, level: int | None = None) -> Iterator[BinaryIO]:
    """Wrap ``raw`` in one gzip member; closing it writes the trailer only."""
    level = DEFAULT_GZIP_LEVEL if level is None else level
    if not 0 <= level <= 3:
        raise ValueError(f"gzip level must be 0..3 (isal's levels), got {level}")
    # filename="" and mtime=0: the bytes depend only on the data.
    gz = igzip.IGzipFile(filename="", mode="wb", compresslevel=level, fileobj=raw, mtime=0)
    try:
        yield gz
    finally:
        gz.close()  # closes the member, not ``raw``


class GzipReader(io.RawIOBase):
    """A gzip decompressor that reports corruption as FormatError."""

    _ERRORS = (EOFError, OSError, zlib.error, isal_zlib.error)

    def __init__(self, raw: BinaryIO, path: str | None) -> None:
        self._gz = igzip.IGzipFile(fileobj=raw, mode="rb")
        self._path = path
        self._pos = 0

    def readable(self) -> bool:
        return True

    def _fail(self, e: BaseException) -> FormatError:
        return FormatError(f"corrupt or truncated gzip stream ({e or type(e).__name__})",
                           path=self._path, offset=self._pos)

    def readinto(self, b) -> int:  # type: ignore[override]
        try:
            n = self._gz.readinto(b)
        except self._ERRORS as e:
            raise self._fail(e) from None
        self._pos += n
        return n

    def read(self, n: int = -1) -> bytes:
        try:
            data = self._gz.read(n)
        except self._ERRORS as e:
            raise self._fail(e) from None
        self._pos += len(data)
        return data


class _Prefixed(io.RawIOBase):
    """Put bytes already read back in front of a non-seekable stream."""

    def __init__(self, prefix: bytes, raw: BinaryIO) -> None:
        self._prefix = prefix
        self._raw = raw

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # type: ignore[override]
        if self._prefix:
            n = min(len(b), len(self._prefix))
            b[:n] = self._prefix[:n]
            self._prefix = self._prefix[n:]
            return n
        return self._raw.readinto(b)


@dataclass
class Source:
    """An opened checkpoint stream and what the decoder may assume of it."""

    stream: BinaryIO
    size: int | None      # uncompressed bytes left, when known
    seekable: bool
    path: str | None
    gzip: bool


def _peek2(f: BinaryIO) -> tuple[bytes, BinaryIO]:
    if hasattr(f, "peek"):
        return f.peek(2)[:2], f
    if f.seekable():
        pos = f.tell()
        head = f.read(2)
        f.seek(pos)
        return head, f
    head = f.read(2)
    return head, _Prefixed(head, f)  # type: ignore[return-value]


@contextmanager
def open_source(src: PathOrFile) -> Iterator[Source]:
    """Open ``src`` (a path or a readable binary file) for decoding."""
    if isinstance(src, (str, os.PathLike)):
        path = os.fspath(src)
        with open(path, "rb") as f:
            head, _ = _peek2(f)
            if path.endswith(".gz") or head == GZIP_MAGIC:
                yield Source(GzipReader(f, path), None, False, path, True)
            else:
                yield Source(f, os.fstat(f.fileno()).st_size, True, path, False)
        return
    name = getattr(src, "name", None)
    path = name if isinstance(name, str) else None
    head, stream = _peek2(src)
    if head == GZIP_MAGIC:
        yield Source(GzipReader(stream, path), None, False, path, True)
        return
    size = None
    seekable = stream.seekable()
    if seekable:
        pos = stream.tell()
        size = stream.seek(0, io.SEEK_END) - pos
        stream.seek(pos)
    yield Source(stream, size, seekable, path, False)

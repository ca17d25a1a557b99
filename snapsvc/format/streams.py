"""Opening checkpoint sources and sinks: paths or file objects, plain or gzip.

gzip is isal's standard single-member gzip, which ``gzip -d`` and flodl's
reader accept. A path ending in ``.gz`` is gzip; on read, the gzip magic bytes
are recognised too, so a misnamed file still loads. gzip failures surface as
:class:`~snapsvc.errors.FormatError` naming the file and the offset in the
uncompressed stream.

:class:`CrcReader` sits under everything else when a reader must check a
file against the size and CRC-32 recorded when it was written (``verify``,
``read_verified``): the checksum covers the bytes on disk, compressed or
not, in the same pass that decodes them.
"""

from __future__ import annotations

import io
import os
import threading
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Iterator, Protocol, Union, cast

from isal import igzip, isal_zlib

from ..errors import FormatError

__all__ = [
    "GZIP_MAGIC",
    "CRC_PIECE",
    "FUSE_PIECE",
    "crc32_of",
    "DEFAULT_GZIP_LEVEL",
    "Source",
    "CrcReader",
    "GzipReader",
    "MemoryReader",
    "PathOrFile",
    "ReadStream",
    "WriteStream",
    "is_gzip_path",
    "gzip_writer",
    "open_source",
]

PathOrFile = Union[str, "os.PathLike[str]", BinaryIO]


class ReadStream(Protocol):
    """What the readers here use of a binary stream: a file opened ``"rb"`` (buffered or
    not), or one of the readers below. ``typing.BinaryIO`` does not declare ``readinto``."""

    def read(self, size: int = -1, /) -> bytes: ...
    def readinto(self, buffer: Any, /) -> int | None: ...
    def seekable(self) -> bool: ...
    def seek(self, offset: int, whence: int = 0, /) -> int: ...
    def tell(self) -> int: ...


class WriteStream(Protocol):
    """What the writers here use of a sink: a binary file, a gzip member, a
    :class:`~snapsvc.files.durable.DurableFile`."""

    def write(self, data: Any, /) -> object: ...

GZIP_MAGIC = b"\x1f\x8b"
# isal levels run 0..3. Measured by benchmarks/codec.py on 256 MiB (2026-11-29):
# on float32 weights levels 1-3 save ~7.6 % and level 0 *expands* them ~23 %;
# 1 and 2 compress equally fast (~460 MB/s, zlib-6: 30 MB/s), 2 is ~2 % smaller
# on int64 but ~5-8 % slower, and 3 is 2-20x slower for no gain. So 1.
DEFAULT_GZIP_LEVEL = 1


def is_gzip_path(path: object) -> bool:
    return isinstance(path, (str, os.PathLike)) and os.fspath(path).endswith(".gz")


@contextmanager
def gzip_writer(raw: WriteStream, level: int | None = None) -> Iterator[WriteStream]:
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


CRC_PIECE = 4 << 20  # checksum each read while it is still in cache
# Below this a buffer is checksummed on the calling thread alone; above it in
# parts of at least this size, one per core (up to _CRC_THREADS).
_CRC_PART = 16 << 20
_CRC_THREADS = 4
_ALIGN = 1 << 20  # where parts start: a multiple of any page size
FUSE_PIECE = 512 << 10  # crc32_of(after=): small enough to stay in a core's cache for the copy


def crc32_of(view: memoryview, before: Callable[[int, int], object] | None = None,
             after: Callable[[int, int], object] | None = None) -> int:
    """CRC-32 of a whole buffer already in memory (a mapped file), in
    parallel parts on up to four cores: isal releases the GIL while it
    checksums, so on two cores a 256 MiB buffer takes about 0.65x the time
    of one pass (measured here, issue 34). ``before(offset, length)`` runs
    on each part's thread just before it is checksummed (parts start at
    multiples of 1 MiB); what it or the checksum raises is raised here.
    ``after(offset, length)``: each part is checksummed in pieces of
    :data:`FUSE_PIECE`, and ``after`` runs on each piece just after, on the
    part's thread, while the piece is still in cache (a restore copies it
    out then: one read of memory for the checksum and the copy).
    Fresh threads each call, not a pool, so a forked child has nothing
    stale to wait on."""
    n = len(view)
    parts = max(1, min(_CRC_THREADS, _cores(), n // _CRC_PART))
    step = -(-n // parts // _ALIGN) * _ALIGN if parts > 1 else max(n, 1)
    bounds = [(at, min(at + step, n)) for at in range(0, n, step)] or [(0, 0)]
    crcs = [0] * len(bounds)
    errors: list[BaseException] = []

    def part(i: int) -> None:
        at, end = bounds[i]
        try:
            if before is not None:
                before(at, end - at)
            if after is None:
                crcs[i] = isal_zlib.crc32(view[at:end])
                return
            crc = 0
            for piece in range(at, end, FUSE_PIECE):
                stop = min(piece + FUSE_PIECE, end)
                crc = isal_zlib.crc32(view[piece:stop], crc)
                after(piece, stop - piece)
            crcs[i] = crc
        except BaseException as e:  # noqa: BLE001 - raised on the calling thread below
            errors.append(e)

    threads = [threading.Thread(target=part, args=(i,), daemon=True)
               for i in range(1, len(bounds))]
    for t in threads:
        t.start()
    part(0)  # meanwhile, on this thread
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    crc = crcs[0]
    for (at, end), c in zip(bounds[1:], crcs[1:]):
        crc = isal_zlib.crc32_combine(crc, c, end - at)
    return crc


def _cores() -> int:
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)


# For headers and small tensors: a read of more goes straight to the file. Also
# small enough to come from the heap, not a fresh mmap that faults on first touch.
_SMALL_BUFFER = 64 << 10


class CrcReader(io.RawIOBase):
    """Counts and CRC-32s every byte read through it from ``raw``.

    Each read asks ``raw`` for at most 4 MiB, so every piece is checksummed
    while it is still in the CPU cache: the checksum then costs about nothing
    next to the read (it would be a second pass over memory after a large one).
    """

    def __init__(self, raw: ReadStream) -> None:
        self._raw = raw
        self.size = 0
        self.crc32 = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int | None:
        view = memoryview(b).cast("B")[:CRC_PIECE]
        n = self._raw.readinto(view)
        if n:
            self.crc32 = isal_zlib.crc32(view[:n], self.crc32)
            self.size += n
        return n

    def drain(self) -> None:
        """Read ``raw`` to its end, so ``size`` and ``crc32`` cover all of it
        (a buffered reader above may have stopped short, or a decoder failed)."""
        scratch = memoryview(bytearray(_SMALL_BUFFER))  # usually there is nothing left
        while self.readinto(scratch):
            pass


class MemoryReader(io.RawIOBase):
    """A seekable reader over a byte buffer, without copying it (``io.BytesIO`` would)."""

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def read(self, n: int = -1) -> bytes:
        end = len(self._view) if n is None or n < 0 else min(self._pos + n, len(self._view))
        data = bytes(self._view[self._pos:end])
        self._pos = max(self._pos, end)
        return data

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        data = self._view[self._pos:self._pos + len(out)]
        n = len(data)
        out[:n] = data
        self._pos += n
        return n


class GzipReader(io.RawIOBase):
    """A gzip decompressor that reports corruption as FormatError."""

    # isal_zlib.pyi declares error an Exception instance; it is the exception class
    _ERRORS: tuple[type[BaseException], ...] = (EOFError, OSError, zlib.error,
                                                isal_zlib.error)  # type: ignore[assignment]

    def __init__(self, raw: ReadStream, path: str | None) -> None:
        self._gz = igzip.IGzipFile(fileobj=raw, mode="rb")
        self._path = path
        self._pos = 0

    def readable(self) -> bool:
        return True

    def _fail(self, e: BaseException) -> FormatError:
        return FormatError(f"corrupt or truncated gzip stream ({e or type(e).__name__})",
                           path=self._path, offset=self._pos)

    def readinto(self, b: Any) -> int:
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

    def __init__(self, prefix: bytes, raw: ReadStream) -> None:
        self._prefix = prefix
        self._raw = raw

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int | None:
        if self._prefix:
            n = min(len(b), len(self._prefix))
            b[:n] = self._prefix[:n]
            self._prefix = self._prefix[n:]
            return n
        return self._raw.readinto(b)


@dataclass
class Source:
    """An opened checkpoint stream and what the decoder may assume of it."""

    stream: ReadStream
    size: int | None      # uncompressed bytes left, when known
    seekable: bool
    path: str | None
    gzip: bool
    tap: CrcReader | None = None  # with open_source(checksum=True): every byte read from disk
    file_size: int | None = None  # bytes on disk, for paths


def _peek2(f: BinaryIO) -> tuple[bytes, ReadStream]:
    stream = cast(ReadStream, f)   # a binary file object reads into too; BinaryIO omits it
    if hasattr(f, "peek"):
        return f.peek(2)[:2], stream
    if f.seekable():
        pos = f.tell()
        head = f.read(2)
        f.seek(pos)
        return head, stream
    head = f.read(2)
    return head, _Prefixed(head, stream)


@contextmanager
def open_source(src: PathOrFile, *, checksum: bool = False) -> Iterator[Source]:
    """Open ``src`` (a path or a readable binary file) for decoding.

    With ``checksum`` (paths only), every byte read from the file passes
    through ``Source.tap``, a :class:`CrcReader`, and the stream does not
    seek, so no byte escapes the checksum; call ``tap.drain()`` after
    decoding to cover any the decoder left.
    """
    path: str | None   # a file object's name, when it has one
    if isinstance(src, (str, os.PathLike)):
        path = os.fspath(src)
        if checksum:
            with open(path, "rb", buffering=0) as raw:
                tap = CrcReader(raw)
                yield _path_source(io.BufferedReader(tap, _SMALL_BUFFER), path,
                                   os.fstat(raw.fileno()).st_size, tap)
        else:
            with open(path, "rb") as f:
                yield _path_source(f, path, os.fstat(f.fileno()).st_size, None)
        return
    if checksum:
        raise TypeError("open_source(checksum=True) needs a path")
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


def _path_source(f: io.BufferedReader, path: str, file_size: int, tap: CrcReader | None
                 ) -> Source:
    if path.endswith(".gz") or f.peek(2)[:2] == GZIP_MAGIC:
        return Source(GzipReader(f, path), None, False, path, True, tap, file_size)
    return Source(f, file_size, tap is None, path, False, tap, file_size)

"""The ``.fdl`` checkpoint codec (flodl format version 2), pure and streaming.

This module turns (name, tensor) pairs into bytes and back. It opens no
files, starts no processes or threads: it writes to any object with
``write()`` and reads from any object with ``read()``/``readinto()``. File
handling (temp files, fsync, gzip) lives in :mod:`snapsvc.files.durable` and
:mod:`snapsvc.format.streams`.

Byte layout (every integer little-endian; see ``shared/FORMAT.md``)::

    offset  size          field
    ------  ------------  ------------------------------------------
    0       4             magic  b"FDLC"
    4       4   u32       version (written 2; 1 and 2 are read)
    8       32            structural hash (all zeros = no hash)
    40      4   u32       count of entries
    44      ...           count x entry:

            +-----------+------------+---------+---------------+-----+-----------+--------+
            | name_len  | name       | ndim    | shape         | tag | nbytes    | data   |
            | u32       | UTF-8      | u32     | ndim x i64    | u8  | u64       | nbytes |
            +-----------+------------+---------+---------------+-----+-----------+--------+

    nothing follows the last entry.

``data`` is the tensor's elements in row-major (C-contiguous) order, native
little-endian, and ``nbytes == numel * element_size`` exactly.

Decoding never trusts a declared length: every name length, rank, shape and
byte count is checked against the bytes that remain (when the caller knows
them) before anything is allocated, and streams of unknown length (gzip) are
read in bounded pieces so memory follows the real data, not the header.
"""

from __future__ import annotations

import ctypes
import math
import struct
import sys
from dataclasses import dataclass
from typing import BinaryIO, Iterable, Iterator

import torch

from ..errors import EncodeError, FormatError

__all__ = [
    "MAGIC",
    "VERSION",
    "SUPPORTED_VERSIONS",
    "HASH_LEN",
    "DTYPE_TO_TAG",
    "TAG_TO_DTYPE",
    "Framing",
    "FDL",
    "MAX_NAME_LEN",
    "MAX_NDIM",
    "shape_problem",
    "Header",
    "Entry",
    "Encoder",
    "encode",
    "encoded_size",
    "check_encodable",
    "check_entries",
    "Decoder",
]

if sys.byteorder != "little":  # the format stores native little-endian data
    raise ImportError("snapsvc's .fdl codec needs a little-endian host")

MAGIC = b"FDLC"
VERSION = 2
SUPPORTED_VERSIONS = (1, 2)
HASH_LEN = 32

# Both directions written out, so a reader of this file sees the contract.
DTYPE_TO_TAG: dict[torch.dtype, int] = {
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float32: 3,
    torch.float64: 4,
    torch.int32: 5,
    torch.int64: 6,
}
TAG_TO_DTYPE: dict[int, torch.dtype] = {
    1: torch.float16,
    2: torch.bfloat16,
    3: torch.float32,
    4: torch.float64,
    5: torch.int32,
    6: torch.int64,
}


@dataclass(frozen=True, eq=False)
class Framing:
    """A file format in this framing: its magic, versions and dtype tags.

    ``.fdl`` is :data:`FDL`; snapsvc's data file (:mod:`snapsvc.format.datafile`)
    uses the same framing with a magic and tag table of its own. ``name``
    names the format in errors.
    """

    name: str
    magic: bytes
    version: int
    versions: tuple[int, ...]
    dtype_to_tag: dict[torch.dtype, int]
    tag_to_dtype: dict[int, torch.dtype]

    @property
    def dtype_names(self) -> str:
        """The dtypes it has tags for, for messages: ``"float16, bfloat16, ..."``."""
        return ", ".join(str(d).removeprefix("torch.") for d in self.dtype_to_tag)


FDL = Framing(".fdl", MAGIC, VERSION, SUPPORTED_VERSIONS, DTYPE_TO_TAG, TAG_TO_DTYPE)

# Limits a real checkpoint never reaches; they stop a hostile header from
# asking for absurd work when the stream's length is unknown (gzip).
MAX_NAME_LEN = 1 << 20
MAX_NDIM = 64

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_HEADER = struct.Struct("<4sI32sI")  # magic, version, hash, count
_TAG_NBYTES = struct.Struct("<BQ")
_MIN_ENTRY = 4 + 4 + 1 + 8           # empty name, scalar: smallest entry
_PIECE = 64 << 20                    # read unknown-length data in 64 MiB pieces
_SMALL = 64 << 10                    # tensors below this are copied into the write batch
_BATCH = 1 << 20                     # hand the batch to the writer once it holds this much
_I64_MAX = (1 << 63) - 1
# An entry's rank and shape, one compiled struct per rank.
_SHAPES = tuple(struct.Struct(f"<I{n}q") for n in range(MAX_NDIM + 1))


@dataclass(frozen=True)
class Header:
    """The fixed 44-byte file header."""

    version: int
    structural_hash: bytes
    count: int


@dataclass(frozen=True)
class Entry:
    """One decoded entry. ``tensor`` is None when data was skipped."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    offset: int                     # stream offset of the entry's name length
    tensor: torch.Tensor | None

    @property
    def data_offset(self) -> int:
        """Stream offset of the entry's data: past name length, name, ndim, shape, tag, count."""
        return self.offset + _MIN_ENTRY + len(self.name.encode("utf-8")) + 8 * len(self.shape)


def _byte_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy).

    ctypes rather than numpy: numpy is optional for torch and has no bfloat16.
    The view keeps ``t`` alive, so a temporary (a CPU copy) stays valid for
    a writer that holds on to the view.
    """
    n = t.numel() * t.element_size()
    array = (ctypes.c_char * n).from_address(t.data_ptr())
    array.tensor = t  # type: ignore[attr-defined]
    return memoryview(array).cast("B")


def shape_problem(shape: tuple[int, ...] | list[int]) -> str | None:
    """Why ``shape`` (read from a file) is no tensor's shape, or None.

    Every size must be 0 to 2**63 - 1 and their product, zeros left out,
    within int64: torch refuses anything past that even when the tensor
    would be empty, and a file must not make it raise.
    """
    nonzero = 1
    for d in shape:
        if d < 0:
            return f"negative dimension in shape {list(shape)}"
        nonzero *= max(d, 1)
    if nonzero > _I64_MAX:
        return f"shape {list(shape)} overflows: its sizes multiply past 2**63 - 1"
    return None


def check_encodable(name: object, tensor: object, framing: Framing = FDL) -> bytes:
    """Return ``name`` as UTF-8, or raise :class:`EncodeError` saying why not."""
    if not isinstance(name, str):
        raise EncodeError(f"entry name {name!r} is not a str")
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError as e:
        raise EncodeError(f"entry {name!r}: name is not encodable as UTF-8 ({e})") from None
    if len(raw) > MAX_NAME_LEN:
        raise EncodeError(f"entry {name[:40]!r}...: name is {len(raw)} bytes, "
                          f"the limit is {MAX_NAME_LEN}")
    if not isinstance(tensor, torch.Tensor):
        raise EncodeError(f"entry {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise EncodeError(f"entry {name!r}: {tensor.layout} tensors cannot be written; "
                          "convert with .to_dense() first")
    if tensor.is_quantized:
        raise EncodeError(f"entry {name!r}: quantized tensors cannot be written; "
                          "dequantize first")
    if tensor.is_meta:
        raise EncodeError(f"entry {name!r}: a meta tensor has no data to write; "
                          "materialize the model first")
    if tensor.dtype not in framing.dtype_to_tag:
        raise EncodeError(f"entry {name!r}: dtype {tensor.dtype} has no {framing.name} tag; "
                          f"supported dtypes are {framing.dtype_names}")
    if tensor.dim() > MAX_NDIM:
        raise EncodeError(f"entry {name!r}: rank {tensor.dim()} exceeds {MAX_NDIM}")
    return raw


def check_entries(pairs: list[tuple[str, torch.Tensor]], framing: Framing = FDL) -> list[bytes]:
    """The UTF-8 names of ``pairs``, or :class:`EncodeError`: an entry that
    cannot be written, or a name twice (names in one file must be unique)."""
    raw_names = []
    seen: set[str] = set()
    for name, t in pairs:
        raw_names.append(check_encodable(name, t, framing))
        if name in seen:
            raise EncodeError(f"entry {name!r} appears twice; names in one file must be unique")
        seen.add(name)
    return raw_names


def encoded_size(entries: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Bytes the uncompressed stream for ``entries`` will take."""
    total = _HEADER.size
    for name, t in entries:
        total += _MIN_ENTRY + len(name.encode("utf-8")) + 8 * t.dim() + t.numel() * t.element_size()
    return total


def _entry_header(raw_name: bytes, t: torch.Tensor, tags: dict[torch.dtype, int]) -> bytes:
    """An entry's bytes before its data: name length, name, rank, shape, tag, byte count."""
    return b"".join((_U32.pack(len(raw_name)), raw_name, _SHAPES[t.dim()].pack(t.dim(), *t.shape),
                     _TAG_NBYTES.pack(tags[t.dtype], t.numel() * t.element_size())))


class Encoder:
    """``entries`` checked and laid out once, to be written any number of times.

    Building one validates every entry and packs every header; :meth:`write`
    then only moves data. The writer sidecar keeps one per slot, whose
    tensors are views of shared memory that change between writes, so a
    20,000-entry snapshot costs a few C-level calls per write, not Python work
    per entry.

    Small CPU tensors and the headers between them are gathered by one
    ``torch.cat`` per batch of about 1 MiB into a fresh buffer (one write per
    batch, not two per entry). A tensor of 64 KiB or more reaches
    ``writer.write`` as a byte memoryview of its own memory (no copy).
    Tensors on another device, or not contiguous, are copied to the CPU one
    at a time when written, never all at once.
    """

    def __init__(self, entries: Iterable[tuple[str, torch.Tensor]], *,
                 structural_hash: bytes | None = None, framing: Framing = FDL) -> None:
        pairs = list(entries)
        raw_names = check_entries(pairs, framing)
        if structural_hash is None:
            structural_hash = bytes(HASH_LEN)
        if len(structural_hash) != HASH_LEN:
            raise EncodeError(f"structural hash must be {HASH_LEN} bytes, got {len(structural_hash)}")
        if len(pairs) > 0xFFFFFFFF:
            raise EncodeError(f"{len(pairs)} entries exceed the format's u32 count")
        self.count = len(pairs)
        # Every header, and each small tensor's place after it, as a list of
        # batches: (pieces for torch.cat, bytes), then a large tensor or None.
        headers = bytearray(_HEADER.pack(framing.magic, framing.version, bytes(structural_hash),
                                         len(pairs)))
        marks = [0]  # where each entry's header ends in ``headers``
        for raw, (_, t) in zip(raw_names, pairs):
            headers += _entry_header(raw, t, framing.dtype_to_tag)
            marks.append(len(headers))
        self._headers = torch.frombuffer(headers, dtype=torch.uint8)
        self._steps: list[tuple[list[torch.Tensor], int, torch.Tensor | None]] = []
        pieces: list[torch.Tensor] = []
        size = 0
        start = 0  # headers not yet in a piece
        for i, (_, t) in enumerate(pairs):
            nbytes = t.numel() * t.element_size()
            end = marks[i + 1]
            inline = nbytes < _SMALL and t.is_cpu and t.is_contiguous()
            if inline and not nbytes:
                continue  # the header stays pending; nothing to place after it
            pieces.append(self._headers[start:end])
            size += end - start
            start = end
            if not inline:
                self._steps.append((pieces, size, t))
                pieces, size = [], 0
                continue
            pieces.append(t.detach().reshape(-1).view(torch.uint8))
            size += nbytes
            if size >= _BATCH:
                self._steps.append((pieces, size, None))
                pieces, size = [], 0
        if start < len(headers):
            pieces.append(self._headers[start:])
            size += len(headers) - start
        if pieces:
            self._steps.append((pieces, size, None))
        self.nbytes = len(headers) + sum(t.numel() * t.element_size() for _, t in pairs)
        self._scratch: bytearray | None = None

    def write(self, writer: BinaryIO, *, reuse: bool = False) -> int:
        """Write the stream, with the tensors' values of now; return bytes written.

        Each batch goes into a fresh buffer, as ``writer`` may keep what it is
        handed. ``reuse=True``, for a writer known to be done with its
        argument when ``write`` returns (a file, gzip), fills one buffer over
        and over: no fresh pages to fault in per batch. Not for two threads
        writing one Encoder at once.
        """
        scratch = None
        if reuse and self._steps:
            if self._scratch is None:
                self._scratch = bytearray(max(size for _, size, _ in self._steps))
            scratch = torch.frombuffer(self._scratch, dtype=torch.uint8)
        for pieces, size, big in self._steps:
            if size:
                if scratch is None:
                    batch = memoryview(bytearray(size))
                    out = torch.frombuffer(batch, dtype=torch.uint8)
                else:
                    batch, out = memoryview(self._scratch)[:size], scratch[:size]
                torch.cat(pieces, out=out)
                writer.write(batch)
            if big is not None:
                if not (big.is_cpu and big.is_contiguous()):
                    big = big.detach().cpu().contiguous()
                if big.numel():
                    writer.write(_byte_view(big))
        return self.nbytes


def encode(writer: BinaryIO, entries: Iterable[tuple[str, torch.Tensor]], *,
           structural_hash: bytes | None = None, framing: Framing = FDL) -> int:
    """Write ``entries`` as one ``.fdl`` stream to ``writer``; return bytes written.

    Every entry is validated before the first byte is written, so a refused
    dtype or a duplicate name leaves ``writer`` untouched. See
    :class:`Encoder` for how the data goes out: the whole file is never
    built in memory.
    """
    return Encoder(entries, structural_hash=structural_hash, framing=framing).write(writer)


class Decoder:
    """Streaming reader of one ``.fdl`` stream.

    ``size`` is the number of bytes the stream holds from its current
    position, when the caller knows it (a plain file); every declared length
    is then bounded by it before allocation. With ``size=None`` (gzip, pipes)
    data is read in bounded pieces. ``seekable=True`` lets :meth:`entries`
    skip data with ``seek`` instead of reading it. ``path`` only names the
    source in errors. ``framing``: which format (magic, versions, tags) to expect.
    """

    def __init__(self, stream: BinaryIO, *, size: int | None = None,
                 seekable: bool = False, path: str | None = None,
                 framing: Framing = FDL) -> None:
        self._stream = stream
        self._framing = framing
        self._size = size
        self._seekable = seekable
        self._path = path
        self._pos = 0
        self._entry: str | None = None
        self.header: Header | None = None

    # -- low level ------------------------------------------------------
    def _fail(self, message: str, offset: int | None = None) -> FormatError:
        return FormatError(message, path=self._path,
                           offset=self._pos if offset is None else offset, entry=self._entry)

    def _remaining(self) -> int | None:
        return None if self._size is None else self._size - self._pos

    def _bound(self, n: int, what: str) -> None:
        left = self._remaining()
        if left is not None and n > left:
            raise self._fail(f"{what} declares {n} bytes but only {left} remain")

    def _read(self, n: int, what: str) -> bytes:
        """Read exactly ``n`` small bytes (headers, names)."""
        self._bound(n, what)
        data = self._stream.read(n)
        if len(data) != n:
            raise self._fail(f"truncated: {what} needs {n} bytes, stream ends after {len(data)}")
        self._pos += n
        return data

    def _readinto(self, view: memoryview, what: str, need: int | None = None,
                  done: int = 0) -> None:
        """Fill ``view``: a piece of a ``need``-byte field of which ``done`` are read."""
        got = 0
        n = len(view)
        while got < n:
            k = self._stream.readinto(view[got:])
            if not k:
                raise self._fail(f"truncated: {what} needs {n if need is None else need} bytes, "
                                 f"stream ends after {done + got}", offset=self._pos - done)
            got += k
        self._pos += n

    def _read_data(self, nbytes: int, what: str) -> torch.Tensor:
        """Read ``nbytes`` into a fresh uint8 tensor without trusting ``nbytes``."""
        self._bound(nbytes, what)
        if self._size is not None or nbytes <= _PIECE:
            buf = torch.empty(nbytes, dtype=torch.uint8)
            if nbytes:
                self._readinto(_byte_view(buf), what)
            return buf
        # Unknown length and a large claim: allocate only as data arrives.
        pieces = []
        left = nbytes
        while left:
            piece = torch.empty(min(left, _PIECE), dtype=torch.uint8)
            self._readinto(_byte_view(piece), what, nbytes, nbytes - left)
            pieces.append(piece)
            left -= piece.numel()
        return torch.cat(pieces)

    def _skip(self, nbytes: int, what: str) -> None:
        self._bound(nbytes, what)
        if self._seekable and self._size is not None:
            self._stream.seek(nbytes, 1)
            self._pos += nbytes
            return
        left = nbytes
        while left:
            chunk = self._stream.read(min(left, 1 << 20))
            if not chunk:
                raise self._fail(f"truncated: {what} needs {nbytes} bytes, "
                                 f"stream ends after {nbytes - left}",
                                 offset=self._pos - (nbytes - left))
            left -= len(chunk)
            self._pos += len(chunk)

    # -- the format -----------------------------------------------------
    def read_version(self) -> int:
        """Read and check magic and version only."""
        f = self._framing
        magic = self._read(4, "magic")
        if magic != f.magic:
            raise self._fail(f"invalid {f.name if f is not FDL else 'checkpoint'}: bad magic "
                             f"{magic!r}, expected {f.magic!r}", 0)
        (version,) = _U32.unpack(self._read(4, "version"))
        if version not in f.versions:
            raise self._fail(f"unsupported {f.name} version {version}; this reader supports "
                             f"versions {f.versions[0]} to {f.versions[-1]}", 4)
        return version

    def read_header(self) -> Header:
        """Read and check magic, version, hash and count."""
        if self.header is not None:
            return self.header
        version = self.read_version()
        hash_ = self._read(HASH_LEN, "structural hash")
        (count,) = _U32.unpack(self._read(4, "entry count"))
        left = self._remaining()
        if left is not None and count * _MIN_ENTRY > left:
            raise self._fail(f"entry count {count} needs at least {count * _MIN_ENTRY} bytes "
                             f"but only {left} remain", 40)
        self.header = Header(version, hash_, count)
        return self.header

    def _read_entry(self, load: bool) -> Entry:
        offset = self._pos
        (name_len,) = _U32.unpack(self._read(4, "name length"))
        if name_len > MAX_NAME_LEN:
            raise self._fail(f"name length {name_len} exceeds the limit {MAX_NAME_LEN}", offset)
        raw = self._read(name_len, "name")
        try:
            name = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self._fail(f"entry name is not valid UTF-8 ({e.reason} at byte {e.start})",
                             offset + 4) from None
        self._entry = name
        (ndim,) = _U32.unpack(self._read(4, "ndim"))
        if ndim > MAX_NDIM:
            raise self._fail(f"ndim {ndim} exceeds the limit {MAX_NDIM}", self._pos - 4)
        shape = struct.unpack(f"<{ndim}q", self._read(8 * ndim, "shape"))
        problem = shape_problem(shape)
        if problem:
            raise self._fail(problem, self._pos - 8 * ndim)
        numel = math.prod(shape)
        tag_at = self._pos
        tag = self._read(1, "dtype tag")[0]
        dtype = self._framing.tag_to_dtype.get(tag)
        if dtype is None:
            raise self._fail(f"unknown dtype tag {tag}; known tags are "
                             f"{sorted(self._framing.tag_to_dtype)}", tag_at)
        (nbytes,) = _U64.unpack(self._read(8, "byte count"))
        expected = numel * dtype.itemsize
        if nbytes != expected:
            raise self._fail(f"byte count {nbytes} does not match shape {list(shape)} x "
                             f"{dtype.itemsize} bytes ({expected})", self._pos - 8)
        tensor = None
        if load:
            data = self._read_data(nbytes, "tensor data")
            tensor = data.view(dtype).reshape(shape)
        else:
            self._skip(nbytes, "tensor data")
        return Entry(name, tuple(shape), dtype, nbytes, offset, tensor)

    def entries(self, *, load: bool = True) -> Iterator[Entry]:
        """Yield every entry in file order, then check that nothing follows.

        With ``load=False`` the data is skipped and ``Entry.tensor`` is None.
        """
        header = self.read_header()
        seen: set[str] = set()
        for _ in range(header.count):
            self._entry = None
            try:
                entry = self._read_entry(load)
            except FormatError as e:
                if e.entry is not None or self._entry is None:
                    raise
                # The stream itself (gzip) failed inside an entry: name it.
                raise FormatError(e.reason, path=e.path, offset=e.offset,
                                  entry=self._entry) from None
            if entry.name in seen:
                raise self._fail("duplicate entry name", entry.offset)
            seen.add(entry.name)
            yield entry
        self._entry = None
        left = self._remaining()
        if left is not None:
            if left:
                raise self._fail(f"{left} unexpected bytes after the last entry")
        elif self._stream.read(1):
            raise self._fail("unexpected bytes after the last entry")

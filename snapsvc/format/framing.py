"""The framing ``.fdl`` and the data file share, without torch: tags, the encoder, the decoder.

Both files are headers and byte spans (see :mod:`snapsvc.format.fdl` for the
byte layout). This module knows a dtype only by its tag, its name (torch's,
without ``torch.``) and its element size, and an entry's data only as bytes,
so the writer sidecar, which gets its tensors as spans of a shared-memory
mapping, encodes without importing torch. :mod:`snapsvc.format.fdl` (the
trainer's side) turns tensors into spans for the same :class:`Encoder` and
decoded data into tensors through the same :class:`Decoder`.

An entry to encode is a span: ``(name, tag, shape, data)``, where ``data``
is a bytes-like object of exactly ``numel x itemsize`` bytes in row-major
order, or a callable returning one when written (a tensor that must first
be copied to the CPU).
"""

from __future__ import annotations

import math
import struct
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Union

from ..errors import EncodeError, FormatError

if TYPE_CHECKING:
    from .streams import ReadStream, WriteStream

__all__ = ["MAGIC", "VERSION", "SUPPORTED_VERSIONS", "HASH_LEN", "MAX_NAME_LEN", "MAX_NDIM",
           "FDL_TAGS", "FDL_TAG_OF", "DATA_MAGIC", "DATA_VERSION", "DATA_TAGS", "DATA_TAG_OF",
           "Framing", "FDL", "DATA", "Span", "shape_problem", "check_name", "check_unique",
           "check_spans", "Header", "Entry", "Encoder", "Decoder"]

if sys.byteorder != "little":  # the format stores native little-endian data
    raise ImportError("snapsvc's .fdl codec needs a little-endian host")

MAGIC = b"FDLC"
VERSION = 2
SUPPORTED_VERSIONS = (1, 2)
HASH_LEN = 32

# flodl's tags (shared/FORMAT.md): tag -> (dtype name, bytes per element), and
# back. Both directions written out, so a reader of this file sees the contract.
FDL_TAGS: dict[int, tuple[str, int]] = {
    1: ("float16", 2),
    2: ("bfloat16", 2),
    3: ("float32", 4),
    4: ("float64", 8),
    5: ("int32", 4),
    6: ("int64", 8),
}
FDL_TAG_OF: dict[str, int] = {
    "float16": 1,
    "bfloat16": 2,
    "float32": 3,
    "float64": 4,
    "int32": 5,
    "int64": 6,
}

# The data file (snapsvc.format.datafile): its own magic, version and tags.
DATA_MAGIC = b"SNPD"
DATA_VERSION = 1
DATA_TAGS: dict[int, tuple[str, int]] = {
    1: ("bool", 1),
    2: ("uint8", 1),
    3: ("int8", 1),
    4: ("int16", 2),
    5: ("uint16", 2),
    6: ("uint32", 4),
    7: ("uint64", 8),
    8: ("complex64", 8),
    9: ("complex128", 16),
    10: ("float8_e4m3fn", 1),
    11: ("float8_e5m2", 1),
}
DATA_TAG_OF: dict[str, int] = {
    "bool": 1,
    "uint8": 2,
    "int8": 3,
    "int16": 4,
    "uint16": 5,
    "uint32": 6,
    "uint64": 7,
    "complex64": 8,
    "complex128": 9,
    "float8_e4m3fn": 10,
    "float8_e5m2": 11,
}


@dataclass(frozen=True, eq=False)
class Framing:
    """A file format in this framing: its magic, versions and dtype tags.

    ``.fdl`` is :data:`FDL`; snapsvc's data file is :data:`DATA`, the same
    framing with a magic and tag table of its own. ``name`` names the format
    in errors. ``tags``: tag -> (dtype name, element size); ``tag_of``: back.
    """

    name: str
    magic: bytes
    version: int
    versions: tuple[int, ...]
    tags: dict[int, tuple[str, int]]
    tag_of: dict[str, int]

    @property
    def dtype_names(self) -> str:
        """The dtypes it has tags for, for messages: ``"float16, bfloat16, ..."``."""
        return ", ".join(self.tag_of)


FDL = Framing(".fdl", MAGIC, VERSION, SUPPORTED_VERSIONS, FDL_TAGS, FDL_TAG_OF)
DATA = Framing("data file", DATA_MAGIC, DATA_VERSION, (DATA_VERSION,), DATA_TAGS, DATA_TAG_OF)

# Limits a real checkpoint never reaches; they stop a hostile header from
# asking for absurd work when the stream's length is unknown (gzip).
MAX_NAME_LEN = 1 << 20
MAX_NDIM = 64

Buffer = Any  # a bytes-like object (bytes, bytearray, memoryview, mmap)
Span = tuple[str, int, tuple[int, ...], Union[Buffer, Callable[[], Buffer]]]

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_HEADER = struct.Struct("<4sI32sI")  # magic, version, hash, count
_TAG_NBYTES = struct.Struct("<BQ")
_MIN_ENTRY = 4 + 4 + 1 + 8           # empty name, scalar: smallest entry
_PIECE = 64 << 20                    # read unknown-length data in 64 MiB pieces
_SMALL = 64 << 10                    # data below this is copied into the write batch
_BATCH = 1 << 20                     # hand the batch to the writer once it holds this much
_I64_MAX = (1 << 63) - 1
# An entry's rank and shape, one compiled struct per rank.
_SHAPES = tuple(struct.Struct(f"<I{n}q") for n in range(MAX_NDIM + 1))


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


def check_name(name: object) -> bytes:
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
    return raw


def check_unique(names: Iterable[str], what: str = "file") -> None:
    """:class:`EncodeError` for the first name given twice (names in one ``what`` are unique)."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise EncodeError(f"entry {name!r} appears twice; names in one {what} must be "
                              "unique")
        seen.add(name)


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def check_spans(spans: list[Span], framing: Framing = FDL) -> list[bytes]:
    """The UTF-8 names of ``spans``, or :class:`EncodeError`: a name, tag, rank
    or data length that cannot be written, or a name twice."""
    raw_names = []
    for name, tag, shape, data in spans:
        raw_names.append(check_name(name))
        if tag not in framing.tags:
            raise EncodeError(f"entry {name!r}: dtype tag {tag!r} is not a {framing.name} tag "
                              f"({framing.dtype_names})")
        if len(shape) > MAX_NDIM:
            raise EncodeError(f"entry {name!r}: rank {len(shape)} exceeds {MAX_NDIM}")
        if not callable(data):
            nbytes = _numel(shape) * framing.tags[tag][1]
            if memoryview(data).nbytes != nbytes:
                raise EncodeError(f"entry {name!r}: {memoryview(data).nbytes} bytes of data for "
                                  f"shape {list(shape)} of {framing.tags[tag][0]} ({nbytes})")
    check_unique(name for name, _, _, _ in spans)
    return raw_names


class Encoder:
    """Spans checked and laid out once, to be written any number of times.

    Building one validates every entry and packs every header; :meth:`write`
    then only moves data, with the spans' bytes of now. The writer sidecar
    keeps one per slot layout, whose spans are views of shared memory that
    changes between writes, so a 20,000-entry snapshot costs a few Python
    steps per entry per write, no header packing.

    Small data and the headers between them are copied into one buffer per
    batch of about 1 MiB (one write per batch, not two per entry). Data of
    64 KiB or more reaches ``writer.write`` as it is (a span of a slot or a
    tensor's memory: no copy). A callable span is called when written, one
    at a time (:mod:`snapsvc.format.fdl`: a tensor copied to the CPU then).
    """

    def __init__(self, entries: Iterable[Span], *, structural_hash: bytes | None = None,
                 framing: Framing = FDL) -> None:
        spans = list(entries)
        raw_names = check_spans(spans, framing)
        if structural_hash is None:
            structural_hash = bytes(HASH_LEN)
        if len(structural_hash) != HASH_LEN:
            raise EncodeError(f"structural hash must be {HASH_LEN} bytes, got {len(structural_hash)}")
        if len(spans) > 0xFFFFFFFF:
            raise EncodeError(f"{len(spans)} entries exceed the format's u32 count")
        self.count = len(spans)
        headers = bytearray(_HEADER.pack(framing.magic, framing.version, bytes(structural_hash),
                                         len(spans)))
        sizes = []
        marks = [0]  # where each entry's header ends in ``headers``
        for raw, (_, tag, shape, _) in zip(raw_names, spans):
            nbytes = _numel(shape) * framing.tags[tag][1]
            headers += b"".join((_U32.pack(len(raw)), raw, _SHAPES[len(shape)].pack(len(shape), *shape),
                                 _TAG_NBYTES.pack(tag, nbytes)))
            sizes.append(nbytes)
            marks.append(len(headers))
        head = memoryview(bytes(headers))
        # Batches: (copies (start, end, source) into a batch of ``size`` bytes),
        # then a large span (or a callable giving one) to write as it is, or None.
        self._steps: list[tuple[list[tuple[int, int, Buffer]], int, Any]] = []
        copies: list[tuple[int, int, Buffer]] = []
        size = 0
        start = 0  # headers not yet in a batch

        def put(piece: Buffer) -> None:
            nonlocal size
            n = len(piece)
            copies.append((size, size + n, piece))
            size += n

        for i, (_, _, _, data) in enumerate(spans):
            nbytes, end = sizes[i], marks[i + 1]
            if not nbytes:
                continue  # the header stays pending; nothing to place after it
            put(head[start:end])
            start = end
            if callable(data) or nbytes >= _SMALL:
                self._steps.append((copies, size, data))
                copies, size = [], 0
                continue
            put(memoryview(data).cast("B"))
            if size >= _BATCH:
                self._steps.append((copies, size, None))
                copies, size = [], 0
        if start < len(head):
            put(head[start:])
        if copies:
            self._steps.append((copies, size, None))
        self._names = [name for name, _, _, _ in spans]
        self._sizes = sizes
        self.nbytes = len(head) + sum(sizes)
        self._scratch: bytearray | None = None

    def write(self, writer: WriteStream, *, reuse: bool = False) -> int:
        """Write the stream, with the data of now; return bytes written.

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
            scratch = memoryview(self._scratch)
        for copies, size, big in self._steps:
            if size:
                batch = memoryview(bytearray(size)) if scratch is None else scratch[:size]
                for a, b, piece in copies:
                    batch[a:b] = piece
                writer.write(batch)
            if big is not None:
                writer.write(big() if callable(big) else big)
        return self.nbytes


@dataclass(frozen=True)
class Header:
    """The fixed 44-byte file header."""

    version: int
    structural_hash: bytes
    count: int


@dataclass(frozen=True)
class Entry:
    """One decoded entry. ``dtype`` and ``tensor`` are as the decoder gives them
    (:class:`Decoder`: the dtype's name and a bytearray; :class:`snapsvc.format.fdl.Decoder`:
    a torch dtype and a tensor); ``tensor`` is None when data was skipped."""

    name: str
    shape: tuple[int, ...]
    dtype: Any
    nbytes: int
    offset: int                     # stream offset of the entry's name length
    tensor: Any

    @property
    def data_offset(self) -> int:
        """Stream offset of the entry's data: past name length, name, ndim, shape, tag, count."""
        return self.offset + _MIN_ENTRY + len(self.name.encode("utf-8")) + 8 * len(self.shape)


class Decoder:
    """Streaming reader of one stream in this framing.

    ``size`` is the number of bytes the stream holds from its current
    position, when the caller knows it (a plain file); every declared length
    is then bounded by it before allocation. With ``size=None`` (gzip, pipes)
    data is read in bounded pieces. ``seekable=True`` lets :meth:`entries`
    skip data with ``seek`` instead of reading it. ``path`` only names the
    source in errors. ``framing``: which format (magic, versions, tags) to expect.

    Entries hold the dtype's name and their data as a bytearray;
    :class:`snapsvc.format.fdl.Decoder` gives torch dtypes and tensors
    (through :meth:`_dtype` and :meth:`_read_data`).
    """

    def __init__(self, stream: ReadStream, *, size: int | None = None,
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

    # -- what an entry holds: overridden by fdl.Decoder ------------------
    def _dtype(self, tag: int) -> Any:
        """An entry's dtype, from its (known) tag."""
        return self._framing.tags[tag][0]

    def _read_data(self, nbytes: int, dtype: Any, shape: tuple[int, ...]) -> Any:
        """Read an entry's ``nbytes`` of data."""
        pieces = self._pieces(nbytes, "tensor data", bytearray)
        return pieces[0] if len(pieces) == 1 else bytearray().join(pieces)

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

    def _pieces(self, nbytes: int, what: str,
                alloc: Callable[[int], Any], view: Callable[[Any], memoryview] = memoryview
                ) -> list[Any]:
        """Read ``nbytes`` without trusting them: into one buffer ``alloc(nbytes)``
        when the stream's size bounds them, else into buffers of at most 64 MiB
        allocated as data arrives. ``view`` gives a buffer's writable bytes."""
        self._bound(nbytes, what)
        if self._size is not None or nbytes <= _PIECE:
            buf = alloc(nbytes)
            if nbytes:
                self._readinto(view(buf), what)
            return [buf]
        pieces = []
        left = nbytes
        while left:
            n = min(left, _PIECE)
            piece = alloc(n)
            self._readinto(view(piece), what, nbytes, nbytes - left)
            pieces.append(piece)
            left -= n
        return pieces

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
        known = self._framing.tags.get(tag)
        if known is None:
            raise self._fail(f"unknown dtype tag {tag}; known tags are "
                             f"{sorted(self._framing.tags)}", tag_at)
        (nbytes,) = _U64.unpack(self._read(8, "byte count"))
        expected = numel * known[1]
        if nbytes != expected:
            raise self._fail(f"byte count {nbytes} does not match shape {list(shape)} x "
                             f"{known[1]} bytes ({expected})", self._pos - 8)
        dtype = self._dtype(tag)
        data = None
        if load:
            data = self._read_data(nbytes, dtype, tuple(shape))
        else:
            self._skip(nbytes, "tensor data")
        return Entry(name, tuple(shape), dtype, nbytes, offset, data)

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

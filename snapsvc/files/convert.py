"""Converting between ``.fdl``/``.fdl.gz``, ``.safetensors`` and ``.pt`` state dicts,
and describing a file's entries without loading their data.

Formats, chosen by the path's suffix (:func:`file_format`); :func:`convert_file` goes from one to another:

``.fdl`` / ``.fdl.gz``
    flodl's format (``shared/FORMAT.md``), through :mod:`snapsvc.fdl`; written
    with :func:`snapsvc.save_checkpoint` (atomic, gzip on ``.gz``). It holds
    float16, bfloat16, float32, float64, int32 and int64 only; any other dtype
    is refused with :class:`~snapsvc.errors.EncodeError` naming the entry.

``.safetensors``
    Implemented here, no dependency. Layout: an 8-byte little-endian u64
    ``N``, ``N`` bytes of UTF-8 JSON ``{name: {"dtype", "shape",
    "data_offsets": [begin, end]}, "__metadata__": {str: str}}`` padded with
    spaces to a multiple of 8, then the data buffer. Offsets are relative to
    the buffer; tensors are C-contiguous, little-endian, and together cover
    the buffer exactly (no gaps, no overlap). Reading trusts nothing: the
    header length is bounded by the file and by :data:`MAX_HEADER`, and every
    dtype, shape and offset is checked before any data is read. The structural
    hash of an ``.fdl`` file travels in ``__metadata__`` under
    :data:`HASH_KEY`, so ``.fdl -> .safetensors -> .fdl`` is byte-exact.

``.pt`` / ``.pth``
    A plain ``dict`` of ``str -> Tensor`` written with ``torch.save``; read
    with ``torch.load(weights_only=True, map_location="cpu")`` only, so no
    arbitrary object is ever unpickled. A ``{"state_dict": {...}}`` or
    ``{"model": {...}}`` wrapper is unwrapped when exactly one of those keys
    is present.

All writes to paths are atomic (:mod:`snapsvc.durable`): on any error the
destination is left as it was and no temp file remains. The library never
prints; what a conversion loses (a structural hash, metadata, wrapper keys)
is logged on the ``snapsvc.convert`` logger.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import EncodeError, FormatError
from ..format import fdl
from ..format.streams import open_source
from .checkpoint import save_checkpoint
from .durable import atomic_write

__all__ = [
    "FORMATS",
    "HASH_KEY",
    "MAX_HEADER",
    "SAFETENSORS_DTYPES",
    "Progress",
    "EntryInfo",
    "FileInfo",
    "TensorFile",
    "file_format",
    "describe_file",
    "read_tensors",
    "write_tensors",
    "read_safetensors",
    "write_safetensors",
    "safetensors_header",
    "read_state_dict",
    "write_state_dict",
    "convert_file",
]

log = logging.getLogger("snapsvc.convert")

FORMATS = ("fdl", "safetensors", "pt")
HASH_KEY = "fdl_structural_hash"     # __metadata__ key carrying an .fdl structural hash
MAX_HEADER = 100_000_000             # safetensors' own reader refuses larger headers
_U64 = struct.Struct("<Q")
_CHUNK = 64 << 20

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_DTYPE_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}

# (phase, bytes done, bytes in all or None when unknown); called as work proceeds.
Progress = Callable[[str, int, "int | None"], None]


def _no_progress(phase: str, done: int, total: int | None) -> None:
    pass


def file_format(path: str | os.PathLike[str]) -> str:
    """``"fdl"``, ``"safetensors"`` or ``"pt"`` from the suffix; ValueError otherwise."""
    p = os.fspath(path)
    if p.endswith((".fdl", ".fdl.gz")):
        return "fdl"
    if p.endswith(".safetensors"):
        return "safetensors"
    if p.endswith((".pt", ".pth")):
        return "pt"
    raise ValueError(f"{p}: unknown file type; expected a name ending in .fdl, .fdl.gz, "
                     ".safetensors, .pt or .pth")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _byte_view(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy (empty tensors have none)."""
    if t.numel() == 0:
        return memoryview(b"")
    return fdl._byte_view(t)  # noqa: SLF001 - the codec's own zero-copy view


def _cpu_contiguous(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous()


# -- what a file holds ------------------------------------------------------------
@dataclass(frozen=True)
class EntryInfo:
    """One tensor of a file, described without its data.

    ``offset`` is where the entry starts in the uncompressed ``.fdl`` stream
    (its name length), or where its data starts in a ``.safetensors`` file;
    None for ``.pt``.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    offset: int | None = None


@dataclass
class FileInfo:
    """What :func:`describe_file` found."""

    path: str
    format: str                          # one of FORMATS
    file_bytes: int                      # on disk
    entries: list[EntryInfo]
    version: int | None = None           # .fdl only
    structural_hash: str | None = None   # hex, None when absent or zero
    gzip: bool = False
    metadata: dict[str, str] = field(default_factory=dict)  # safetensors __metadata__

    @property
    def tensor_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


@dataclass
class TensorFile:
    """Tensors in file order, with what the formats can carry beside them."""

    entries: list[tuple[str, torch.Tensor]]
    structural_hash: str | None = None           # hex; only .fdl (and our .safetensors) keep it
    metadata: dict[str, str] = field(default_factory=dict)  # only .safetensors keeps it

    @property
    def tensor_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.entries)


def _describe_fdl(path: str) -> FileInfo:
    with open_source(path) as s:
        dec = fdl.Decoder(s.stream, size=s.size, seekable=s.seekable, path=s.path)
        entries = [EntryInfo(e.name, e.dtype, e.shape, e.nbytes, e.offset)
                   for e in dec.entries(load=False)]
        header = dec.header
        gz = s.gzip
    assert header is not None
    h = header.structural_hash
    return FileInfo(path, "fdl", os.path.getsize(path), entries, header.version,
                    h.hex() if any(h) else None, gz)


def describe_file(path: str | os.PathLike[str], *, format: str | None = None) -> FileInfo:
    """Describe the entries of a file without loading tensor data.

    ``.fdl`` files are walked with the decoder's ``load=False`` (plain files
    seek past the data; gzip is decompressed and discarded), ``.safetensors``
    files by their header alone. A ``.pt`` file cannot be described without
    unpickling it, so it is loaded (``weights_only=True``). ``format``
    overrides the suffix (one of :data:`FORMATS`).
    """
    path = os.fspath(path)
    kind = file_format(path) if format is None else format
    if kind not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {kind!r}")
    if kind == "fdl":
        return _describe_fdl(path)
    if kind == "safetensors":
        header = _read_safetensors_header(path)
        entries = [EntryInfo(e.name, e.dtype, e.shape, e.end - e.begin, header.data_start + e.begin)
                   for e in header.entries]
        return FileInfo(path, kind, header.file_bytes, entries,
                        structural_hash=_hash_from_metadata(header.metadata, path),
                        metadata=header.metadata)
    sd = read_state_dict(path)
    entries = [EntryInfo(n, t.dtype, tuple(t.shape), t.numel() * t.element_size())
               for n, t in sd.items()]
    return FileInfo(path, kind, os.path.getsize(path), entries)


# -- safetensors: read -------------------------------------------------------------
@dataclass(frozen=True)
class _StEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class _StHeader:
    entries: list[_StEntry]      # in data order
    metadata: dict[str, str]
    data_start: int              # 8 + N
    file_bytes: int


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not valid JSON")


def _parse_entry(name: str, info: object, path: str, buffer_len: int) -> _StEntry:
    def fail(msg: str) -> FormatError:
        return FormatError(msg, path=path, entry=name)

    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise fail("tensor name is not valid UTF-8 (a lone surrogate escape)") from None
    if not isinstance(info, dict):
        raise fail(f"expected an object with dtype, shape and data_offsets, "
                   f"got {type(info).__name__}")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in info]
    if missing:
        raise fail(f"tensor info lacks {', '.join(missing)}")
    dtype_name = info["dtype"]
    dtype = SAFETENSORS_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise fail(f"unknown dtype {dtype_name!r}; known dtypes are "
                   f"{', '.join(SAFETENSORS_DTYPES)}")
    shape = info["shape"]
    if not isinstance(shape, list) or not all(_is_int(d) for d in shape):
        raise fail(f"shape {shape!r} is not a list of integers")
    if len(shape) > fdl.MAX_NDIM:
        raise fail(f"rank {len(shape)} exceeds {fdl.MAX_NDIM}")
    if any(d < 0 for d in shape):
        raise fail(f"negative dimension in shape {shape}")
    offsets = info["data_offsets"]
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise fail(f"data_offsets {offsets!r} is not a list of two integers")
    begin, end = offsets
    if not 0 <= begin <= end <= buffer_len:
        raise fail(f"data_offsets [{begin}, {end}] are outside the {buffer_len}-byte data buffer")
    numel = 1
    for d in shape:
        numel *= d
    expected = numel * dtype.itemsize
    if end - begin != expected:
        raise fail(f"data_offsets [{begin}, {end}] hold {end - begin} bytes but shape {shape} "
                   f"x {dtype.itemsize} bytes ({dtype_name}) needs {expected}")
    return _StEntry(name, dtype, tuple(shape), begin, end)


def _read_safetensors_header(path: str) -> _StHeader:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise FormatError(f"file is {size} bytes, too short for the 8-byte safetensors "
                              "header length", path=path, offset=0)
        (n,) = _U64.unpack(head)
        if n > size - 8:
            raise FormatError(f"header length {n} exceeds the {size - 8} bytes that follow it",
                              path=path, offset=0)
        if n > MAX_HEADER:
            raise FormatError(f"header length {n} exceeds the limit of {MAX_HEADER} bytes",
                              path=path, offset=0)
        raw = f.read(n)
    if len(raw) != n:
        raise FormatError(f"truncated: header needs {n} bytes, file ends after {len(raw)}",
                          path=path, offset=8)
    if not raw.startswith(b"{"):
        raise FormatError("header is not a JSON object (it must start with '{')",
                          path=path, offset=8)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates,
                            parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        reason = str(e) or type(e).__name__
        raise FormatError(f"header is not valid UTF-8 JSON ({reason})", path=path,
                          offset=8) from None
    if not isinstance(header, dict):  # pragma: no cover - '{' start makes it an object
        raise FormatError("header is not a JSON object", path=path, offset=8)

    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise FormatError("__metadata__ must map strings to strings", path=path, offset=8)

    data_start = 8 + n
    buffer_len = size - data_start
    parsed = [_parse_entry(name, info, path, buffer_len) for name, info in header.items()]
    # The entries must tile the buffer: sorted by offsets, each begins where the
    # previous ended, the first at 0, the last at the buffer's end.
    ordered = sorted(parsed, key=lambda e: (e.begin, e.end))
    at = 0
    prev: str | None = None
    for e in ordered:
        if e.begin != at:
            what = "overlaps" if e.begin < at else f"leaves a gap of {e.begin - at} bytes after"
            other = repr(prev) if prev is not None else "the buffer start"
            raise FormatError(f"data_offsets [{e.begin}, {e.end}] {what} {other} "
                              f"(which ends at {at}); tensors must be contiguous",
                              path=path, entry=e.name)
        at = e.end
        prev = e.name
    if at != buffer_len:
        raise FormatError(f"{buffer_len - at} bytes of the data buffer belong to no tensor "
                          f"(tensors end at {at}, the buffer at {buffer_len})",
                          path=path, offset=data_start + at)
    return _StHeader(ordered, dict(metadata), data_start, size)


def _hash_from_metadata(metadata: Mapping[str, str], path: str) -> str | None:
    value = metadata.get(HASH_KEY)
    if value is None:
        return None
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        raw = b""
    if len(raw) != fdl.HASH_LEN:
        log.warning("%s: ignoring __metadata__[%r]: not %d hex characters", path, HASH_KEY,
                    2 * fdl.HASH_LEN)
        return None
    return raw.hex() if any(raw) else None


def read_safetensors(path: str | os.PathLike[str], *,
                     progress: Progress | None = None) -> TensorFile:
    """Read a ``.safetensors`` file, entries in data order (validated before any data)."""
    path = os.fspath(path)
    progress = progress or _no_progress
    header = _read_safetensors_header(path)
    total = header.file_bytes - header.data_start
    entries = []
    with open(path, "rb") as f:
        f.seek(header.data_start)
        done = 0
        progress("reading", 0, total)
        for e in header.entries:
            nbytes = e.end - e.begin
            buf = torch.empty(nbytes, dtype=torch.uint8)
            view = _byte_view(buf)
            got = 0
            while got < nbytes:  # the file may have shrunk since the header was checked
                k = f.readinto(view[got:got + _CHUNK])
                if not k:
                    raise FormatError(f"truncated: data needs {nbytes} bytes, file ends after "
                                      f"{got}", path=path, offset=header.data_start + e.begin,
                                      entry=e.name)
                got += k
                progress("reading", done + got, total)
            done += nbytes
            if e.dtype is torch.bool and nbytes and bool((buf > 1).any()):
                raise FormatError("BOOL data holds bytes other than 0 and 1", path=path,
                                  offset=header.data_start + e.begin, entry=e.name)
            entries.append((e.name, buf.view(e.dtype).reshape(e.shape)))
        progress("reading", total, total)
    return TensorFile(entries, _hash_from_metadata(header.metadata, path), header.metadata)


# -- safetensors: write ------------------------------------------------------------
def _check_safetensors_entry(name: object, t: object) -> str:
    if not isinstance(name, str):
        raise EncodeError(f"entry name {name!r} is not a str")
    if name == "__metadata__":
        raise EncodeError("entry '__metadata__': the name is reserved by safetensors")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as e:
        raise EncodeError(f"entry {name!r}: name is not encodable as UTF-8 ({e})") from None
    if not isinstance(t, torch.Tensor):
        raise EncodeError(f"entry {name!r}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided or t.is_quantized:
        raise EncodeError(f"entry {name!r}: only dense tensors can be written "
                          f"({t.layout}{', quantized' if t.is_quantized else ''})")
    if t.device.type == "meta":
        raise EncodeError(f"entry {name!r}: a meta tensor has no data to write")
    code = _DTYPE_NAMES.get(t.dtype)
    if code is None:
        raise EncodeError(f"entry {name!r}: dtype {t.dtype} has no safetensors code; "
                          f"supported dtypes are "
                          f"{', '.join(_dtype_name(d) for d in SAFETENSORS_DTYPES.values())}")
    return code


def safetensors_header(entries: list[tuple[str, torch.Tensor]],
                       metadata: Mapping[str, str] | None = None) -> bytes:
    """The 8-byte length and the space-padded JSON header for ``entries``, in order."""
    header: dict[str, object] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise EncodeError("safetensors metadata must map str to str")
        header["__metadata__"] = dict(metadata)
    at = 0
    for name, t in entries:
        code = _check_safetensors_entry(name, t)
        if name in header:
            raise EncodeError(f"entry {name!r} appears twice; names must be unique")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [at, at + nbytes]}
        at += nbytes
    raw = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return _U64.pack(len(raw)) + raw


def write_safetensors(path: str | os.PathLike[str], entries: list[tuple[str, torch.Tensor]], *,
                      metadata: Mapping[str, str] | None = None,
                      progress: Progress | None = None) -> None:
    """Write ``entries`` in order as ``.safetensors``, atomically.

    ``metadata`` goes in ``__metadata__``, with ``"format": "pt"`` unless it
    says otherwise (transformers expects that key of a torch file). Every entry is checked before the file is created; an unsupported one
    raises :class:`EncodeError` naming it.
    """
    progress = progress or _no_progress
    head = safetensors_header(entries, {"format": "pt", **(metadata or {})})
    total = sum(t.numel() * t.element_size() for _, t in entries)
    done = 0
    with atomic_write(path) as out:
        out.write(head)
        progress("writing", 0, total)
        for _, t in entries:
            t = _cpu_contiguous(t)
            view = _byte_view(t)
            for i in range(0, len(view), _CHUNK):
                out.write(view[i:i + _CHUNK])
                done += min(_CHUNK, len(view) - i)
                progress("writing", done, total)


# -- .pt ----------------------------------------------------------------------------
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _torch_load_reason(e: BaseException) -> str:
    """One line from torch.load's error: for a weights-only refusal, the reason
    (not the advice to load with ``weights_only=False``)."""
    text = _ANSI.sub("", str(e)).strip()
    lines = [ln.strip() for ln in text.splitlines()]
    if lines and lines[0].startswith("Weights only load failed"):
        for ln in lines[1:]:
            if ln.startswith(("(1)", "(2)", "Check the documentation", "Please file an issue")):
                continue
            ln = ln.partition("WeightsUnpickler error:")[2].strip() or ln
            ln = ln.split(" Please use ")[0].strip()
            if ln and not ln.startswith("WeightsUnpickler error"):
                return f"torch refused to unpickle it with weights_only=True: {ln}"
        return "torch refused to unpickle it with weights_only=True"
    return next((ln for ln in lines if ln), type(e).__name__)


def _tensor_mapping(obj: object, path: str, where: str = "") -> dict[str, torch.Tensor] | None:
    """``obj`` as str -> Tensor, None if it is no mapping; FormatError on a bad value."""
    if not isinstance(obj, Mapping):
        return None
    out: dict[str, torch.Tensor] = {}
    for k, v in obj.items():
        name = f"{where}{k}" if isinstance(k, str) else repr(k)
        if not isinstance(k, str):
            raise FormatError(f"key {k!r} is not a str; a state dict maps names to tensors",
                              path=path)
        if not isinstance(v, torch.Tensor):
            raise FormatError(f"expected a torch.Tensor, got {type(v).__name__}; a state "
                              "dict maps names to tensors", path=path, entry=name)
        out[k] = v
    return out


def read_state_dict(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Load a ``.pt`` state dict with ``torch.load(weights_only=True)``, on the CPU.

    The file must hold a mapping of str to Tensor, or a mapping with exactly
    one of the keys ``state_dict`` and ``model`` whose value is one (the
    other keys, such as an optimizer's state, are ignored and logged).
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        try:
            obj = torch.load(f, weights_only=True, map_location="cpu")
        except Exception as e:  # torch raises many unrelated types for a bad file
            raise FormatError(f"not a loadable weights-only torch file: {_torch_load_reason(e)}",
                              path=path) from None
    if not isinstance(obj, Mapping):
        raise FormatError(f"holds a {type(obj).__name__}, not a mapping of names to tensors",
                          path=path)
    if all(isinstance(v, torch.Tensor) for v in obj.values()):
        return _tensor_mapping(obj, path) or {}
    wrappers = [k for k in ("state_dict", "model") if k in obj]
    if len(wrappers) == 1 and isinstance(obj[wrappers[0]], Mapping):
        key = wrappers[0]
        others = [str(k) for k in obj if k != key]
        if others:
            log.info("%s: using %r, ignoring the other keys %s", path, key, others[:10])
        return _tensor_mapping(obj[key], path, f"{key}.") or {}
    if len(wrappers) == 2:
        raise FormatError("holds both 'state_dict' and 'model'; cannot tell which is the "
                          "state dict", path=path)
    return _tensor_mapping(obj, path) or {}  # raises, naming the first non-tensor


def write_state_dict(path: str | os.PathLike[str], entries: list[tuple[str, torch.Tensor]]) -> None:
    """``torch.save`` a plain dict of CPU tensors, atomically."""
    sd: dict[str, torch.Tensor] = {}
    for name, t in entries:
        if not isinstance(name, str):
            raise EncodeError(f"entry name {name!r} is not a str")
        if not isinstance(t, torch.Tensor):
            raise EncodeError(f"entry {name!r}: expected a torch.Tensor, got {type(t).__name__}")
        if name in sd:
            raise EncodeError(f"entry {name!r} appears twice; names must be unique")
        t = _cpu_contiguous(t)
        if t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()  # a view: save its own bytes, not the whole storage behind it
        sd[name] = t
    with atomic_write(path) as out:
        torch.save(sd, out)


# -- any format ---------------------------------------------------------------------
def _read_fdl(path: str, progress: Progress) -> TensorFile:
    with open_source(path) as s:
        dec = fdl.Decoder(s.stream, size=s.size, path=s.path)
        total = s.size  # None for gzip: the uncompressed length is unknown
        progress("reading", 0, total)
        entries = []
        for e in dec.entries():
            entries.append((e.name, e.tensor))
            progress("reading", e.offset + e.nbytes, total)
        header = dec.header
    assert header is not None
    progress("reading", total or 0, total)
    h = header.structural_hash
    return TensorFile(entries, h.hex() if any(h) else None)  # type: ignore[arg-type]


def read_tensors(path: str | os.PathLike[str], *, progress: Progress | None = None) -> TensorFile:
    """Read any supported file (by suffix) into a :class:`TensorFile`."""
    path = os.fspath(path)
    progress = progress or _no_progress
    kind = file_format(path)
    if kind == "fdl":
        return _read_fdl(path, progress)
    if kind == "safetensors":
        return read_safetensors(path, progress=progress)
    progress("reading", 0, None)
    tf = TensorFile(list(read_state_dict(path).items()))
    progress("reading", tf.tensor_bytes, tf.tensor_bytes)
    return tf


def write_tensors(path: str | os.PathLike[str], tf: TensorFile, *,
                  progress: Progress | None = None) -> None:
    """Write ``tf`` in the format ``path`` names, atomically."""
    path = os.fspath(path)
    progress = progress or _no_progress
    kind = file_format(path)
    total = tf.tensor_bytes
    if kind == "safetensors":
        metadata = dict(tf.metadata)
        if tf.structural_hash:
            metadata[HASH_KEY] = tf.structural_hash
        else:
            metadata.pop(HASH_KEY, None)
        write_safetensors(path, tf.entries, metadata=metadata, progress=progress)
        return
    progress("writing", 0, total)
    if kind == "fdl":
        save_checkpoint(path, tf.entries, structural_hash=tf.structural_hash)
    else:
        write_state_dict(path, tf.entries)
    progress("writing", total, total)


def convert_file(src: str | os.PathLike[str], dst: str | os.PathLike[str], *,
            progress: Progress | None = None) -> TensorFile:
    """Convert ``src`` to ``dst``, formats chosen by suffix; returns what was read.

    Tensors are copied bit for bit, in order. ``dst`` is written atomically:
    when a tensor cannot go into ``dst``'s format (say a bool tensor into
    ``.fdl``) :class:`EncodeError` names it and ``dst`` is not touched.
    """
    src, dst = os.fspath(src), os.fspath(dst)
    src_kind, dst_kind = file_format(src), file_format(dst)
    tf = read_tensors(src, progress=progress)
    if tf.structural_hash and dst_kind == "pt":
        log.info("%s: the structural hash %s is not kept in .pt", dst, tf.structural_hash)
    extra = {k: v for k, v in tf.metadata.items() if k != HASH_KEY}
    if extra and dst_kind != "safetensors" and src_kind == "safetensors":
        log.info("%s: safetensors metadata %s is not kept in .%s", dst, sorted(extra), dst_kind)
    write_tensors(dst, tf, progress=progress)
    return tf

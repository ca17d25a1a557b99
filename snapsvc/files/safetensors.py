"""The ``.safetensors`` format, read and written here with no dependency.

Layout::

    | N: u64 little-endian | N bytes of UTF-8 JSON, space-padded to 8 | data buffer |
      {name: {"dtype", "shape", "data_offsets": [begin, end]},
       "__metadata__": {str: str}}

Offsets are relative to the buffer; tensors are C-contiguous, little-endian,
and together cover the buffer exactly (no gaps, no overlap). Reading trusts
nothing: the header length is bounded by the file and by :data:`MAX_HEADER`,
and every dtype, shape and offset is checked before any data is read. The
structural hash of an ``.fdl`` file travels in ``__metadata__`` under
:data:`HASH_KEY`, so ``.fdl -> .safetensors -> .fdl`` is byte-exact.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
import torch

from ..errors import EncodeError, FormatError
from ..format import fdl
from .durable import atomic_write
from .tensors import Progress, TensorFile, _byte_view, _cpu_contiguous, _dtype_name, _no_progress

__all__ = ["HASH_KEY", "MAX_HEADER", "SAFETENSORS_DTYPES", "read_safetensors", "write_safetensors", "safetensors_header"]

log = logging.getLogger("snapsvc.convert")


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
    problem = fdl.shape_problem(shape)
    if problem:
        raise fail(problem)
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
    ordered = sorted(parsed, key=lambda p: (p.begin, p.end))
    at = 0
    prev: str | None = None
    for ent in ordered:
        if ent.begin != at:
            what = "overlaps" if ent.begin < at else f"leaves a gap of {ent.begin - at} bytes after"
            other = repr(prev) if prev is not None else "the buffer start"
            raise FormatError(f"data_offsets [{ent.begin}, {ent.end}] {what} {other} "
                              f"(which ends at {at}); tensors must be contiguous",
                              path=path, entry=ent.name)
        at = ent.end
        prev = ent.name
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
            entries.append((e.name, fdl.check_bools(buf.view(e.dtype).reshape(e.shape),
                                                    path=path, entry=e.name,
                                                    offset=header.data_start + e.begin)))
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

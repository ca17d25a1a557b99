"""The ``.fdl`` checkpoint codec (flodl format version 2), pure and streaming.

This module turns (name, tensor) pairs into bytes and back: the trainer's
side of the codec. The format itself (tags, headers, the encoder and the
decoder) is :mod:`snapsvc.format.framing`, which knows no torch: this module
hands it each tensor as a byte span of its memory and makes tensors of what
it decodes, so the writer sidecar encodes the same bytes without torch. It
opens no files, starts no processes or threads: it writes to any object with
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
import functools
from typing import Any, BinaryIO, Iterable

import torch

from ..errors import EncodeError, FormatError
from . import framing as _framing
from .framing import (FDL, HASH_LEN, MAGIC, MAX_NAME_LEN, MAX_NDIM, SUPPORTED_VERSIONS, VERSION,
                      Entry, Framing, Header, Span, check_name, check_unique, shape_problem)

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
    "DTYPES",
    "dtype_tags",
    "tag_dtypes",
    "span",
    "Decoder",
    "check_bools",
]

# flodl's tags as torch dtypes (framing.FDL_TAGS names them): both directions
# written out, so a reader of this file sees the contract.
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


# Every dtype either file stores, by the name framing's tables (and a slot
# layout) give it: torch's own name, without "torch.".
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name)
                                  for f in (FDL, _framing.DATA) for name in f.tag_of}


@functools.cache
def dtype_tags(framing: Framing) -> dict[torch.dtype, int]:
    """``framing``'s tags by torch dtype."""
    return {DTYPES[name]: tag for name, tag in framing.tag_of.items()}


@functools.cache
def tag_dtypes(framing: Framing) -> dict[int, torch.dtype]:
    """``framing``'s torch dtypes by tag."""
    return {tag: dtype for dtype, tag in dtype_tags(framing).items()}


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


def check_encodable(name: object, tensor: object, framing: Framing = FDL) -> bytes:
    """Return ``name`` as UTF-8, or raise :class:`EncodeError` saying why not."""
    raw = check_name(name)
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
    if tensor.dtype not in dtype_tags(framing):
        raise EncodeError(f"entry {name!r}: dtype {tensor.dtype} has no {framing.name} tag; "
                          f"supported dtypes are {framing.dtype_names}")
    if tensor.dim() > MAX_NDIM:
        raise EncodeError(f"entry {name!r}: rank {tensor.dim()} exceeds {MAX_NDIM}")
    return raw


def check_entries(pairs: list[tuple[str, torch.Tensor]], framing: Framing = FDL) -> list[bytes]:
    """The UTF-8 names of ``pairs``, or :class:`EncodeError`: an entry that
    cannot be written, or a name twice (names in one file must be unique)."""
    raw_names = [check_encodable(name, t, framing) for name, t in pairs]
    check_unique(name for name, _ in pairs)
    return raw_names


def check_bools(t: torch.Tensor, *, path: str | None, entry: str | None,
                offset: int | None) -> torch.Tensor:
    """``t``, or a :class:`FormatError` when ``t`` is a bool tensor holding a byte
    other than 0 and 1 (torch would hand such a tensor out, and comparisons on it
    go wrong silently). ``offset``: where ``t``'s data starts in the file, so the
    error names the first bad byte's offset. Every reader of bool data calls this."""
    if t.dtype is not torch.bool or not t.numel():
        return t
    raw = t.reshape(-1).view(torch.uint8)
    bad = (raw > 1).nonzero()
    if not len(bad):
        return t
    first = int(bad[0])
    raise FormatError(f"bool tensor of shape {list(t.shape)} holds the byte "
                      f"{int(raw[first]):#04x} at byte {first} of its data, a byte other than "
                      "0 and 1: the file is corrupt", path=path, entry=entry,
                      offset=None if offset is None else offset + first)


def encoded_size(entries: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Bytes the uncompressed stream for ``entries`` will take."""
    total = _framing._HEADER.size
    for name, t in entries:
        total += (_framing._MIN_ENTRY + len(name.encode("utf-8")) + 8 * t.dim()
                  + t.numel() * t.element_size())
    return total


def span(name: str, t: torch.Tensor, framing: Framing = FDL) -> Span:
    """A checked tensor as the framing encodes it: ``(name, tag, shape, data)``.

    A contiguous CPU tensor's data is a byte view of its memory (written with
    its values of then); any other tensor is copied to the CPU when written,
    one at a time.
    """
    t = t.detach()
    tag = dtype_tags(framing)[t.dtype]
    if t.is_cpu and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
        return name, tag, tuple(t.shape), _byte_view(t) if t.numel() else b""
    return name, tag, tuple(t.shape), lambda: _byte_view(
        t.cpu().contiguous().resolve_conj().resolve_neg())


class Encoder(_framing.Encoder):
    """(name, tensor) pairs checked and laid out once, to be written any number of times.

    Each tensor is checked (:func:`check_entries`) and handed to the
    framing's :class:`~snapsvc.format.framing.Encoder` as a byte span of its
    memory (:func:`span`): the same encoder the writer sidecar runs over its
    shared-memory slots, so both write the same bytes. :meth:`write` writes
    the tensors' values of then; small ones are gathered in ~1 MiB writes,
    large ones go to ``writer.write`` straight from their memory, and tensors
    on another device, or not contiguous, are copied to the CPU one at a time
    when written, never all at once.
    """

    def __init__(self, entries: Iterable[tuple[str, torch.Tensor]], *,
                 structural_hash: bytes | None = None, framing: Framing = FDL) -> None:
        pairs = list(entries)
        check_entries(pairs, framing)
        super().__init__([span(name, t, framing) for name, t in pairs],
                         structural_hash=structural_hash, framing=framing)


def encode(writer: BinaryIO, entries: Iterable[tuple[str, torch.Tensor]], *,
           structural_hash: bytes | None = None, framing: Framing = FDL) -> int:
    """Write ``entries`` as one ``.fdl`` stream to ``writer``; return bytes written.

    Every entry is validated before the first byte is written, so a refused
    dtype or a duplicate name leaves ``writer`` untouched. See
    :class:`Encoder` for how the data goes out: the whole file is never
    built in memory.
    """
    return Encoder(entries, structural_hash=structural_hash, framing=framing).write(writer)


class Decoder(_framing.Decoder):
    """Streaming reader of one ``.fdl`` stream (or another ``framing``), as tensors.

    See :class:`snapsvc.format.framing.Decoder` for ``size``, ``seekable``,
    ``path`` and ``framing``: this one gives each entry's torch dtype and,
    when loaded, its data as a fresh CPU tensor.
    """

    def _dtype(self, tag: int) -> torch.dtype:
        return tag_dtypes(self._framing)[tag]

    def _read_data(self, nbytes: int, dtype: Any, shape: tuple[int, ...]) -> torch.Tensor:
        pieces = self._pieces(nbytes, "tensor data",
                              lambda n: torch.empty(n, dtype=torch.uint8), _byte_view)
        data = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        return check_bools(data.view(dtype).reshape(shape), path=self._path, entry=self._entry,
                           offset=self._pos - nbytes)

"""The data file: a checkpoint's tensors whose dtype ``.fdl`` has no tag for.

flodl's ``.fdl`` tags six dtypes (:data:`snapsvc.format.fdl.DTYPE_TO_TAG`).
A state's other tensors (bool masks, uint8 RNG states, int8 quantized
weights, complex, float8) go through the same shared-memory slot as the rest
and are written to a file of their own beside the checkpoint,
``<checkpoint>.data`` (``x.fdl`` -> ``x.fdl.data``; ``x.fdl.gz`` ->
``x.fdl.data.gz``, gzip like its checkpoint), so the ``.fdl`` stays exactly
what flodl loads. Its bytes are ``.fdl``'s framing (``fdl.py`` draws it)
with this module's magic, version and dtype tags::

    magic b"SNPD" | u32 version 1 | 32 zero bytes | u32 count | count x entry
    entry: u32 name_len | name | u32 ndim | ndim x i64 shape | u8 tag | u64 nbytes | data

The same decoder reads it, so every declared length is bounded before
anything is allocated and a cut file is a FormatError naming file and offset.
The torch-free part (magic, tags by name, :data:`DATA`) is in
:mod:`snapsvc.format.framing`, for the writer sidecar; this module adds the
torch dtypes.
"""

from __future__ import annotations

import torch

from ..errors import EncodeError
from . import fdl, framing

__all__ = ["MAGIC", "VERSION", "DTYPE_TO_TAG", "TAG_TO_DTYPE", "DATA", "framing_of",
           "check_entries"]

MAGIC = framing.DATA_MAGIC
VERSION = framing.DATA_VERSION

# snapsvc's own tags, not flodl's, as torch dtypes (framing.DATA_TAGS names
# them): both directions written out.
DTYPE_TO_TAG: dict[torch.dtype, int] = {
    torch.bool: 1,
    torch.uint8: 2,
    torch.int8: 3,
    torch.int16: 4,
    torch.uint16: 5,
    torch.uint32: 6,
    torch.uint64: 7,
    torch.complex64: 8,
    torch.complex128: 9,
    torch.float8_e4m3fn: 10,
    torch.float8_e5m2: 11,
}
TAG_TO_DTYPE: dict[int, torch.dtype] = {
    1: torch.bool,
    2: torch.uint8,
    3: torch.int8,
    4: torch.int16,
    5: torch.uint16,
    6: torch.uint32,
    7: torch.uint64,
    8: torch.complex64,
    9: torch.complex128,
    10: torch.float8_e4m3fn,
    11: torch.float8_e5m2,
}

DATA = framing.DATA


def framing_of(dtype: torch.dtype | None) -> fdl.Framing | None:
    """The file a tensor of ``dtype`` is written to: ``.fdl``, the data file, or None
    (a dtype snapsvc cannot store)."""
    if dtype in fdl.DTYPE_TO_TAG:
        return fdl.FDL
    return DATA if dtype in DTYPE_TO_TAG else None


def check_entries(pairs: list[tuple[str, torch.Tensor]]) -> None:
    """:func:`fdl.check_entries` for a checkpoint and its data file together: each
    entry checked for the file its dtype goes to, names unique across both."""
    for name, t in pairs:
        to = framing_of(getattr(t, "dtype", None))
        if to is None and isinstance(t, torch.Tensor):
            raise EncodeError(f"entry {name!r}: dtype {t.dtype} cannot be stored; the .fdl takes "
                              f"{fdl.FDL.dtype_names}, the data file {DATA.dtype_names}")
        fdl.check_encodable(name, t, to or fdl.FDL)
    framing.check_unique((name for name, _ in pairs), "checkpoint")

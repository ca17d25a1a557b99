"""The metadata sidecar written beside each checkpoint: ``<checkpoint>.meta``.

A msgpack map that says what the ``.fdl`` alone cannot: epoch and metrics,
which entries are buffers, and the size and CRC-32 of the checkpoint file so
:func:`snapsvc.verify` can detect corruption. flodl ignores it and loads the
``.fdl`` on its own.

Order of writes: the checkpoint is renamed into place (durably) *before* its
metadata is written. A checkpoint without metadata is therefore an unfinished
write (the writer died between the two renames) and is not to be trusted as
the latest snapshot.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack

from .durable import atomic_write
from .errors import FormatError

__all__ = ["META_SUFFIX", "META_VERSION", "Meta", "meta_path", "write_meta", "read_meta"]

META_SUFFIX = ".meta"
META_MAGIC = "snapsvc-meta"
META_VERSION = 1
_MAX_META = 64 << 20  # a metadata file is small; refuse to slurp anything huge


def meta_path(checkpoint: str | os.PathLike[str]) -> str:
    return os.fspath(checkpoint) + META_SUFFIX


@dataclass
class Meta:
    format_version: int
    size: int                      # checkpoint file bytes on disk
    crc32: int                     # of those bytes
    entries: int
    buffers: list[str] = field(default_factory=list)
    epoch: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    structural_hash: str | None = None
    created: float = field(default_factory=time.time)
    extra: Any = None


def write_meta(checkpoint: str | os.PathLike[str], meta: Meta) -> None:
    """Durably write ``meta`` beside ``checkpoint`` (after the checkpoint is in place)."""
    body = msgpack.packb({"magic": META_MAGIC, "meta_version": META_VERSION, **asdict(meta)},
                         use_bin_type=True)
    with atomic_write(meta_path(checkpoint)) as out:
        out.write(body)


def read_meta(checkpoint: str | os.PathLike[str]) -> Meta:
    """Read the metadata of ``checkpoint``; FormatError if absent or malformed."""
    path = meta_path(checkpoint)
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_META + 1)
    except FileNotFoundError:
        raise FormatError("no metadata file: the checkpoint is an unfinished write, or was "
                          "not written by snapsvc (read_checkpoint reads its entries)",
                          path=path) from None
    if len(data) > _MAX_META:
        raise FormatError(f"metadata is larger than {_MAX_META} bytes", path=path)
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types
        raise FormatError(f"metadata is not valid msgpack ({e})", path=path) from None
    if not isinstance(raw, dict) or raw.get("magic") != META_MAGIC:
        raise FormatError(f"not a snapsvc metadata file (expected magic {META_MAGIC!r})",
                          path=path)
    if raw.get("meta_version") != META_VERSION:
        raise FormatError(f"metadata version {raw.get('meta_version')!r}; this snapsvc reads "
                          f"version {META_VERSION}", path=path)
    fields = {k: raw[k] for k in Meta.__dataclass_fields__ if k in raw}
    try:
        return Meta(**fields)
    except TypeError as e:
        raise FormatError(f"metadata lacks a field ({e})", path=path) from None

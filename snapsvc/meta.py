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
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import msgpack

import torch

from . import fdl
from .checkpoint import FileStats, stage_checkpoint_file
from .durable import DurableFile, commit, discard, staged_write
from .errors import FormatError

__all__ = ["META_SUFFIX", "META_VERSION", "Meta", "meta_path", "stage_meta", "write_with_meta",
           "read_meta", "read_msgpack_file"]

META_SUFFIX = ".meta"
META_MAGIC = "snapsvc-meta"
META_VERSION = 1
_MAX_META = 64 << 20  # a metadata file is small; refuse to slurp anything huge


def meta_path(checkpoint: str | os.PathLike[str]) -> str:
    return os.fspath(checkpoint) + META_SUFFIX


@dataclass
class Meta:
    format_version: int = fdl.VERSION
    size: int = 0                  # checkpoint file bytes on disk
    crc32: int = 0                 # of those bytes
    entries: int = 0
    buffers: list[str] = field(default_factory=list)
    epoch: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    structural_hash: str | None = None
    created: float = field(default_factory=time.time)
    extra: Any = None
    # class, param groups, non-tensor state, and "file", "size", "crc32", "entries"
    # of the optimizer file (snapsvc.resume); None when none was saved
    optimizer: dict[str, Any] | None = None


def stage_meta(checkpoint: str | os.PathLike[str], meta: Meta) -> DurableFile:
    """``meta`` in a fsynced temp file beside ``checkpoint``, to be committed after it."""
    body = msgpack.packb({"magic": META_MAGIC, "meta_version": META_VERSION, **asdict(meta)},
                         use_bin_type=True)
    with staged_write(meta_path(checkpoint)) as out:
        out.write(body)
    return out


def write_with_meta(path: str | os.PathLike[str], entries: list[tuple[str, torch.Tensor]],
                    meta: Meta, *, compress_level: int | None = None,
                    optim: tuple[str, list[tuple[str, torch.Tensor]]] | None = None) -> FileStats:
    """Write a checkpoint, optionally its optimizer file, and its metadata.

    All are staged (temp file, fsync), then renamed in the order checkpoint,
    optimizer file, metadata. ``meta``'s size, checksum, entry count and
    version are filled in here; ``optim`` is (path, entries) and its
    description must already be in ``meta.optimizer``. A failure before the
    renames leaves any previous files of those names untouched, and no temp file.
    """
    hash_ = bytes.fromhex(meta.structural_hash) if meta.structural_hash else bytes(fdl.HASH_LEN)
    staged: list[DurableFile] = []
    try:
        ck, stream_bytes, encode_s = stage_checkpoint_file(path, entries, hash_,
                                                           compress_level=compress_level)
        staged.append(ck)
        meta = replace(meta, format_version=fdl.VERSION, size=ck.size, crc32=ck.crc32,
                       entries=len(entries))
        if optim is not None:
            opath, oentries = optim
            of, _, o_encode_s = stage_checkpoint_file(opath, oentries, bytes(fdl.HASH_LEN),
                                                      compress_level=compress_level)
            staged.append(of)
            encode_s += o_encode_s
            meta = replace(meta, optimizer={**(meta.optimizer or {}),
                                            "file": os.path.basename(opath), "size": of.size,
                                            "crc32": of.crc32, "entries": len(oentries)})
        staged.append(stage_meta(path, meta))
    except BaseException:
        discard(*staged)
        raise
    commit(*staged)
    return FileStats(ck.path, ck.size, ck.crc32, stream_bytes, encode_s,
                     sum(f.write_s for f in staged), sum(f.fsync_s for f in staged))


def read_msgpack_file(path: str, *, what: str, magic: str, version_key: str, version: int,
                      missing: str, limit: int = _MAX_META) -> dict[str, Any]:
    """Read a small snapsvc msgpack map (metadata, manifest), checking size,
    encoding, magic and version; every failure is a FormatError naming ``path``."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except FileNotFoundError:
        raise FormatError(missing, path=path) from None
    if len(data) > limit:
        raise FormatError(f"{what} is larger than {limit} bytes", path=path)
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types
        raise FormatError(f"{what} is not valid msgpack ({e})", path=path) from None
    if not isinstance(raw, dict) or raw.get("magic") != magic:
        raise FormatError(f"not a snapsvc {what} file (expected magic {magic!r})", path=path)
    if raw.get(version_key) != version:
        raise FormatError(f"{what} version {raw.get(version_key)!r}; this snapsvc reads "
                          f"version {version}", path=path)
    return raw


def read_meta(checkpoint: str | os.PathLike[str]) -> Meta:
    """Read the metadata of ``checkpoint``; FormatError if absent or malformed."""
    path = meta_path(checkpoint)
    raw = read_msgpack_file(
        path, what="metadata", magic=META_MAGIC, version_key="meta_version",
        version=META_VERSION, missing="no metadata file: the checkpoint is an unfinished "
        "write, or was not written by snapsvc (read_checkpoint reads its entries)")
    fields = {k: raw[k] for k in Meta.__dataclass_fields__ if k in raw}
    try:
        return Meta(**fields)
    except TypeError as e:
        raise FormatError(f"metadata lacks a field ({e})", path=path) from None

"""The metadata sidecar written beside each checkpoint: ``<checkpoint>.meta``.

A msgpack map that says what the ``.fdl`` alone cannot: epoch and metrics,
which entries are buffers, and the size and CRC-32 of the checkpoint file (and
of its optimizer file and data file, when it has them) so
:func:`snapsvc.verify` can detect corruption. flodl ignores it and loads the
``.fdl`` on its own.

The metadata itself, a checkpoint's file names and the durable write of a
checkpoint from encoders are :mod:`snapsvc.files.metafile` (no torch: the
writer sidecar and the uploader import that); this module adds the two ends
that deal in tensors: :func:`write_with_meta` of (name, tensor) pairs, and
:func:`read_with_data`.
"""

from __future__ import annotations

import os
from typing import Callable, Union

import torch

from ..errors import FormatError
from ..format import datafile, fdl, framing
from . import metafile
from .checkpoint import Checkpoint, read_verified
from .fused import Pairs
from .metafile import (DATA_SUFFIX, META_SUFFIX, META_VERSION, Companion, FileStats, Meta,
                       checkpoint_names, companions, data_owner, data_path, meta_path, optim_path,
                       parse_meta, read_meta, read_msgpack_file, stage_meta, unpack_msgpack_map)

__all__ = ["META_SUFFIX", "META_VERSION", "DATA_SUFFIX", "Meta", "Companion", "meta_path",
           "optim_path", "data_path", "data_owner", "checkpoint_names", "companions", "stage_meta",
           "write_with_meta", "read_meta", "parse_meta", "read_msgpack_file",
           "unpack_msgpack_map", "read_with_data", "read_data_file", "read_companion"]

Entries = Union[list[tuple[str, torch.Tensor]], framing.Encoder]


def write_with_meta(path: str | os.PathLike[str], entries: Entries, meta: Meta, *,
                    compress_level: int | None = None,
                    optim: tuple[str, Entries] | None = None,
                    data: framing.Encoder | None = None,
                    trash: list[str] | None = None) -> FileStats:
    """:func:`snapsvc.files.metafile.write_with_meta` of (name, tensor) pairs:
    ``entries`` and ``optim``'s may be lists of pairs (encoded with
    ``meta.structural_hash``, the optimizer file with none) or encoders. Pairs
    of ``entries`` of dtypes ``.fdl`` has no tag for (a bool buffer) go to the
    data file, unless ``data`` is given."""
    hash_ = bytes.fromhex(meta.structural_hash) if meta.structural_hash else None
    if not isinstance(entries, framing.Encoder) and data is None:
        rest = [(n, t) for n, t in entries if t.dtype not in fdl.DTYPE_TO_TAG]
        if rest:
            entries = [(n, t) for n, t in entries if t.dtype in fdl.DTYPE_TO_TAG]
            data = fdl.Encoder(rest, framing=datafile.DATA)
    encoder = entries if isinstance(entries, framing.Encoder) \
        else fdl.Encoder(entries, structural_hash=hash_)
    optim_encoder = None if optim is None else (
        optim[0], optim[1] if isinstance(optim[1], framing.Encoder) else fdl.Encoder(optim[1]))
    return metafile.write_with_meta(path, encoder, meta, compress_level=compress_level,
                                    optim=optim_encoder, data=data, trash=trash)


def read_with_data(path: str | os.PathLike[str], meta: "Meta", *, shared_buffer: bool = False,
                   pin_memory: bool = False,
                   fill: Callable[[dict[str, torch.Tensor]], Pairs] | None = None) -> Checkpoint:
    """The checkpoint at ``path`` with its data file's entries after its own (when
    ``meta`` records one), each file checked against ``meta`` while read (see
    :func:`~snapsvc.files.checkpoint.read_verified`; ``shared_buffer`` and
    ``pin_memory`` apply to the checkpoint file). An entry in both files is a
    FormatError: they do not belong together. ``fill`` is ``read_verified``'s,
    given all the entries (the data file is read and checked first)."""
    path = os.fspath(path)
    more = read_data_file(path, meta)

    def merged(ckpt: Checkpoint) -> Pairs:
        twice = [n for n in more if n in ckpt.entries]
        if twice:
            raise FormatError(f"entry {twice[0]!r} is in both the checkpoint and its data file: "
                              "the files do not belong together", path=data_path(path))
        ckpt.entries.update(more)
        return fill(ckpt.entries) if fill is not None else []

    if fill is not None:
        return read_verified(path, meta.size, meta.crc32, shared_buffer=shared_buffer,
                             pin_memory=pin_memory, fill=merged)
    ckpt = read_verified(path, meta.size, meta.crc32, shared_buffer=shared_buffer,
                         pin_memory=pin_memory)
    merged(ckpt)
    return ckpt


def read_companion(path: str | os.PathLike[str], meta: "Meta", role: str) -> Checkpoint | None:
    """The companion file of ``role`` ("optimizer file", "data file") that ``meta``
    records beside ``path``, checked against ``meta`` while read; None without one.
    Its name is the one the metadata records (:func:`companions` checks it)."""
    path = os.fspath(path)
    for c in companions(path, meta):
        if c.role == role:
            where = os.path.join(os.path.dirname(path), c.name)
            return read_verified(where, c.size, c.crc32, framing=c.framing)
    return None


def read_data_file(path: str | os.PathLike[str], meta: "Meta") -> dict[str, torch.Tensor]:
    """The entries of the data file ``meta`` records beside ``path`` (none without one),
    checked against ``meta`` while read."""
    found = read_companion(path, meta, "data file")
    return {} if found is None else found.entries

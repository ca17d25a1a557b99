"""Converting between ``.fdl``/``.fdl.gz``, ``.safetensors`` and ``.pt`` state dicts,
and describing a file's entries without loading their data.

Formats, chosen by the path's suffix (:func:`file_format`); :func:`convert_file`
goes from one to another::

    .fdl / .fdl.gz   flodl's format (shared/FORMAT.md) through snapsvc.format.fdl,
                     written with save_checkpoint (atomic, gzip on .gz); float16,
                     bfloat16, float32, float64, int32 and int64 only (EncodeError
                     names any other entry)
    .safetensors     files/safetensors.py, no dependency
    .pt / .pth       files/torchfile.py, torch.load(weights_only=True) only

All writes to paths are atomic (:mod:`snapsvc.files.durable`): on any error
the destination is left as it was and no temp file remains. The library
never prints; what a conversion loses (a structural hash, metadata, wrapper
keys) is logged on the ``snapsvc.files.convert`` logger.
"""

from __future__ import annotations

import logging
import os

from ..errors import FormatError
from ..format import fdl
from ..format.streams import open_source
from .checkpoint import file_framing, save_checkpoint
from .meta import meta_path, read_data_file, read_meta
from .tensors import EntryInfo, FileInfo, Progress, TensorFile, _no_progress
from .safetensors import (HASH_KEY, MAX_HEADER, SAFETENSORS_DTYPES, _hash_from_metadata,
                          _read_safetensors_header, read_safetensors, safetensors_header,
                          write_safetensors)
from .torchfile import read_state_dict, write_state_dict

__all__ = ["FORMATS", "HASH_KEY", "MAX_HEADER", "SAFETENSORS_DTYPES", "Progress", "EntryInfo",
           "FileInfo", "TensorFile", "file_format", "describe_file", "read_tensors",
           "write_tensors", "read_safetensors", "write_safetensors", "safetensors_header",
           "read_state_dict", "write_state_dict", "convert_file"]

log = logging.getLogger("snapsvc.convert")


FORMATS = ("fdl", "safetensors", "pt")


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


def _describe_fdl(path: str) -> FileInfo:
    # a checkpoint's data file has .fdl's framing with snapsvc's own magic and tags
    framing = file_framing(path)
    with open_source(path) as s:
        dec = fdl.Decoder(s.stream, size=s.size, seekable=s.seekable, path=s.path,
                          framing=framing)
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
    return TensorFile(entries, h.hex() if any(h) else None)


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


def _add_data_file(src: str, dst: str, dst_kind: str, tf: TensorFile) -> None:
    """A snapsvc checkpoint's data file (tensors of dtypes .fdl has no tag for), checked
    against its metadata, goes after its entries into a .safetensors or .pt ``dst``."""
    try:
        meta = read_meta(src)
    except FormatError as e:  # the .fdl converts without it, as before the data file
        log.warning("%s: its metadata is unreadable (%s); converting the .fdl alone",
                    src, e.reason)
        return
    more = read_data_file(src, meta)
    if not more:
        return
    if dst_kind == "fdl":  # .fdl cannot hold them: the .fdl is converted as it is
        log.info("%s: the %d entries of %s's data file (dtypes .fdl has no tag for) are not "
                 "kept in .fdl; convert to .safetensors or .pt to keep them", dst, len(more), src)
        return
    tf.entries = [*tf.entries, *more.items()]


def convert_file(src: str | os.PathLike[str], dst: str | os.PathLike[str], *,
            progress: Progress | None = None) -> TensorFile:
    """Convert ``src`` to ``dst``, formats chosen by suffix; returns what was read.

    Tensors are copied bit for bit, in order; a snapsvc checkpoint's data file
    (``x.fdl.data``) follows its entries into ``.safetensors`` or ``.pt``. ``dst``
    is written atomically:
    when a tensor cannot go into ``dst``'s format (say a bool tensor into
    ``.fdl``) :class:`EncodeError` names it and ``dst`` is not touched.
    """
    src, dst = os.fspath(src), os.fspath(dst)
    src_kind, dst_kind = file_format(src), file_format(dst)
    tf = read_tensors(src, progress=progress)
    if src_kind == "fdl" and os.path.exists(meta_path(src)):
        _add_data_file(src, dst, dst_kind, tf)
    if tf.structural_hash and dst_kind == "pt":
        log.info("%s: the structural hash %s is not kept in .pt", dst, tf.structural_hash)
    extra = {k: v for k, v in tf.metadata.items() if k != HASH_KEY}
    if extra and dst_kind != "safetensors" and src_kind == "safetensors":
        log.info("%s: safetensors metadata %s is not kept in .%s", dst, sorted(extra), dst_kind)
    write_tensors(dst, tf, progress=progress)
    return tf

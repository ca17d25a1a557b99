"""The metadata sidecar written beside each checkpoint: ``<checkpoint>.meta``; no torch.

A msgpack map that says what the ``.fdl`` alone cannot: epoch and metrics,
which entries are buffers, and the size and CRC-32 of the checkpoint file (and
of its optimizer file and data file, when it has them) so
:func:`snapsvc.verify` can detect corruption. flodl ignores it and loads the
``.fdl`` on its own.

A checkpoint's files (:func:`checkpoint_names`): the metadata, the optimizer
file (``x.optim.fdl``), the data file (``x.fdl.data``: tensors of dtypes
``.fdl`` has no tag for, :mod:`snapsvc.format.datafile`) and the checkpoint.
Every reader, ``verify``, rotation, upload and fetch learns them from here.

Order of writes: the checkpoint is renamed into place (durably) *before* its
metadata is written. A checkpoint without metadata is therefore an unfinished
write (the writer died between the two renames) and is not to be trusted as
the latest snapshot.

Nothing here imports torch: the writer sidecar writes checkpoints from
encoders over its slots' bytes (:func:`write_with_meta`), and the uploader,
``verify`` and fetch read metadata. :mod:`snapsvc.files.meta` is this module
plus what reads a checkpoint's tensors and what writes (name, tensor) pairs.
"""

from __future__ import annotations

import errno
import os
import reprlib
import time
from dataclasses import dataclass, field, replace
from typing import Any

from isal import isal_zlib

from ..errors import CheckpointNotFoundError, FormatError
from ..format import kinds
from ..format.framing import DATA, FDL, VERSION, Encoder, Framing
from ..format.protocol import MAX_METADATA, pack_value, unpack_value
from ..format.streams import gzip_writer, is_gzip_path, open_source
from .durable import DurableFile, commit, discard, staged_write

__all__ = ["META_SUFFIX", "META_VERSION", "DATA_SUFFIX", "Meta", "Companion", "FileStats",
           "meta_path", "optim_path", "data_path", "data_owner", "checkpoint_names", "companions",
           "COMPANION_NAMES", "companion_names", "stale_companions",
           "file_framing", "stage_checkpoint_file", "stage_meta", "write_with_meta", "read_meta",
           "parse_meta", "read_msgpack_file", "unpack_msgpack_map"]

META_SUFFIX = ".meta"
META_MAGIC = "snapsvc-meta"
# 2: the fields packed by snapsvc.format.protocol (int keys, tuples, state tree) and
# checked by their own CRC-32, so a corrupt value is never read back silently
META_VERSION = 2
_READS = (1, META_VERSION)
# Which maps of the value trees are Counter, OrderedDict or defaultdict
# (snapsvc.format.kinds): a field of its own, so readers without it still read
# every file, as plain dicts.
KINDS_FIELD = "kinds"
_TREES = ("state", "extra")


def meta_path(checkpoint: str | os.PathLike[str]) -> str:
    return os.fspath(checkpoint) + META_SUFFIX


def optim_path(path: str | os.PathLike[str]) -> str:
    """``x.fdl`` -> ``x.optim.fdl``; ``x.fdl.gz`` -> ``x.optim.fdl.gz``; else ``x.optim``."""
    path = os.fspath(path)
    for suffix in (".fdl.gz", ".fdl"):
        if path.endswith(suffix):
            return path[: -len(suffix)] + ".optim" + suffix
    return path + ".optim"


DATA_SUFFIX = ".data"


def data_path(path: str | os.PathLike[str]) -> str:
    """``x.fdl`` -> ``x.fdl.data``; ``x.fdl.gz`` -> ``x.fdl.data.gz`` (gzip like its checkpoint).
    As long as the ``.meta`` name, so a path whose metadata fits fits too."""
    path = os.fspath(path)
    if path.endswith(".gz"):
        return path[: -len(".gz")] + DATA_SUFFIX + ".gz"
    return path + DATA_SUFFIX


def data_owner(path: str | os.PathLike[str]) -> str | None:
    """The checkpoint whose data file ``path`` would be (:func:`data_path`'s inverse), or None."""
    path = os.fspath(path)
    for suffix, back in ((DATA_SUFFIX + ".gz", ".gz"), (DATA_SUFFIX, "")):
        if path.endswith(suffix) and len(path) > len(suffix):
            return path[: -len(suffix)] + back
    return None


# How a checkpoint's companion files are named after it: the one list that
# writes, removals, rotation, upload and verify all go by.
COMPANION_NAMES = (optim_path, data_path)


def companion_names(path: str | os.PathLike[str]) -> list[str]:
    """The names of the companion files a checkpoint at ``path`` may have."""
    return [name(path) for name in COMPANION_NAMES]


def checkpoint_names(path: str | os.PathLike[str]) -> list[str]:
    """Every name a checkpoint at ``path`` may have files under, metadata first:
    removing them in this order never leaves a checkpoint that looks whole."""
    path = os.fspath(path)
    return [meta_path(path), *companion_names(path), path]


def stale_companions(path: str | os.PathLike[str], written: list[str]) -> list[str]:
    """The companion names of ``path`` that a write of the files ``written`` leaves
    to an earlier checkpoint of that name: they go with the commit (an optimizer
    file beside a checkpoint saved without one would look like its own). A name
    that is a checkpoint itself (it has metadata of its own) is not a companion."""
    mine = {os.path.abspath(w) for w in written}
    return [n for n in companion_names(path)
            if os.path.abspath(n) not in mine and not os.path.lexists(meta_path(n))]


@dataclass(frozen=True)
class Companion:
    """A file beside the checkpoint that its metadata vouches for."""

    role: str                 # "optimizer file" or "data file"
    name: str                 # its file name, in the checkpoint's directory
    size: Any                 # as recorded (checked by whoever reads the file)
    crc32: Any
    entries: Any
    framing: Framing


def companions(path: str | os.PathLike[str], meta: "Meta") -> list[Companion]:
    """The files beside the checkpoint at ``path`` that ``meta`` records: the
    optimizer file, then the data file. A recorded name that is not a plain file
    name in the checkpoint's directory (a path, ``..``), or that names the
    checkpoint, its metadata or the other companion, is a FormatError naming the
    metadata and the field: such metadata is damaged or hostile, whatever its CRC."""
    out: list[Companion] = []
    optim, data = os.path.basename(optim_path(path)), os.path.basename(data_path(path))
    taken = {os.path.basename(os.fspath(path)): "the checkpoint itself",
             os.path.basename(meta_path(path)): "the checkpoint's metadata"}
    for role, field_name, record, default, other, framing in (
            ("optimizer file", "optimizer", meta.optimizer, optim, data, FDL),  # may lack "file"
            ("data file", "data", meta.data, data, optim, DATA)):
        if not record:
            continue
        name = record.get("file") or default
        where = f"the metadata field {field_name!r} names the {role} {name!r}"
        if not isinstance(name, str) or name in ("", ".", "..") \
                or any(sep and sep in name for sep in ("/", "\0", os.sep, os.altsep)):
            raise FormatError(f"{where}, not a file name in the checkpoint's directory",
                              path=meta_path(path))
        clash = taken.get(name) or (name == other and "the name of the other companion file")
        if clash:
            raise FormatError(f"{where}, which is {clash}: the metadata is damaged",
                              path=meta_path(path))
        taken[name] = f"the {role}"
        out.append(Companion(role, name, record.get("size"), record.get("crc32"),
                             record.get("entries"), framing))
    return out


@dataclass
class Meta:
    format_version: int = VERSION
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
    # of the optimizer file (snapsvc.state.resume); None when none was saved
    optimizer: dict[str, Any] | None = None
    # the state tree of a nested submit (snapsvc.state), None for a model submit
    state: Any = None
    # a model submit's get_extra_state() values by state_dict key; None when none
    extra_state: dict[str, Any] | None = None
    # "file", "size", "crc32", "entries" of the data file (tensors .fdl has no tag
    # for); None when the checkpoint has none
    data: dict[str, Any] | None = None


def stage_meta(checkpoint: str | os.PathLike[str], meta: Meta) -> DurableFile:
    """``meta`` in a fsynced temp file beside ``checkpoint``, to be committed after it."""
    values = {f: getattr(meta, f) for f in Meta.__dataclass_fields__}
    if values["data"] is None:  # absent without a data file: such metadata is as before
        del values["data"]
    trees, records = kinds.split({r: values[r] for r in _TREES})
    values.update(trees)
    if records:   # absent when every map is a plain dict: such files are as before
        values[KINDS_FIELD] = records
    fields = pack_value(values)
    body = pack_value({"magic": META_MAGIC, "meta_version": META_VERSION,
                       "crc32": isal_zlib.crc32(fields), "fields": fields})
    if len(body) > MAX_METADATA:  # the client checks this at submit; a direct caller gets it here
        raise ValueError(f"metadata for {checkpoint} is {len(body)} bytes; "
                         f"the limit is {MAX_METADATA}")
    with staged_write(meta_path(checkpoint)) as out:
        out.write(body)
    return out


@dataclass
class FileStats:
    """What writing one checkpoint file cost, and what it holds."""

    path: str
    bytes: int          # on disk (compressed, when gzip)
    crc32: int          # of the bytes on disk
    stream_bytes: int   # uncompressed .fdl stream
    encode_s: float     # encoding and compression, excluding OS writes
    write_s: float      # inside the OS's write calls
    fsync_s: float      # file and directory fsync


def stage_checkpoint_file(path: str | os.PathLike[str], encoder: Encoder, *,
                          compress_level: int | None = None) -> tuple[DurableFile, int, float]:
    """Write ``encoder``'s stream into a fsynced temp file beside ``path`` (gzip on ``.gz``).

    Returns (the staged file, uncompressed stream bytes, encode seconds). The
    caller must :func:`~snapsvc.files.durable.commit` or ``discard`` it.
    """
    t0 = time.perf_counter()
    with staged_write(path) as out:
        # Both consume each write before returning: the encoder may reuse its buffer.
        if is_gzip_path(path):
            with gzip_writer(out, compress_level) as gz:
                stream_bytes = encoder.write(gz, reuse=True)
        else:
            stream_bytes = encoder.write(out, reuse=True)
    return out, stream_bytes, time.perf_counter() - t0 - out.write_s - out.fsync_s


def file_framing(path: str | os.PathLike[str]) -> Framing:
    """Which format in ``.fdl``'s framing the file at ``path`` is, by its magic
    (plain or gzip): a data file (:data:`snapsvc.format.framing.DATA`), else ``.fdl``
    (whose decoder then names a bad magic)."""
    with open_source(path) as s:
        return DATA if s.stream.read(4) == DATA.magic else FDL


def write_with_meta(path: str | os.PathLike[str], encoder: Encoder, meta: Meta, *,
                    compress_level: int | None = None,
                    optim: tuple[str, Encoder] | None = None,
                    data: Encoder | None = None,
                    trash: list[str] | None = None) -> FileStats:
    """Write a checkpoint, optionally its optimizer file and data file, and its metadata.

    All are staged (temp file, fsync), then renamed in the order checkpoint,
    optimizer file, data file, metadata: the metadata, last, commits them all.
    ``meta``'s size, checksum, entry count and version are filled in here, and
    ``meta.data`` from ``data`` (an encoder of the data file's framing, written
    to :func:`data_path`); ``optim`` is (path, encoder) and its
    description must already be in ``meta.optimizer``. Each file comes as an
    :class:`~snapsvc.format.framing.Encoder` (built once over a slot's spans in
    the sidecar; :func:`snapsvc.files.meta.write_with_meta` takes tensors); the
    checkpoint's carries ``meta.structural_hash``. Companion files of an
    earlier checkpoint of this name that this write does not replace (an
    optimizer file, a data file) are removed with the commit
    (:func:`stale_companions`). A failure at any
    step, a rename or an fsync included, leaves the previous files of those
    names as they were, and no temp file. ``trash``: see
    :func:`~snapsvc.files.durable.commit`.
    """
    staged: list[DurableFile] = []
    try:
        ck, stream_bytes, encode_s = stage_checkpoint_file(path, encoder,
                                                           compress_level=compress_level)
        staged.append(ck)
        meta = replace(meta, format_version=VERSION, size=ck.size, crc32=ck.crc32,
                       entries=encoder.count)
        if optim is not None:
            opath, oenc = optim
            of, _, o_encode_s = stage_checkpoint_file(opath, oenc, compress_level=compress_level)
            staged.append(of)
            encode_s += o_encode_s
            meta = replace(meta, optimizer={**(meta.optimizer or {}),
                                            "file": os.path.basename(opath), "size": of.size,
                                            "crc32": of.crc32, "entries": oenc.count})
        if data is not None:
            dpath = data_path(path)
            df, _, d_encode_s = stage_checkpoint_file(dpath, data, compress_level=compress_level)
            staged.append(df)
            encode_s += d_encode_s
            meta = replace(meta, data={"file": os.path.basename(dpath), "size": df.size,
                                       "crc32": df.crc32, "entries": data.count})
        staged.append(stage_meta(path, meta))
    except BaseException:
        discard(*staged)
        raise
    commit(*staged, trash=trash, remove=stale_companions(path, [f.path for f in staged]))
    return FileStats(ck.path, ck.size, ck.crc32, stream_bytes, encode_s,
                     sum(f.write_s for f in staged), sum(f.fsync_s for f in staged))


def read_msgpack_file(path: str, *, what: str, magic: str, version_key: str,
                      version: int | tuple[int, ...], missing: str,
                      limit: int = MAX_METADATA) -> dict[str, Any]:
    """Read a small snapsvc msgpack map (metadata, manifest), checking size,
    encoding, magic and version; every failure is a FormatError naming ``path``."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except FileNotFoundError:
        raise FormatError(missing, path=path) from None
    return unpack_msgpack_map(data, path, what=what, magic=magic, version_key=version_key,
                              version=version, limit=limit)


def unpack_msgpack_map(data: bytes, path: str, *, what: str, magic: str, version_key: str,
                       version: int | tuple[int, ...], limit: int = MAX_METADATA
                       ) -> dict[str, Any]:
    """:func:`read_msgpack_file`'s checks on bytes already read (from a remote
    object named ``path``)."""
    if len(data) > limit:
        raise FormatError(f"{what} is larger than {limit} bytes", path=path)
    try:
        raw = unpack_value(data)
    except FormatError as e:
        raise FormatError(f"{what} is not valid msgpack: {e.reason}", path=path,
                          offset=e.offset) from None
    if not isinstance(raw, dict) or raw.get("magic") != magic:
        raise FormatError(f"not a snapsvc {what} file (expected magic {magic!r})", path=path)
    versions = version if isinstance(version, tuple) else (version,)
    if raw.get(version_key) not in versions:
        raise FormatError(f"{what} version {raw.get(version_key)!r}; this snapsvc reads "
                          f"version {' and '.join(map(str, versions))}", path=path)
    return raw


def read_meta(checkpoint: str | os.PathLike[str]) -> Meta:
    """Read the metadata of ``checkpoint``; FormatError if absent or malformed,
    :class:`CheckpointNotFoundError` if the checkpoint is absent too."""
    path = meta_path(checkpoint)
    if not os.path.lexists(path) and not os.path.lexists(checkpoint):  # a typo, not a crash
        raise CheckpointNotFoundError(errno.ENOENT, "no such checkpoint (neither the file "
                                      "nor its .meta exists)", os.fspath(checkpoint))
    raw = read_msgpack_file(
        path, what="metadata", magic=META_MAGIC, version_key="meta_version",
        version=_READS, missing="no metadata file: the checkpoint is an unfinished "
        "write, or was not written by snapsvc (read_checkpoint reads its entries)")
    return _meta_from(raw, path)


def parse_meta(data: bytes, path: str) -> Meta:
    """:func:`read_meta` of metadata bytes already read (a remote ``.meta`` object ``path``)."""
    return _meta_from(unpack_msgpack_map(data, path, what="metadata", magic=META_MAGIC,
                                         version_key="meta_version", version=_READS), path)


def _meta_from(raw: dict[str, Any], path: str) -> Meta:
    """The checked :class:`Meta` of a decoded metadata map."""
    if raw["meta_version"] >= 2:  # the fields, packed, under their own CRC-32
        packed = raw.get("fields")
        if type(packed) is not bytes or raw.get("crc32") != isal_zlib.crc32(packed):
            raise FormatError("the metadata's CRC-32 does not match its contents: the "
                              "metadata file is corrupt; use an earlier checkpoint", path=path)
        try:
            raw = unpack_value(packed)
        except FormatError as e:
            raise FormatError(f"metadata fields are not valid msgpack: {e.reason} (at byte "
                              f"{e.offset} of the packed fields)", path=path) from None
        if not isinstance(raw, dict):
            raise FormatError("metadata fields are not a map", path=path)
    missing = [k for k in _REQUIRED if k not in raw]
    if missing:
        raise FormatError(f"metadata lacks the fields {missing}", path=path)
    fields = {k: raw[k] for k in Meta.__dataclass_fields__ if k in raw}
    for name, value in fields.items():
        problem = _FIELDS[name](value)
        if problem:
            raise FormatError(f"metadata field {name!r} is {_show(value)}; expected {problem}",
                              path=path)
    try:  # after the checks: a tree's Counter is a map, not the plain dict checked there
        fields.update(kinds.join({r: fields.get(r) for r in _TREES}, raw.get(KINDS_FIELD)))
    except ValueError as e:
        raise FormatError(f"metadata field {KINDS_FIELD!r}: {e}", path=path) from None
    return Meta(**fields)


# What each field of a Meta read back must be: a check returns None, or what was expected.
_REQUIRED = ("size", "crc32")
_HEX = frozenset("0123456789abcdef")


def _is_int(v: Any, lo: int | None = None, hi: int | None = None) -> bool:
    return type(v) is int and (lo is None or v >= lo) and (hi is None or v <= hi)


def _is_number(v: Any) -> bool:
    return type(v) in (int, float)


def _check(ok: bool, expected: str) -> str | None:
    return None if ok else expected


def _metrics(v: Any) -> str | None:
    return _check(type(v) is dict and all(type(k) is str and _is_number(x) for k, x in v.items()),
                  "a map of str to numbers")


def _optimizer(v: Any) -> str | None:
    """The model-mode optimizer description (snapsvc.state.resume.optimizer_state)."""
    if v is None:
        return None
    expected = ("None or a map with class, groups ([{params: [str], hyper: {str: value}}]), "
                "scalars ({str: {str: value}}), size and crc32")
    if type(v) is not dict or type(v.get("class")) is not str \
            or not _is_int(v.get("size"), 0) or not _is_int(v.get("crc32"), 0, 0xFFFFFFFF) \
            or not _is_int(v.get("entries", 0), 0) or type(v.get("file", "")) is not str:
        return expected
    groups, scalars = v.get("groups"), v.get("scalars")
    if type(groups) is not list or type(scalars) is not dict:
        return expected
    for g in groups:
        if type(g) is not dict or type(g.get("params")) is not list \
                or not all(type(n) is str for n in g["params"]) \
                or type(g.get("hyper")) is not dict or not all(type(k) is str for k in g["hyper"]):
            return expected
    if not all(type(k) is str and type(s) is dict and all(type(x) is str for x in s)
               for k, s in scalars.items()):
        return expected
    return None


def _data(v: Any) -> str | None:
    return _check(v is None or (type(v) is dict and type(v.get("file")) is str
                                and _is_int(v.get("size"), 0)
                                and _is_int(v.get("crc32"), 0, 0xFFFFFFFF)
                                and _is_int(v.get("entries"), 0)),
                  "None or a map with file, size, crc32 and entries")


_FIELDS: dict[str, Any] = {
    "format_version": lambda v: _check(_is_int(v), "an int"),
    "size": lambda v: _check(_is_int(v, 0), "a byte count"),
    "crc32": lambda v: _check(_is_int(v, 0, 0xFFFFFFFF), "a CRC-32 (0 to 2**32 - 1)"),
    "entries": lambda v: _check(_is_int(v, 0), "an entry count"),
    "buffers": lambda v: _check(type(v) is list and all(type(b) is str for b in v),
                                "a list of buffer names"),
    "epoch": lambda v: _check(_is_int(v), "an int"),
    "metrics": _metrics,
    "structural_hash": lambda v: _check(v is None or (type(v) is str and len(v) == 64
                                                       and set(v) <= _HEX),
                                        "None or 64 lowercase hex digits"),
    "created": lambda v: _check(_is_number(v), "a time in seconds"),
    "extra": lambda v: None,
    "optimizer": _optimizer,
    "state": lambda v: _check(v is None or type(v) is dict,
                              "None or a map (a nested state is a mapping)"),
    "extra_state": lambda v: _check(v is None or (type(v) is dict
                                                  and all(type(k) is str for k in v)),
                                    "None or a map of state_dict keys to values"),
    "data": _data,
}


def _show(value: Any) -> str:
    return f"a {type(value).__name__} ({reprlib.repr(value)})"  # bounded, whatever its size

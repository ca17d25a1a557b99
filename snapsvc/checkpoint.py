"""The checkpoint API: save, load, inspect and migrate ``.fdl`` files.

Loading follows flodl's rules (``shared/FORMAT.md``): exact-name matching
against parameters and persistent buffers, a shape mismatch is an error, a
differing dtype is converted, data lands on the model tensor's device, and a
non-zero structural hash is checked. Unlike a naive loader, the whole file is
decoded and every check passes before the first model tensor is touched, so a
bad file never leaves a model half-loaded.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Union

import torch
from torch import nn

from . import fdl
from .durable import DurableFile, commit, staged_write
from .errors import ArchitectureMismatchError, ShapeMismatchError, StrictLoadError
from .streams import PathOrFile, gzip_writer, is_gzip_path, open_source

__all__ = [
    "Checkpoint",
    "FileStats",
    "LoadReport",
    "MigrateReport",
    "save_checkpoint",
    "load_checkpoint",
    "read_checkpoint",
    "checkpoint_keys",
    "checkpoint_version",
    "migrate_checkpoint",
    "structural_hash",
    "layout_hash",
    "model_tensors",
    "persistent_buffers",
    "stage_checkpoint_file",
    "write_checkpoint_file",
    "encode_to",
]

Tensors = Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]
HashLike = Union[str, bytes, None]


# -- model helpers -------------------------------------------------------------
def persistent_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``model.named_buffers()`` without the buffers registered ``persistent=False``."""
    for name, buf in model.named_buffers():
        owner, _, leaf = name.rpartition(".")
        if leaf not in model.get_submodule(owner)._non_persistent_buffers_set:
            yield name, buf


def model_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What a checkpoint of ``model`` holds, in file order: params, then buffers."""
    return list(model.named_parameters()) + list(persistent_buffers(model))


def structural_hash(model: nn.Module) -> str:
    """SHA-256 (64 hex characters) of the model's tensor layout.

    Exactly this UTF-8 text is hashed, one line per tensor, parameters in
    ``named_parameters()`` order, then persistent buffers in
    ``named_buffers()`` order::

        snapsvc-structural-hash-v1\\n
        param\\t<name>\\t<dtype>\\t<d0>,<d1>,...\\n
        buffer\\t<name>\\t<dtype>\\t<d0>,<d1>,...\\n

    ``<dtype>`` is the torch dtype without ``torch.`` (``float32``); a scalar
    has an empty shape field. Values, devices and ``requires_grad`` do not go
    in, so the hash is the same across processes, runs and devices.
    """
    return layout_hash(model.named_parameters(), persistent_buffers(model))


def layout_hash(params: Iterable[tuple[str, torch.Tensor]],
                buffers: Iterable[tuple[str, torch.Tensor]]) -> str:
    """:func:`structural_hash` of explicit (name, tensor) pairs."""
    h = hashlib.sha256(b"snapsvc-structural-hash-v1\n")
    for kind, pairs in (("param", params), ("buffer", buffers)):
        for name, t in pairs:
            dtype = str(t.dtype).removeprefix("torch.")
            shape = ",".join(str(d) for d in t.shape)
            h.update(f"{kind}\t{name}\t{dtype}\t{shape}\n".encode("utf-8"))
    return h.hexdigest()


_structural_hash = structural_hash  # parameters named structural_hash shadow it below


def _hash_bytes(value: HashLike) -> bytes:
    if value is None:
        return bytes(fdl.HASH_LEN)
    if isinstance(value, (bytes, bytearray)):
        if len(value) != fdl.HASH_LEN:
            raise ValueError(f"structural_hash must be {fdl.HASH_LEN} bytes, got {len(value)}")
        return bytes(value)
    if isinstance(value, str):
        try:
            raw = bytes.fromhex(value)
        except ValueError:
            raw = b""
        if len(raw) != fdl.HASH_LEN:
            raise ValueError(f"structural_hash must be {2 * fdl.HASH_LEN} hex characters, "
                             f"got {value!r}")
        return raw
    raise TypeError(f"structural_hash must be a hex str, bytes or None, not {type(value).__name__}")


def _pairs(tensors: Tensors | None) -> list[tuple[str, torch.Tensor]]:
    if tensors is None:
        return []
    if isinstance(tensors, Mapping):
        return list(tensors.items())
    return [(name, t) for name, t in tensors]


# -- save ----------------------------------------------------------------------
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


def stage_checkpoint_file(path: str | os.PathLike[str], entries: list[tuple[str, torch.Tensor]],
                          hash_: bytes, *, compress_level: int | None = None
                          ) -> tuple[DurableFile, int, float]:
    """Encode ``entries`` into a fsynced temp file beside ``path`` (gzip on ``.gz``).

    Returns (the staged file, uncompressed stream bytes, encode seconds). The
    caller must :func:`~snapsvc.durable.commit` or ``discard`` it.
    """
    t0 = time.perf_counter()
    with staged_write(path) as out:
        if is_gzip_path(path):
            with gzip_writer(out, compress_level) as gz:
                stream_bytes = fdl.encode(gz, entries, structural_hash=hash_)
        else:
            stream_bytes = fdl.encode(out, entries, structural_hash=hash_)
    return out, stream_bytes, time.perf_counter() - t0 - out.write_s - out.fsync_s


def write_checkpoint_file(path: str | os.PathLike[str], entries: list[tuple[str, torch.Tensor]],
                          hash_: bytes, *, compress_level: int | None = None) -> FileStats:
    """Encode ``entries`` durably to ``path`` (gzip when it ends in ``.gz``)."""
    out, stream_bytes, encode_s = stage_checkpoint_file(path, entries, hash_,
                                                        compress_level=compress_level)
    commit(out)
    return FileStats(out.path, out.size, out.crc32, stream_bytes, encode_s, out.write_s,
                     out.fsync_s)


def encode_to(dest: PathOrFile, entries: list[tuple[str, torch.Tensor]], hash_: bytes, *,
              compress_level: int | None = None) -> None:
    """Encode to a path (durably; gzip on ``.gz``) or to a writable binary file."""
    if isinstance(dest, (str, os.PathLike)):
        write_checkpoint_file(dest, entries, hash_, compress_level=compress_level)
    else:
        fdl.encode(dest, entries, structural_hash=hash_)


def save_checkpoint(dest: PathOrFile, params: nn.Module | Tensors,
                    buffers: Tensors | None = None, *, structural_hash: HashLike = None,
                    compress_level: int | None = None) -> None:
    """Write a ``.fdl`` checkpoint.

    ``dest`` is a path (written atomically; gzip when it ends in ``.gz``, at
    isal level ``compress_level``) or a writable binary file. ``params`` and
    ``buffers`` are mappings or iterables of (name, tensor) pairs; params go
    first, then buffers, each in the order given. An ``nn.Module`` as
    ``params`` writes its parameters then persistent buffers, hashed with
    :func:`structural_hash` unless a hash is given.
    """
    if isinstance(params, nn.Module):
        if buffers is not None:
            raise TypeError("pass either a module or params/buffers, not both")
        entries = model_tensors(params)
        if structural_hash is None:
            structural_hash = _structural_hash(params)
    else:
        entries = _pairs(params) + _pairs(buffers)
    encode_to(dest, entries, _hash_bytes(structural_hash), compress_level=compress_level)


# -- read ----------------------------------------------------------------------
@dataclass
class Checkpoint:
    """A decoded checkpoint: every entry as a CPU tensor, in file order."""

    version: int
    structural_hash: str | None
    entries: dict[str, torch.Tensor]
    path: str | None = None


def read_checkpoint(src: PathOrFile) -> Checkpoint:
    """Decode a whole checkpoint (plain or gzip) from a path or binary file."""
    with open_source(src) as s:
        dec = fdl.Decoder(s.stream, size=s.size, seekable=s.seekable, path=s.path)
        entries = {e.name: e.tensor for e in dec.entries()}
        header = dec.header
    assert header is not None
    h = header.structural_hash
    return Checkpoint(header.version, h.hex() if any(h) else None, entries, s.path)


def checkpoint_keys(src: PathOrFile) -> list[str]:
    """Entry names in file order, without loading data (plain files seek past it)."""
    with open_source(src) as s:
        dec = fdl.Decoder(s.stream, size=s.size, seekable=s.seekable, path=s.path)
        return [e.name for e in dec.entries(load=False)]


def checkpoint_version(src: PathOrFile) -> int:
    """The format version, from magic and version alone."""
    with open_source(src) as s:
        return fdl.Decoder(s.stream, size=s.size, path=s.path).read_version()


# -- load into a model ---------------------------------------------------------
@dataclass
class LoadReport:
    """Which entries were loaded, which the model lacks, which the file lacks.

    :func:`snapsvc.restore` also fills ``epoch``, ``metrics`` and ``extra``
    from the checkpoint's metadata. Restoring a nested state names paths in
    the state (``snapsvc.state``'s syntax) instead of entries, lists the
    objects it loaded in ``restored``, and puts the whole saved state, as
    :func:`snapsvc.load` returns it, in ``state`` (non-tensor values cannot
    be restored in place: read them there).
    """

    loaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    epoch: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    extra: Any = None
    restored: list[str] = field(default_factory=list)
    state: Any = None


def _where(ckpt: Checkpoint) -> str:
    return f"{ckpt.path}: " if ckpt.path else ""


def load_into(ckpt: Checkpoint, model: nn.Module, *, structural_hash: HashLike = None,
              strict: bool = False) -> LoadReport:
    """Apply flodl's loading rules for an already decoded checkpoint."""
    expected = _hash_bytes(structural_hash if structural_hash is not None
                           else _structural_hash(model))
    if ckpt.structural_hash is not None and any(expected) \
            and bytes.fromhex(ckpt.structural_hash) != expected:
        raise ArchitectureMismatchError(
            f"{_where(ckpt)}architecture mismatch: file hash {ckpt.structural_hash}, "
            f"model hash {expected.hex()}; load into the architecture that saved it, "
            "or use migrate_checkpoint for renamed models")
    targets = dict(model_tensors(model))
    report = LoadReport()
    for name, t in ckpt.entries.items():
        target = targets.get(name)
        if target is None:
            report.skipped.append(name)
            continue
        if t.shape != target.shape:
            raise ShapeMismatchError(
                f"{_where(ckpt)}entry {name!r}: checkpoint shape {list(t.shape)} "
                f"but model shape {list(target.shape)}")
        report.loaded.append(name)
    report.missing = [n for n in targets if n not in ckpt.entries]
    if strict and (report.skipped or report.missing):
        raise StrictLoadError(
            f"{_where(ckpt)}strict load: {len(report.skipped)} entries not in the model "
            f"{report.skipped[:5]}, {len(report.missing)} model tensors not in the file "
            f"{report.missing[:5]}; pass strict=False to load the overlap")
    with torch.no_grad():  # in place: optimizers keep their references
        for name in report.loaded:
            targets[name].copy_(ckpt.entries[name])
    return report


def load_checkpoint(src: PathOrFile, model: nn.Module, *, structural_hash: HashLike = None,
                    strict: bool = False) -> LoadReport:
    """Load a checkpoint into ``model`` in place, following flodl's rules.

    ``structural_hash`` defaults to the model's own; a zero hash on either
    side skips the check. The file is fully decoded and checked (hash, shapes,
    ``strict``) before any model tensor changes.
    """
    return load_into(read_checkpoint(src), model, structural_hash=structural_hash,
                     strict=strict)


# -- migrate -------------------------------------------------------------------
@dataclass
class MigrateReport:
    """How :func:`migrate_checkpoint` mapped old entries onto the model."""

    unchanged: list[str] = field(default_factory=list)
    remapped: list[tuple[str, str]] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    def is_complete(self) -> bool:
        return not self.dropped and not self.missing

    def __str__(self) -> str:
        lines = [f"Migration: {len(self.unchanged)} unchanged, {len(self.remapped)} remapped, "
                 f"{len(self.dropped)} dropped, {len(self.missing)} missing"
                 + (" (complete)" if self.is_complete() else " (incomplete)")]
        lines += [f"  remapped: {old} -> {new}" for old, new in self.remapped]
        lines += [f"  dropped:  {name}" for name in self.dropped]
        lines += [f"  missing:  {name}" for name in self.missing]
        return "\n".join(lines)


def migrate_checkpoint(src: PathOrFile, dst: PathOrFile, model: nn.Module) -> MigrateReport:
    """Rewrite a checkpoint under ``model``'s names (flodl's two passes).

    Pass 1 keeps entries whose name and shape match a model tensor. Pass 2
    gives each unmatched model tensor, in model order, the first unused entry
    (file order) of the same shape and dtype. The output is in model order
    with a zero structural hash.
    """
    ckpt = read_checkpoint(src)
    targets = model_tensors(model)
    report = MigrateReport()
    chosen: dict[str, str] = {}  # model name -> checkpoint name
    for name, t in targets:
        old = ckpt.entries.get(name)
        if old is not None and old.shape == t.shape:
            chosen[name] = name
            report.unchanged.append(name)
    used = set(chosen.values())
    for name, t in targets:
        if name in chosen:
            continue
        for old_name, old in ckpt.entries.items():
            if old_name not in used and old.shape == t.shape and old.dtype == t.dtype:
                chosen[name] = old_name
                used.add(old_name)
                report.remapped.append((old_name, name))
                break
        else:
            report.missing.append(name)
    report.dropped = [n for n in ckpt.entries if n not in used]
    out = [(name, ckpt.entries[chosen[name]]) for name, _ in targets if name in chosen]
    encode_to(dst, out, bytes(fdl.HASH_LEN))
    return report

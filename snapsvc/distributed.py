"""Multi-rank checkpoints on ``torch.distributed``: one sidecar per rank, one manifest.

Layout on disk (``directory`` on a filesystem every rank shares)::

    directory/step_<N>/rank0.fdl[.gz]       rank 0's model (flodl's format)
    directory/step_<N>/rank0.fdl.meta       its metadata (snapsvc.meta)
    directory/step_<N>/rank0.optim.fdl      its optimizer state, when saved
    ...                                     the same for every rank
    directory/step_<N>/manifest.msgpack     written last, by rank 0

A ``step_<N>`` directory without a valid manifest is incomplete by
definition: the manifest is written (durably: temp file, fsync, rename,
fsync of the step directory and of ``directory``) only after every rank has
reported its files durable, and it records each rank's file name, size and
CRC-32. :func:`latest_checkpoint` returns only complete checkpoints.

Per checkpoint, on every rank::

    training thread                         coordinator thread (one per rank)
    ---------------                         ---------------------------------
    submit(model, N)
      | makedirs step_<N>
      | SnapshotWriter.submit(rank<r>.fdl)  (copy into shared memory; the
      |   sidecar writes the file durably)
      | queue (N, local handle) ---------->  wait for the local handle (write_timeout)
      v return handle                       all_gather (ok | error, size, crc32)   [coord group]
                                            rank 0: if every rank ok, write manifest
                                            broadcast (committed, error) from rank 0  [coord group]
                                            resolve the handle: report, or
                                            DistributedCheckpointError naming the ranks

The collectives run on a dedicated gloo group made in the constructor (a
collective every rank must call) and used only by the coordinator thread, so
they never interleave with the training's own collectives, which may be on
NCCL and on other threads. Checkpoints are coordinated in submit order, so
every rank must submit the same steps in the same order; the gathered step
numbers are compared and a mismatch fails the checkpoint.

Sharded models. When the model's parameters are DTensors (FSDP2,
tensor parallelism), each rank stages only its local pieces of parameters,
optimizer state and buffers (a block held by several ranks is written by one
of them), and the manifest records, per piece, where it lies in the global
tensor, in the rank file and its CRC-32; :func:`restore_distributed` then
reshards at any world size, reading only the entries each rank needs, and
:func:`consolidate` writes the whole model as one ``.fdl``. See
docs/distributed.md, "Sharded models".

Failures. A rank whose write fails (disk error, its sidecar died, its write
not durable within ``write_timeout``) still joins the exchange and reports
why: no manifest is written, every rank's handle fails with the same
:class:`DistributedCheckpointError` naming the ranks and reasons, and the
writer goes on (the group is intact; a dead sidecar is restarted by the next
submit unless ``restart=False``). A rank that dies or hangs makes the
exchange itself fail (at once for a closed connection, else after
``coord_timeout``): no manifest, the handle fails with a message naming the
timeout, and because the group's state is then unknown this writer refuses
every further submit with that error (make a new one, typically after the job
restarts).
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import logging
import math
import operator
import os
import queue
import re
import socket
import sys
import threading
import time
import weakref
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, Mapping

import torch
import torch.distributed as dist
from isal import isal_zlib
from torch import nn

from . import fdl
from .checkpoint import LoadReport, layout_hash, model_tensors, persistent_buffers
from .client import SnapshotWriter, WriteHandle, WriteReport
from .durable import atomic_write, fsync_dir
from .errors import (DistributedCheckpointError, FormatError, ShapeMismatchError,
                     StrictLoadError, WorldSizeMismatchError)
from .meta import Meta, meta_path, read_meta, read_msgpack_file, write_with_meta
from .protocol import pack_value, unpack_value
from .resume import optim_path, optimizer_state, optimizer_state_dict, restore
from .snapshot import ModelSnapshot
from .state import check_plain

__all__ = ["DistributedSnapshotWriter", "DistributedWriteHandle", "DistributedWriteReport",
           "Manifest", "RankFile", "MANIFEST_NAME", "consolidate", "latest_checkpoint",
           "read_manifest", "restore_distributed", "step_dir"]

log = logging.getLogger("snapsvc")

MANIFEST_NAME = "manifest.msgpack"
MANIFEST_MAGIC = "snapsvc-dist-manifest"
MANIFEST_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d+)$")
_MAX_MANIFEST = 64 << 20
_MAX_REASON = 400
_live: "weakref.WeakSet[DistributedSnapshotWriter]" = weakref.WeakSet()


def step_dir(directory: str | os.PathLike[str], step: int) -> str:
    """``directory/step_<step>``."""
    return os.path.join(os.path.abspath(directory), f"step_{int(step)}")


def _rank_file(rank: int, compressed: bool) -> str:
    return f"rank{rank}.fdl" + (".gz" if compressed else "")


# -- manifest ---------------------------------------------------------------------
@dataclass
class RankFile:
    """One rank's files in a checkpoint, as the manifest records them."""

    rank: int
    file: str                      # name inside the step directory
    size: int                      # bytes on disk
    crc32: int                     # of those bytes
    optim: dict[str, Any] | None = None  # {"file", "size", "crc32"} of the optimizer file
    # sharded checkpoints: one record per entry of ``file`` (see docs/distributed.md)
    entries: list[dict[str, Any]] | None = None


@dataclass
class Manifest:
    """A complete multi-rank checkpoint. ``path`` is its step directory (not stored)."""

    step: int
    world_size: int
    ranks: list[RankFile]
    format: str = "fdl"
    format_version: int = fdl.VERSION
    created: float = field(default_factory=time.time)
    epoch: int | None = None       # rank 0's; each rank's own is in its .meta
    metrics: dict[str, float] = field(default_factory=dict)  # rank 0's
    # sharded checkpoints: {"params", "buffers": names in model order, "optimizer": its
    # class, param groups and non-tensor state (snapsvc.resume), or None}
    sharded: dict[str, Any] | None = None
    path: str = ""


def _write_manifest(directory: str, manifest: Manifest) -> str:
    """Durably write ``directory/manifest.msgpack``; fsync ``directory``'s parent too."""
    body = {"magic": MANIFEST_MAGIC, "manifest_version": MANIFEST_VERSION,
            **{k: v for k, v in asdict(manifest).items() if k != "path"}}
    path = os.path.join(directory, MANIFEST_NAME)
    with atomic_write(path) as out:   # temp, fsync, rename, fsync step dir
        out.write(pack_value(body))
    fsync_dir(os.path.dirname(os.path.abspath(directory)))  # the step_<N> entry itself
    return path


def _plain_name(name: Any, where: str) -> str:
    if not isinstance(name, str) or not name or os.path.basename(name) != name \
            or name in (".", ".."):
        raise FormatError(f"{name!r} is not a file name inside the step directory", path=where)
    return name


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Decode the manifest of a step directory (or the manifest file itself).

    Raises :class:`FormatError` when it is missing (an incomplete checkpoint)
    or malformed. Does not look at the rank files; :func:`latest_checkpoint`
    does.
    """
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(path):
        directory, mpath = path, os.path.join(path, MANIFEST_NAME)
    else:
        directory, mpath = os.path.dirname(path), path
    raw = read_msgpack_file(
        mpath, what="manifest", magic=MANIFEST_MAGIC, version_key="manifest_version",
        version=MANIFEST_VERSION, limit=_MAX_MANIFEST, missing="no manifest: the checkpoint "
        "is incomplete (not every rank's file was reported durable, or the save is still "
        "running); latest_checkpoint() finds the newest complete one")
    try:
        ranks = [RankFile(**r) for r in raw["ranks"]]
        fields = {k: raw[k] for k in Manifest.__dataclass_fields__ if k in raw and k != "ranks"}
        m = Manifest(ranks=ranks, **fields)
    except (KeyError, TypeError) as e:
        raise FormatError(f"manifest lacks or misnames a field ({e})", path=mpath) from None
    m.path = directory
    if not isinstance(m.step, int) or not isinstance(m.world_size, int) or m.world_size < 1:
        raise FormatError(f"manifest has step {m.step!r}, world size {m.world_size!r}",
                          path=mpath)
    if [r.rank for r in m.ranks] != list(range(m.world_size)):
        raise FormatError(f"manifest lists ranks {[r.rank for r in m.ranks]} for world size "
                          f"{m.world_size}", path=mpath)
    for r in m.ranks:
        _plain_name(r.file, mpath)
        if r.optim is not None:
            _plain_name(r.optim.get("file"), mpath)
    return m


def _missing(m: Manifest) -> list[str]:
    """What the manifest lists that is not on disk with the recorded size (cheap: stat only)."""
    problems = []

    def check(name: str, size: int) -> None:
        p = os.path.join(m.path, name)
        try:
            actual = os.stat(p).st_size
        except FileNotFoundError:
            problems.append(f"{p}: missing")
            return
        if actual != size:
            problems.append(f"{p}: {actual} bytes, the manifest says {size}")

    for r in m.ranks:
        check(r.file, r.size)
        if not os.path.exists(meta_path(os.path.join(m.path, r.file))):
            problems.append(f"{meta_path(os.path.join(m.path, r.file))}: missing")
        if r.optim is not None:
            check(r.optim["file"], r.optim["size"])
    return problems


def latest_checkpoint(directory: str | os.PathLike[str]) -> str | None:
    """The newest complete ``step_<N>`` directory under ``directory``, or None.

    Complete: its manifest decodes, names this step, and every file it lists
    exists with the recorded size (sizes only; :func:`restore_distributed`
    checks CRC-32s of what it loads). Directories without a manifest are
    incomplete and skipped, whatever they hold.
    """
    directory = os.path.abspath(os.fspath(directory))
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return None
    steps = sorted(((int(m.group(1)), n) for n in names if (m := _STEP_RE.match(n))),
                   reverse=True)
    for step, name in steps:
        path = os.path.join(directory, name)
        try:
            m = read_manifest(path)
        except (FormatError, OSError):
            continue
        if m.step != step:
            log.warning("%s: manifest says step %d; skipped", path, m.step)
            continue
        problems = _missing(m)
        if problems:
            log.warning("%s has a manifest but is damaged; skipped: %s", path, "; ".join(problems))
            continue
        return path
    return None


# -- restore ----------------------------------------------------------------------
def _rank_and_world(process_group: Any) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank(process_group)
        if rank < 0:
            raise ValueError("this process is not a member of the given process_group")
        return rank, dist.get_world_size(process_group)
    if process_group is not None:
        raise RuntimeError("process_group given but torch.distributed is not initialized")
    return 0, 1


def restore_distributed(path: str | os.PathLike[str], model: nn.Module,
                        optimizer: torch.optim.Optimizer | None = None,
                        process_group: Any = None, *, strict: bool = False,
                        verify: bool = True) -> LoadReport:
    """Restore this rank's part of a complete multi-rank checkpoint.

    ``path`` is a ``step_<N>`` directory (as :func:`latest_checkpoint`
    returns). Local: no collective is run; a rank that raises should stop
    the job. Nothing in the model or optimizer changes unless every check
    passes. The report's ``epoch``, ``metrics`` and ``extra`` are this rank's
    (rank 0's for a rank the checkpoint did not have).

    A checkpoint saved from a sharded model (FSDP2, DTensor) restores at any
    world size and mesh, into a sharded model or a plain one: each DTensor
    gets the block of the global tensor its placements give this rank, a
    plain tensor the whole global tensor. Only the entries overlapping those
    blocks are read (byte ranges of the rank files, from the manifest), each
    checked against its recorded CRC-32 with ``verify``; the optimizer state
    (``optimizer``) is resharded like its parameters.

    Any other checkpoint restores only at the world size that saved it
    (``dist.get_world_size(process_group)``, 1 when torch.distributed is not
    initialized; else :class:`WorldSizeMismatchError`): this rank's metadata
    must record the size and CRC-32 the manifest committed, and
    :func:`snapsvc.restore` loads the file, checking both while it reads
    (always: ``verify`` applies to the sharded path's ranged reads).
    """
    m = read_manifest(path)
    rank, world = _rank_and_world(process_group)
    if m.sharded is not None:
        return _restore_sharded(m, model, optimizer, rank, strict, verify)
    if m.world_size != world:
        raise WorldSizeMismatchError(
            f"{m.path}: checkpoint was saved by {m.world_size} ranks but the current world size "
            f"is {world}; a checkpoint of a model that is not sharded (DTensor) is restored "
            "rank by rank from its own file",
            saved=m.world_size, current=world)
    entry = m.ranks[rank]
    file = os.path.join(m.path, entry.file)
    # restore() reads each file once, checking it against its .meta; the .meta
    # must record what the manifest committed, so the file is the committed one.
    meta = read_meta(file)
    records = [(file, (meta.size, meta.crc32), (entry.size, entry.crc32))]
    if optimizer is not None and entry.optim is not None:
        saved = meta.optimizer or {}
        records.append((os.path.join(m.path, entry.optim["file"]),
                        (saved.get("size"), saved.get("crc32")),
                        (entry.optim["size"], entry.optim["crc32"])))
    for p, in_meta, in_manifest in records:
        if in_meta != in_manifest:
            raise FormatError(f"its metadata records size {in_meta[0]} and CRC-32 {in_meta[1]}, "
                              f"the manifest {in_manifest[0]} and {in_manifest[1]}: the file "
                              "changed after the checkpoint was committed", path=p)
    return restore(file, model, optimizer, strict=strict)


# -- sharded tensors (DTensor: FSDP2, tensor parallelism) ------------------------------
# A sharded rank file's .meta extra is {SHARDS_KEY: its piece records, "extra": the caller's}.
SHARDS_KEY = "snapsvc_shards"
_DTYPES = {str(d).removeprefix("torch."): d for d in fdl.DTYPE_TO_TAG}


def _dtensor_type() -> Any:
    """``DTensor`` if its module is loaded, else None: no tensor can be one then, and a
    job without DTensors does not pay for importing it."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def _is_dtensor(t: Any) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


@dataclass(frozen=True)
class _Block:
    """Where this rank's piece of a DTensor of one shape, mesh and placements lies."""

    writes: bool             # False: a replica that a rank at coordinate 0 writes
    offsets: list[int]       # in the global tensor, padding excluded
    lengths: list[int]
    mesh: list[int]
    placements: list[str]    # "S<dim>", "R"


@functools.lru_cache(maxsize=1 << 12)   # per submit, thousands of tensors share a few specs
def _block(shape: torch.Size, mesh: Any, placements: tuple[Any, ...]) -> _Block | None:
    """This rank's block of a DTensor; None when the mesh excludes this rank.

    The lengths exclude FSDP2's padding of uneven shards, as ``to_local()``
    does. Placements other than ``Shard(dim)`` and ``Replicate()`` are refused.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    texts = []
    for p in placements:
        if type(p) is Shard:   # not _StridedShard (FSDP2 over TP): its piece is not one block
            texts.append(f"S{p.dim}")
        elif type(p) is Replicate:
            texts.append("R")
        else:
            raise ValueError(f"placement {p!r} cannot be checkpointed by snapsvc (Shard(dim) and "
                             "Replicate() can); redistribute the tensor, or full_tensor() it, "
                             "first")
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    lengths, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    return _Block(not any(c != 0 and p == "R" for c, p in zip(coord, texts)),
                  [int(o) for o in offsets], [int(n) for n in lengths], list(mesh.shape), texts)


def _block_of(t: Any, name: str) -> _Block | None:
    try:
        return _block(t.shape, t.device_mesh, tuple(t.placements))
    except ValueError as e:
        raise ValueError(f"{name!r}: {e}") from None


def _piece(name: str, kind: str, t: torch.Tensor, rank: int
           ) -> tuple[torch.Tensor, dict[str, Any]] | None:
    """This rank's piece of ``t`` and its record, or None when another rank writes it.

    A block held by several ranks (``Replicate()`` on a mesh dimension, or a
    plain tensor, which every rank holds) is written once: by the rank at
    coordinate 0 of each replicating mesh dimension, or by rank 0.
    """
    shape = list(t.shape)
    if _is_dtensor(t):
        b = _block_of(t, name)
        if b is None or not b.writes:
            return None
        local = t.to_local()   # under _shard_plan's no_grad: no autograd view
        if list(local.shape) != b.lengths:
            raise ValueError(f"{name!r}: local shard has shape {list(local.shape)}, its placements "
                             f"{b.placements} on mesh {b.mesh} give {b.lengths}")
        offsets, lengths, mesh, placements = b.offsets, b.lengths, b.mesh, b.placements
    else:
        if rank != 0:
            return None
        local, offsets, lengths, mesh, placements = t.detach(), [0] * len(shape), shape, None, None
    if math.prod(lengths) == 0 and math.prod(shape) != 0:
        return None             # an empty shard (more ranks than rows): nothing to write
    return local, {"name": name, "kind": kind, "shape": shape,
                   "dtype": str(t.dtype).removeprefix("torch."), "mesh": mesh,
                   "placements": placements, "offsets": offsets, "lengths": lengths}


def _is_sharded(model: nn.Module) -> bool:
    return _dtensor_type() is not None and any(_is_dtensor(p) for p in model.parameters())


@torch.no_grad()
def _shard_plan(model: nn.Module, optimizer: torch.optim.Optimizer | None, rank: int
                ) -> tuple[ModelSnapshot, list[dict[str, Any]], dict[str, Any]]:
    """What this rank stages: its pieces of parameters, optimizer state and buffers as a
    snapshot (one copy pass), their records in file order, and the model's description."""
    named = list(model.named_parameters())
    buffers = list(persistent_buffers(model))
    optim, info = [], None
    if optimizer is not None:
        optim, info = optimizer_state(optimizer, {id(p): n for n, p in named})
    first: dict[str, torch.Tensor] = {}    # params, then optimizer state: before the buffers
    rest: dict[str, torch.Tensor] = {}
    records: list[dict[str, Any]] = []
    for kind, pairs, out in (("param", named, first), ("optim", optim, first),
                             ("buffer", buffers, rest)):
        for name, t in pairs:
            piece = _piece(name, kind, t, rank)
            if piece is not None:
                out[name] = piece[0]
                records.append(piece[1])
    desc = {"params": [n for n, _ in named], "buffers": [n for n, _ in buffers],
            "optimizer": info}
    return ModelSnapshot(first, rest), records, desc


def _crc_of(f: Any, n: int, crc: int = 0) -> int:
    """CRC-32 of the next ``n`` bytes of ``f``; FormatError if it ends first."""
    left = n
    while left:
        chunk = f.read(min(left, 16 << 20))
        if not chunk:
            raise FormatError(f"truncated: {n} bytes wanted, {n - left} read", path=f.name)
        crc = isal_zlib.crc32(chunk, crc)
        left -= len(chunk)
    return crc


def _entry_table(path: str, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``records`` with where each entry lies in ``path`` and its CRC-32, read back
    from the file just written (offsets from the entry headers; the CRC covers
    the entry's header and data, so a reader checks both with one range)."""
    with open(path, "rb") as f:
        dec = fdl.Decoder(f, size=os.fstat(f.fileno()).st_size, seekable=True, path=path)
        found = list(dec.entries(load=False))
        if [e.name for e in found] != [r["name"] for r in records]:
            raise FormatError("the file's entries are not the pieces staged for it", path=path)
        out = []
        for e, r in zip(found, records):
            f.seek(e.offset)
            end = e.data_offset + e.nbytes
            out.append({**r, "offset": e.offset, "data": e.data_offset, "end": end,
                        "crc32": _crc_of(f, end - e.offset)})
    return out


@dataclass
class _Piece:
    file: str
    offset: int
    data: int
    end: int
    crc32: int
    offsets: list[int]
    lengths: list[int]


@dataclass
class _Global:
    """One saved tensor, as the union of its pieces."""

    name: str
    kind: str
    shape: list[int]
    dtype: torch.dtype
    pieces: list[_Piece] = field(default_factory=list)


def _globals(m: Manifest) -> dict[str, _Global]:
    """Every saved tensor of a sharded checkpoint, by name, with the pieces that hold it."""
    out: dict[str, _Global] = {}
    where = os.path.join(m.path, MANIFEST_NAME)
    for rf in m.ranks:
        for r in rf.entries or ():
            try:
                name, shape = r["name"], [int(d) for d in r["shape"]]
                dtype = _DTYPES[r["dtype"]]
                piece = _Piece(os.path.join(m.path, rf.file), int(r["offset"]), int(r["data"]),
                               int(r["end"]), int(r["crc32"]), [int(o) for o in r["offsets"]],
                               [int(n) for n in r["lengths"]])
                g = out.setdefault(name, _Global(name, r["kind"], shape, dtype))
            except (KeyError, TypeError, ValueError) as e:
                raise FormatError(f"rank {rf.rank}'s entry table is malformed ({e!r})",
                                  path=where) from None
            ok = (g.shape == shape and g.dtype == dtype and len(piece.offsets) == len(shape)
                  == len(piece.lengths) and piece.offset <= piece.data <= piece.end
                  and piece.end - piece.data == math.prod(piece.lengths) * dtype.itemsize
                  and all(0 <= o and o + n <= d
                          for o, n, d in zip(piece.offsets, piece.lengths, shape)))
            if not ok:
                raise FormatError(f"rank {rf.rank}'s piece of {name!r} (offsets {piece.offsets}, "
                                  f"lengths {piece.lengths}) does not fit the tensor's shape "
                                  f"{g.shape} and dtype", path=where)
            g.pieces.append(piece)
    return out


class _PieceReader:
    """Reads pieces by byte range, checking each against the manifest's size and CRC-32."""

    def __init__(self, sizes: dict[str, int], verify: bool) -> None:
        self._sizes = sizes
        self._verify = verify
        self._files: dict[str, Any] = {}
        self.bytes_read = 0

    def __enter__(self) -> "_PieceReader":
        return self

    def __exit__(self, *exc: object) -> None:
        for f in self._files.values():
            f.close()

    def _open(self, path: str) -> Any:
        f = self._files.get(path)
        if f is None:
            f = open(path, "rb")
            self._files[path] = f
            actual = os.fstat(f.fileno()).st_size
            if actual != self._sizes[path]:
                raise FormatError(f"{actual} bytes, the manifest says {self._sizes[path]}",
                                  path=path)
        return f

    def read(self, g: _Global, p: _Piece) -> torch.Tensor:
        shape = p.lengths
        if math.prod(shape) == 0:
            return torch.empty(shape, dtype=g.dtype)
        f = self._open(p.file)
        f.seek(p.offset)
        head = f.read(p.data - p.offset)
        data = bytearray(p.end - p.data)
        view, got = memoryview(data), 0
        while got < len(data):
            k = f.readinto(view[got:])
            if not k:
                raise FormatError("truncated inside the entry", path=p.file, offset=p.offset,
                                  entry=g.name)
            got += k
        self.bytes_read += len(head) + len(data)
        if self._verify:
            crc = isal_zlib.crc32(data, isal_zlib.crc32(head))
            if len(head) != p.data - p.offset or crc != p.crc32:
                raise FormatError(f"CRC-32 {crc:08x} of the entry, the manifest says "
                                  f"{p.crc32:08x}: the file changed after the checkpoint was "
                                  "committed", path=p.file, offset=p.offset, entry=g.name)
        return torch.frombuffer(data, dtype=g.dtype).view(shape)

    def assemble(self, g: _Global, offsets: list[int], lengths: list[int]) -> torch.Tensor:
        """The block of ``g`` at ``offsets``/``lengths``, from the pieces overlapping it only."""
        out = torch.empty(lengths, dtype=g.dtype)
        covered = 0
        for p in g.pieces:
            lo = [max(a, b) for a, b in zip(offsets, p.offsets)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(offsets, lengths, p.offsets, p.lengths)]
            if any(h <= lo_ for lo_, h in zip(lo, hi)):
                continue
            src = self.read(g, p)[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, p.offsets))]
            out[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))] = src
            covered += math.prod(b - a for a, b in zip(lo, hi))
        if covered != math.prod(lengths):
            raise FormatError(f"the saved pieces cover {covered} of the {math.prod(lengths)} "
                              f"elements at offsets {offsets}, lengths {lengths}",
                              entry=g.name)
        return out


def _sizes(m: Manifest) -> dict[str, int]:
    return {os.path.join(m.path, r.file): r.size for r in m.ranks}


def _region(t: torch.Tensor) -> tuple[list[int], list[int]] | None:
    """(offsets, lengths) of the block of the global tensor this rank holds of ``t``:
    all of a plain tensor; None for a DTensor whose mesh excludes this rank."""
    if not _is_dtensor(t):
        return [0] * t.dim(), list(t.shape)
    b = _block_of(t, "")
    return None if b is None else (b.offsets, b.lengths)


def _user_extra(extra: Any) -> Any:
    return extra["extra"] if isinstance(extra, dict) and SHARDS_KEY in extra else extra


def _restore_sharded(m: Manifest, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                     rank: int, strict: bool, verify: bool) -> LoadReport:
    saved = _globals(m)
    report = LoadReport()
    model_kinds = ("param", "buffer")
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    optim_tensors: dict[str, torch.Tensor] = {}
    named = dict(model.named_parameters())
    with _PieceReader(_sizes(m), verify) as reader:
        for name, t in model_tensors(model):
            g = saved.get(name)
            if g is None or g.kind not in model_kinds:
                report.missing.append(name)
                continue
            if list(t.shape) != g.shape:
                raise ShapeMismatchError(f"{m.path}: entry {name!r}: checkpoint shape {g.shape} "
                                         f"but model shape {list(t.shape)}")
            report.loaded.append(name)
            region = _region(t)
            if region is not None:
                copies.append((t, reader.assemble(g, *region)))
        have = set(report.loaded) | set(report.missing)
        report.skipped = [n for n, g in saved.items() if g.kind in model_kinds and n not in have]
        if strict and (report.skipped or report.missing):
            raise StrictLoadError(
                f"{m.path}: strict load: {len(report.skipped)} entries not in the model "
                f"{report.skipped[:5]}, {len(report.missing)} model tensors not in the checkpoint "
                f"{report.missing[:5]}; pass strict=False to load the overlap")
        optim_sd = None
        if optimizer is not None:
            info = (m.sharded or {}).get("optimizer")
            if not info:
                raise FormatError("no optimizer state was saved with this checkpoint "
                                  "(submit(..., optimizer=opt) saves it)", path=m.path)
            for name, g in saved.items():
                if g.kind != "optim":
                    continue
                p = named.get(name.rpartition(":")[0])
                if p is not None and _is_dtensor(p) and list(p.shape) == g.shape:
                    region = _region(p)   # shaped like its parameter: sharded like it
                    if region is None:
                        continue
                    local = reader.assemble(g, *region).to(p.to_local().device)
                    optim_tensors[name] = _dtensor_type().from_local(
                        local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                        stride=p.stride())
                else:
                    optim_tensors[name] = reader.assemble(g, [0] * len(g.shape), g.shape)
            optim_sd = optimizer_state_dict(optimizer, model, optim_tensors, info, m.path)
    with torch.no_grad():   # in place: the optimizer keeps its references
        for dst, src in copies:
            (dst.to_local() if _is_dtensor(dst) else dst).copy_(src)
    if optim_sd is not None:
        optimizer.load_state_dict(optim_sd)
    meta = read_meta(os.path.join(m.path, m.ranks[min(rank, m.world_size - 1)].file))
    report.epoch, report.metrics = meta.epoch, dict(meta.metrics)
    report.extra = _user_extra(meta.extra)
    return report


def consolidate(step: str | os.PathLike[str], dst: str | os.PathLike[str], *,
                compress_level: int | None = None) -> str:
    """Write a sharded checkpoint's full, unsharded model as one flodl ``.fdl``.

    ``step`` is a complete ``step_<N>`` directory saved from a sharded model
    (FSDP2, DTensor). ``dst`` gets the global tensors under the model's own
    parameter and buffer names (gzip on ``.gz``), its ``.meta`` (rank 0's
    epoch, metrics and extra), and, when the optimizer was saved, the
    optimizer file beside it (``x.optim.fdl``), so :func:`snapsvc.restore`
    loads it into a plain model and optimizer. Every piece is checked against
    the manifest's CRC-32 first. Holds the whole model in memory. Returns
    ``dst``'s absolute path.
    """
    m = read_manifest(step)
    if m.sharded is None:
        raise ValueError(f"{m.path} was not saved from a sharded model: each rank<r> file "
                         "already holds that rank's whole model (snapsvc.restore reads it)")
    saved = _globals(m)

    def whole(names: list[str]) -> list[tuple[str, torch.Tensor]]:
        missing = [n for n in names if n not in saved]
        if missing:
            raise FormatError(f"no pieces of {missing[:5]} in any rank's file", path=m.path)
        return [(n, reader.assemble(saved[n], [0] * len(saved[n].shape), saved[n].shape))
                for n in names]

    dst = os.path.abspath(os.fspath(dst))
    with _PieceReader(_sizes(m), True) as reader:
        params, buffers = whole(m.sharded["params"]), whole(m.sharded["buffers"])
        info = m.sharded.get("optimizer")
        optim = whole([n for n, g in saved.items() if g.kind == "optim"]) if info else None
    meta0 = read_meta(os.path.join(m.path, m.ranks[0].file))
    meta = Meta(buffers=[n for n, _ in buffers], epoch=int(m.epoch or 0), metrics=m.metrics,
                structural_hash=layout_hash(params, buffers), extra=_user_extra(meta0.extra),
                optimizer=info)
    write_with_meta(dst, params + buffers, meta, compress_level=compress_level,
                    optim=None if optim is None else (optim_path(dst), optim))
    return dst


# -- the writer ---------------------------------------------------------------------
@dataclass
class DistributedWriteReport(WriteReport):
    """A committed multi-rank checkpoint, as one rank sees it.

    ``path`` is the step directory; ``file`` is this rank's file in it.
    ``bytes``, ``entries`` and the timings up to ``fsync_s`` are this rank's
    write; ``coord_s`` is the exchange and manifest; ``total_s`` runs from
    submit() to the handle resolving.
    """

    step: int = 0
    file: str = ""
    manifest: str = ""
    rank: int = 0
    world_size: int = 1
    total_bytes: int = 0    # every rank's files together
    coord_s: float = 0.0


class DistributedWriteHandle(WriteHandle):
    """A pending multi-rank checkpoint; ``result()`` is a :class:`DistributedWriteReport`.

    It resolves on every rank only after rank 0 committed the manifest, or
    fails on every rank with :class:`DistributedCheckpointError`.
    """

    def __init__(self, seq: int, path: str, step: int, rank: int, file: str) -> None:
        super().__init__(seq, path)
        self.step = step
        self.rank = rank
        self.file = file
        self.local: WriteHandle | None = None   # this rank's SnapshotWriter handle

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<DistributedWriteHandle step={self.step} rank={self.rank} {self.path!r} {state}>"


@dataclass
class _Item:
    handle: DistributedWriteHandle
    step: int
    started: float
    metrics: Mapping[str, float] | None
    epoch: int | None
    error: BaseException | None = None
    stage_s: float = 0.0
    records: list[dict[str, Any]] | None = None   # sharded: this rank's pieces, in file order
    sharded: dict[str, Any] | None = None         # sharded: the model's description


def _settle(handle: WriteHandle, result: Any = None, exc: BaseException | None = None) -> None:
    if handle.done():
        return
    try:
        if exc is not None:
            handle._future.set_exception(exc)
        else:
            handle._future.set_result(result)
    except Exception:  # InvalidStateError: a racing close() settled it first
        pass


_MSG_MAX = 16 << 10  # bytes of msgpack in the commit-decision broadcast (reasons are cut to fit)


def _to_tensor(obj: Any) -> torch.Tensor:
    """msgpack ``obj`` into a fixed-size uint8 tensor: a u32 length, then the bytes.

    The ``*_object`` collectives would do this with pickle, and need numpy.
    """
    data = pack_value(obj)
    if len(data) > _MSG_MAX - 4:
        raise ValueError(f"coordination message of {len(data)} bytes exceeds {_MSG_MAX - 4}")
    buf = torch.zeros(_MSG_MAX, dtype=torch.uint8)
    buf[: 4 + len(data)] = torch.frombuffer(bytearray(len(data).to_bytes(4, "little") + data),
                                            dtype=torch.uint8)
    return buf


def _from_tensor(buf: torch.Tensor) -> Any:
    n = int.from_bytes(bytes(buf[:4].tolist()), "little")
    return unpack_value(bytes(buf[4: 4 + n].tolist()))


def _all_gather_msg(obj: Any, world_size: int, group: Any) -> list[Any]:
    """Every rank's ``obj``; any size (a sharded rank sends its entry table): the
    lengths go first, then the messages padded to the longest."""
    data = pack_value(obj)
    if len(data) > _MAX_MANIFEST:
        raise ValueError(f"coordination message of {len(data)} bytes exceeds {_MAX_MANIFEST}")
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=group)
    longest = max(1, *(int(n) for n in sizes))
    buf = torch.zeros(longest, dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.empty(longest, dtype=torch.uint8) for _ in range(world_size)]
    dist.all_gather(out, buf, group=group)
    return [unpack_value(ctypes.string_at(t.data_ptr(), int(n))) for t, n in zip(out, sizes)]


def _broadcast_msg(obj: Any, src: int, group: Any) -> Any:
    buf = _to_tensor(obj)
    dist.broadcast(buf, src=src, group=group)
    return _from_tensor(buf)


def _reason(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= _MAX_REASON else text[:_MAX_REASON] + "..."


def _new_group(process_group: Any, timeout: float) -> Any:
    """A gloo group over the same ranks, in the same order, for coordination only."""
    td = timedelta(seconds=timeout)
    if process_group is None or process_group is dist.GroupMember.WORLD:
        return dist.new_group(backend="gloo", timeout=td)
    ranks = dist.get_process_group_ranks(process_group)
    kwargs = dict(ranks=ranks, backend="gloo", timeout=td, use_local_synchronization=True)
    try:  # keep group ranks equal to process_group's (torch >= 2.10 has sort_ranks)
        return dist.new_group(**kwargs, sort_ranks=False)
    except TypeError:
        if ranks != sorted(ranks):
            raise ValueError("this torch cannot keep the rank order of an unsorted "
                             "process_group; pass one created with sorted ranks") from None
        return dist.new_group(**kwargs)


class DistributedSnapshotWriter:
    """One :class:`SnapshotWriter` sidecar per rank, plus a manifest per checkpoint.

    Construct it on every rank of ``process_group`` (default: the whole job)
    after ``dist.init_process_group``: the constructor creates a dedicated
    gloo group, a collective. ``directory`` must be on a filesystem every rank
    shares (each rank writes into the same ``step_<N>`` directories, and rank
    0 checks nothing but what the others report).

    ``coord_timeout``: seconds a rank waits in an exchange for the others;
    it must exceed the spread between ranks' write times, since a fast rank
    waits there for the slowest. ``write_timeout``: seconds the coordinator
    waits for this rank's own write before declaring it failed (default:
    ``coord_timeout``). ``compressed``: write ``rank<r>.fdl.gz``.
    ``drain_timeout``: how long an interpreter exit without :meth:`close`
    waits for queued checkpoints. The other keywords go to
    :class:`SnapshotWriter` (``slots``, ``policy``, ``compress_level``,
    ``restart``, ``overlap``, ``fault_hook``, ...); ``keep_last`` is refused
    (it prunes per directory, and every step has its own).

    A context manager like SnapshotWriter; :meth:`close` drains, then stops
    the sidecar. Close it before ``dist.destroy_process_group()``.
    """

    def __init__(self, directory: str | os.PathLike[str], process_group: Any = None, *,
                 coord_timeout: float = 300.0, write_timeout: float | None = None,
                 compressed: bool = False, drain_timeout: float = 60.0,
                 **writer_options: Any) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("DistributedSnapshotWriter needs torch.distributed initialized "
                               "(dist.init_process_group) first")
        if "keep_last" in writer_options:
            raise ValueError("keep_last prunes files per directory, and every checkpoint has "
                             "its own step directory: it is not supported here")
        if coord_timeout <= 0 or (write_timeout is not None and write_timeout <= 0):
            raise ValueError("coord_timeout and write_timeout must be positive")
        self.directory = os.path.abspath(os.fspath(directory))
        self.process_group = process_group
        self.rank, self.world_size = _rank_and_world(process_group)
        self.coord_timeout = float(coord_timeout)
        self.write_timeout = float(write_timeout if write_timeout is not None else coord_timeout)
        self.compressed = compressed
        self.drain_timeout = drain_timeout
        os.makedirs(self.directory, exist_ok=True)
        self._group = _new_group(process_group, self.coord_timeout)
        self._root = dist.get_global_rank(self._group, 0)
        self._writer = SnapshotWriter(self.directory, **writer_options)
        self._queue: "queue.Queue[_Item | None]" = queue.Queue()
        self._unresolved: dict[int, DistributedWriteHandle] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._broken: DistributedCheckpointError | None = None
        self._closed = False
        self._seq = 0
        self._last_step: int | None = None
        self._counts = {"submitted": 0, "committed": 0, "failed": 0}
        self._host = socket.gethostname()

    # -- lifecycle ---------------------------------------------------------------
    def __enter__(self) -> "DistributedSnapshotWriter":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def writer(self) -> SnapshotWriter:
        """This rank's SnapshotWriter (its sidecar's ``pid``, ``stats()``)."""
        return self._writer

    @property
    def broken(self) -> DistributedCheckpointError | None:
        """The coordination failure after which submits are refused, or None."""
        return self._broken

    def start(self) -> "DistributedSnapshotWriter":
        """Start this rank's sidecar and coordinator thread (submit does it too)."""
        if self._closed:
            raise RuntimeError("this DistributedSnapshotWriter is closed; make a new one")
        if self._thread is None:
            self._writer.start()
            self._thread = threading.Thread(target=self._coordinate, name="snapsvc-coordinator",
                                            daemon=True)
            self._thread.start()
            _live.add(self)
        return self

    def close(self, timeout: float | None = None) -> None:
        """Coordinate every queued checkpoint, then stop the sidecar.

        Call it on every rank (the queued checkpoints need every rank's
        coordinator). Each queued checkpoint is bounded by ``write_timeout``
        plus two exchanges of ``coord_timeout``; with ``timeout``, the
        handles still pending after it fail and the sidecar is stopped.
        """
        if self._closed:
            return
        self._closed = True
        _live.discard(self)
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
            if self._thread.is_alive():
                with self._lock:
                    late = list(self._unresolved.values())
                    self._unresolved.clear()
                err = DistributedCheckpointError(
                    f"the writer was closed before these checkpoints were coordinated "
                    f"(close timeout {timeout} s)")
                for h in late:
                    _settle(h, exc=err)
                log.error("snapsvc: %d checkpoint(s) not coordinated within %.1f s: %s",
                          len(late), timeout or 0.0, ", ".join(h.path for h in late))
        left = None if deadline is None else max(0.1, deadline - time.monotonic())
        self._writer.close(left)
        if self._thread is None or not self._thread.is_alive():
            try:
                dist.destroy_process_group(self._group)
            except Exception as e:  # the world may be gone already; the group with it
                log.debug("destroying the coordination group: %s", e)

    finish = close

    # -- submit --------------------------------------------------------------------
    def submit(self, model: nn.Module, step: int, *, metrics: Mapping[str, float] | None = None,
               epoch: int | None = None, optimizer: torch.optim.Optimizer | None = None,
               extra: Any = None) -> DistributedWriteHandle:
        """Stage this rank's part of checkpoint ``step``; return once it is copied.

        Every rank must submit the same steps, in the same order, with
        increasing step numbers. No collective runs here. The handle resolves
        once rank 0 committed the manifest (on every rank), or fails on every
        rank. ``metrics``/``epoch``/``extra`` go to this rank's metadata;
        rank 0's metrics and epoch also to the manifest. If this raises
        (after the writer accepted the call), the checkpoint still takes part
        in coordination, so that the other ranks' handles fail rather than wait.
        """
        if self._closed:
            raise RuntimeError("this DistributedSnapshotWriter is closed; make a new one")
        if self._broken is not None:
            raise self._broken
        started = time.monotonic()
        step = operator.index(step)
        self.start()
        d = step_dir(self.directory, step)
        name = _rank_file(self.rank, self.compressed)
        with self._lock:
            self._seq += 1
            handle = DistributedWriteHandle(self._seq, d, step, self.rank, os.path.join(d, name))
            self._unresolved[handle.seq] = handle
        self._counts["submitted"] += 1
        item = _Item(handle, step, started, metrics, epoch)
        try:
            if step < 0:
                raise ValueError(f"step must be >= 0, got {step}")
            if self._last_step is not None and step <= self._last_step:
                raise ValueError(f"step {step} after step {self._last_step}: steps must increase "
                                 "(a step's files must not change under a manifest)")
            self._last_step = step
            if os.path.exists(os.path.join(d, MANIFEST_NAME)):
                raise ValueError(f"{d} already holds a complete checkpoint; refusing to "
                                 "overwrite its files")
            os.makedirs(d, exist_ok=True)   # every rank: shared filesystem, any may be first
            if isinstance(model, nn.Module) and _is_sharded(model):
                if self.compressed:
                    raise ValueError("a sharded model is saved uncompressed, so that each rank "
                                     "can read the byte ranges it needs; use compressed=False")
                extra = check_plain(extra, "extra")   # before it is wrapped: errors name it
                snap, item.records, item.sharded = _shard_plan(model, optimizer, self.rank)
                handle.local = self._writer.submit(snap, handle.file, metrics=metrics,
                                                   epoch=epoch,
                                                   extra={SHARDS_KEY: item.records,
                                                          "extra": extra})
            else:
                handle.local = self._writer.submit(model, handle.file, metrics=metrics,
                                                   epoch=epoch, optimizer=optimizer, extra=extra)
        except BaseException as e:
            item.error = e
            self._queue.put(item)   # keep every rank's sequence of exchanges aligned
            raise
        item.stage_s = time.monotonic() - started
        self._queue.put(item)
        return handle

    def stats(self) -> dict[str, Any]:
        """Counts of checkpoints, and this rank's SnapshotWriter figures under ``"writer"``."""
        return {**self._counts, "broken": self._broken is not None,
                "writer": self._writer.stats()}

    # -- coordination (its own thread) ----------------------------------------------
    def _coordinate(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._one(item)
            except BaseException as e:  # never let the thread die silently
                log.exception("snapsvc: coordinating step %d failed", item.step)
                self._fail(item, DistributedCheckpointError(
                    f"step {item.step}: coordination failed on rank {self.rank}: {_reason(e)}",
                    step=item.step, failures={self.rank: _reason(e)}))
                self._broken = self._broken or DistributedCheckpointError(
                    f"coordination failed on rank {self.rank} ({_reason(e)}); this writer "
                    "accepts no more submits", step=item.step)

    def _fail(self, item: _Item, err: DistributedCheckpointError) -> None:
        self._counts["failed"] += 1
        with self._lock:
            self._unresolved.pop(item.handle.seq, None)
        try:   # a step every rank failed to write leaves no empty directory behind
            os.rmdir(item.handle.path)
        except OSError:   # not empty (a rank's files, kept for a post-mortem), or gone already
            pass
        _settle(item.handle, exc=err)

    def _local(self, item: _Item) -> tuple[dict[str, Any], WriteReport | None]:
        """This rank's outcome, as sent to the others."""
        out: dict[str, Any] = {"step": item.step, "ok": False, "error": None,
                               "host": self._host, "pid": os.getpid()}
        if item.error is not None:
            out["error"] = f"submit() raised {_reason(item.error)}"
            return out, None
        try:
            report = item.handle.local.result(timeout=self.write_timeout)
        except TimeoutError:
            out["error"] = (f"its write was not durable within write_timeout="
                            f"{self.write_timeout:g} s")
            return out, None
        except Exception as e:
            out["error"] = _reason(e)
            return out, None
        if report.skipped:
            out["error"] = f"its write was skipped (SnapshotWriter policy {self._writer.policy!r})"
            return out, None
        try:
            meta = read_meta(item.handle.file)
        except Exception as e:
            out["error"] = f"reading back its metadata: {_reason(e)}"
            return out, None
        optim = None
        if meta.optimizer:
            optim = {k: meta.optimizer[k] for k in ("file", "size", "crc32")}
        entries = None
        if item.records is not None:
            try:
                entries = _entry_table(item.handle.file, item.records)
            except Exception as e:
                out["error"] = f"reading back its entry table: {_reason(e)}"
                return out, None
        out.update(ok=True, file=os.path.basename(item.handle.file), size=meta.size,
                   crc32=meta.crc32, optim=optim, entries=entries)
        return out, report

    def _one(self, item: _Item) -> None:
        step = item.step
        if self._broken is not None:
            self._fail(item, DistributedCheckpointError(
                f"step {step}: not coordinated, after an earlier failure: {self._broken}",
                step=step, timed_out=self._broken.timed_out))
            return
        mine, report = self._local(item)
        t0 = time.monotonic()
        try:
            gathered = _all_gather_msg(mine, self.world_size, self._group)
        except Exception as e:
            self._broken = DistributedCheckpointError(
                f"step {step}: exchanging write results with the other ranks failed "
                f"(coord_timeout={self.coord_timeout:g} s): {_reason(e)}; a rank died, hung or "
                "fell out of step, so no manifest was written. This writer accepts no more "
                "submits.", step=step, timed_out=True)
            self._fail(item, self._broken)
            return
        failures = {r: g["error"] for r, g in enumerate(gathered) if not g["ok"]}
        steps = [g["step"] for g in gathered]
        if len(set(steps)) > 1:
            failures = {r: f"submitted step {s} (ranks out of step: every rank must submit the "
                        "same steps in the same order)" for r, s in enumerate(steps)}
        elif not failures and len({g["entries"] is None for g in gathered}) > 1:
            failures = {r: "submitted a " + ("plain" if g["entries"] is None else "sharded")
                        + " model (every rank must submit the same model)"
                        for r, g in enumerate(gathered)}
        decision: list[Any] = [False, None]
        if self.rank == 0 and not failures:
            try:
                manifest = Manifest(
                    step=step, world_size=self.world_size,
                    ranks=[RankFile(r, g["file"], g["size"], g["crc32"], g["optim"], g["entries"])
                           for r, g in enumerate(gathered)],
                    format_version=fdl.VERSION,
                    epoch=None if item.epoch is None else int(item.epoch),
                    metrics={str(k): float(v) for k, v in (item.metrics or {}).items()},
                    sharded=item.sharded)
                _write_manifest(item.handle.path, manifest)
                decision = [True, None]
            except Exception as e:
                decision = [False, f"writing the manifest on rank 0: {_reason(e)}"]
        committed_here = decision[0]
        try:
            decision = _broadcast_msg(decision, self._root, self._group)
        except Exception as e:
            self._broken = DistributedCheckpointError(
                f"step {step}: the commit decision did not arrive from rank 0 "
                f"(coord_timeout={self.coord_timeout:g} s): {_reason(e)}. This writer accepts "
                "no more submits.", step=step, timed_out=True)
            if not committed_here:
                self._fail(item, DistributedCheckpointError(
                    f"{self._broken} The checkpoint may or may not be complete: "
                    "latest_checkpoint() decides.", step=step, timed_out=True))
                return
            log.warning("%s (the manifest is committed; this rank reports success)", self._broken)
            decision = [True, None]
        coord_s = time.monotonic() - t0
        if not decision[0]:
            if decision[1] is not None:
                failures = {0: decision[1]}
            detail = "; ".join(f"rank {r}: {why}" for r, why in sorted(failures.items()))
            self._fail(item, DistributedCheckpointError(
                f"step {step} not committed (no manifest) because of rank(s) "
                f"{sorted(failures)}: {detail}", step=step, failures=failures))
            return
        total = sum(g["size"] + (g["optim"]["size"] if g["optim"] else 0) for g in gathered)
        self._counts["committed"] += 1
        with self._lock:
            self._unresolved.pop(item.handle.seq, None)
        _settle(item.handle, DistributedWriteReport(
            path=item.handle.path, bytes=report.bytes, entries=report.entries,
            stage_s=item.stage_s, queue_s=report.queue_s, encode_s=report.encode_s,
            write_s=report.write_s, fsync_s=report.fsync_s,
            total_s=time.monotonic() - item.started, seq=item.handle.seq, step=step,
            file=item.handle.file, manifest=os.path.join(item.handle.path, MANIFEST_NAME),
            rank=self.rank, world_size=self.world_size, total_bytes=total, coord_s=coord_s))


@atexit.register
def _close_at_exit() -> None:
    """An interpreter exit without close(): coordinate what is queued, bounded."""
    for w in list(_live):
        try:
            w.close(timeout=w.drain_timeout)
        except Exception:  # never block interpreter exit on a checkpoint
            log.exception("closing a snapsvc distributed writer at exit failed")

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
import logging
import operator
import os
import queue
import re
import socket
import threading
import time
import weakref
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, Mapping

import msgpack
import torch
import torch.distributed as dist
from isal import isal_zlib
from torch import nn

from . import fdl
from .checkpoint import LoadReport
from .client import SnapshotWriter, WriteHandle, WriteReport
from .durable import atomic_write, fsync_dir
from .errors import DistributedCheckpointError, FormatError, WorldSizeMismatchError
from .meta import meta_path, read_meta, read_msgpack_file
from .resume import restore

__all__ = ["DistributedSnapshotWriter", "DistributedWriteHandle", "DistributedWriteReport",
           "Manifest", "RankFile", "MANIFEST_NAME", "latest_checkpoint", "read_manifest",
           "restore_distributed", "step_dir"]

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
    path: str = ""


def _write_manifest(directory: str, manifest: Manifest) -> str:
    """Durably write ``directory/manifest.msgpack``; fsync ``directory``'s parent too."""
    body = {"magic": MANIFEST_MAGIC, "manifest_version": MANIFEST_VERSION,
            **{k: v for k, v in asdict(manifest).items() if k != "path"}}
    path = os.path.join(directory, MANIFEST_NAME)
    with atomic_write(path) as out:   # temp, fsync, rename, fsync step dir
        out.write(msgpack.packb(body, use_bin_type=True))
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
def _file_crc(path: str) -> tuple[int, int]:
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            crc = isal_zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, crc


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
    returns). The manifest's world size must equal
    ``dist.get_world_size(process_group)`` (1 when torch.distributed is not
    initialized): a different one is refused with
    :class:`WorldSizeMismatchError`; resharding is not supported. This rank's
    file (and optimizer file) must have the recorded size and, with
    ``verify``, CRC-32. Then :func:`snapsvc.restore` loads it; the report's
    ``epoch``, ``metrics`` and ``extra`` are this rank's. Local: no collective
    is run; a rank that raises should stop the job.
    """
    m = read_manifest(path)
    rank, world = _rank_and_world(process_group)
    if m.world_size != world:
        raise WorldSizeMismatchError(
            f"{m.path}: checkpoint was saved by {m.world_size} ranks but the current world size "
            f"is {world}; snapsvc restores each rank's own file and does not reshard",
            saved=m.world_size, current=world)
    entry = m.ranks[rank]
    file = os.path.join(m.path, entry.file)
    checks = [(file, entry.size, entry.crc32)]
    if optimizer is not None and entry.optim is not None:
        checks.append((os.path.join(m.path, entry.optim["file"]), entry.optim["size"],
                       entry.optim["crc32"]))
    for p, size, crc in checks:
        if verify:
            actual_size, actual_crc = _file_crc(p)
        else:
            actual_size, actual_crc = os.stat(p).st_size, crc
        if actual_size != size:
            raise FormatError(f"{actual_size} bytes, the manifest says {size}", path=p)
        if actual_crc != crc:
            raise FormatError(f"CRC-32 {actual_crc:08x}, the manifest says {crc:08x}: the file "
                              "changed after the checkpoint was committed", path=p)
    return restore(file, model, optimizer, strict=strict)


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


_MSG_MAX = 16 << 10  # bytes of msgpack per rank per exchange (errors are cut to fit)


def _to_tensor(obj: Any) -> torch.Tensor:
    """msgpack ``obj`` into a fixed-size uint8 tensor: a u32 length, then the bytes.

    The ``*_object`` collectives would do this with pickle, and need numpy.
    """
    data = msgpack.packb(obj, use_bin_type=True)
    if len(data) > _MSG_MAX - 4:
        raise ValueError(f"coordination message of {len(data)} bytes exceeds {_MSG_MAX - 4}")
    buf = torch.zeros(_MSG_MAX, dtype=torch.uint8)
    buf[: 4 + len(data)] = torch.frombuffer(bytearray(len(data).to_bytes(4, "little") + data),
                                            dtype=torch.uint8)
    return buf


def _from_tensor(buf: torch.Tensor) -> Any:
    n = int.from_bytes(bytes(buf[:4].tolist()), "little")
    return msgpack.unpackb(bytes(buf[4: 4 + n].tolist()), raw=False)


def _all_gather_msg(obj: Any, world_size: int, group: Any) -> list[Any]:
    out = [torch.empty(_MSG_MAX, dtype=torch.uint8) for _ in range(world_size)]
    dist.all_gather(out, _to_tensor(obj), group=group)
    return [_from_tensor(t) for t in out]


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
            handle.local = self._writer.submit(model, handle.file, metrics=metrics, epoch=epoch,
                                               optimizer=optimizer, extra=extra)
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
        out.update(ok=True, file=os.path.basename(item.handle.file), size=meta.size,
                   crc32=meta.crc32, optim=optim)
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
        decision: list[Any] = [False, None]
        if self.rank == 0 and not failures:
            try:
                manifest = Manifest(
                    step=step, world_size=self.world_size,
                    ranks=[RankFile(r, g["file"], g["size"], g["crc32"], g["optim"])
                           for r, g in enumerate(gathered)],
                    format_version=fdl.VERSION,
                    epoch=None if item.epoch is None else int(item.epoch),
                    metrics={str(k): float(v) for k, v in (item.metrics or {}).items()})
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

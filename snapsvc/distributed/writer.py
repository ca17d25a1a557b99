"""``DistributedSnapshotWriter``: one :class:`SnapshotWriter` sidecar per rank, one manifest.

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

Sharded models: see :mod:`.shards` and docs/distributed.md.

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
import socket
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Mapping
import torch
import torch.distributed as dist
from torch import nn

from ..engine.writer import SnapshotWriter, WriteHandle, WriteReport
from ..format import fdl
from ..errors import DistributedCheckpointError
from ..files.meta import read_meta
from ..state.tree import check_plain
from .manifest import MANIFEST_NAME, Manifest, RankFile, _rank_file, _write_manifest, step_dir
from .shards import SHARDS_KEY, _is_sharded, _shard_plan
from .pieces import _entry_table

from .coord import _all_gather_msg, _broadcast_msg, _new_group, _rank_and_world, _reason

__all__ = ["DistributedSnapshotWriter", "DistributedWriteHandle", "DistributedWriteReport"]

log = logging.getLogger("snapsvc")


_live: "weakref.WeakSet[DistributedSnapshotWriter]" = weakref.WeakSet()


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

        Every rank must submit the same steps, in the same order, each
        greater than the steps still pending; a step may come again once its
        earlier checkpoint resolved, unless it is committed (its directory
        holds a manifest). No collective runs here. The handle resolves
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
            pending = max((h.step for h in self._unresolved.values()), default=None)
            self._unresolved[handle.seq] = handle
        self._counts["submitted"] += 1
        item = _Item(handle, step, started, metrics, epoch)
        try:
            if step < 0:
                raise ValueError(f"step must be >= 0, got {step}")
            # Increasing while earlier ones are in flight (one step's files, one writer at a
            # time); once they resolved, a step may come again (a trainer resumed from an
            # earlier checkpoint) unless its directory holds a manifest, checked next.
            if pending is not None and step <= pending:
                raise ValueError(f"step {step} after step {pending}, which is still being "
                                 "written: steps must increase")
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

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
import time
import weakref
from typing import Any, Mapping, cast

import torch
import torch.distributed as dist
from torch import nn

from ..engine.dispatch import Held, hold, send_held
from ..engine.writer import SnapshotWriter
from ..errors import DistributedCheckpointError
from ..state.tree import check_plain
from ..remote.store import check_remote
from .commit import Coordinator
from .coord import _all_gather_msg, _new_group, _rank_and_world
from .handles import DistributedWriteHandle, DistributedWriteReport, _Item
from .manifest import MANIFEST_NAME, _rank_file, step_dir
from .replicas import Keeper, Replicator, node_id
from .shards import SHARDS_KEY, ShardMemo, _holds_dtensor, _is_sharded, _shard_plan, \
    _state_plan
from .uploads import Uploads, upload_wait

__all__ = ["DistributedSnapshotWriter", "DistributedWriteHandle", "DistributedWriteReport"]

log = logging.getLogger("snapsvc")


# with replicas the sidecar drops no RAM copy by count: the Keeper drops steps once newer
# ones are complete in RAM (committed and replicated), which the sidecar cannot see
_SIDECAR_KEEP = 1 << 20

_live: "weakref.WeakSet[DistributedSnapshotWriter]" = weakref.WeakSet()


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

    ``remote``: a second tier, a URL (``s3://bucket/prefix``, ``gs://``,
    ``az://``) or a mounted directory, the same on every rank. Each rank's
    sidecar uploads its own files of each committed step to the same path
    under ``remote`` (``.meta`` last, as :class:`SnapshotWriter` does), and
    rank 0 writes the step's remote manifest only after every rank's upload
    committed (see :mod:`.uploads`); ``handle.uploaded()`` then returns the
    step's remote URL on every rank. ``remote_keep_last``: the number of
    complete steps kept on the remote tier (older ones lose their manifest
    first, then their files); ``remote_timeout`` bounds each rank's upload of
    a step, and how long :meth:`close` waits for uploads; ``remote_options``
    go to the storage engine. At :meth:`start`, the steps an earlier run left
    complete locally but not remotely (a crash, an outage) are uploaded the
    same way, newest first; their outcomes are logged.

    ``replicas=k``: each rank's snapshot also in the RAM of k ranks on other nodes
    (``handle.replicated()``); ``persist_every``, ``linger``: as for SnapshotWriter,
    per rank; ``keep_in_memory`` 2 unless given (with replicas: steps complete in RAM);
    ``memory_limit`` also bounds held replicas. See docs/distributed.md, "Peer replicas".

    A context manager like SnapshotWriter; :meth:`close` drains, then stops
    the sidecar. Close it before ``dist.destroy_process_group()``.
    """

    def __init__(self, directory: str | os.PathLike[str], process_group: Any = None, *,
                 coord_timeout: float = 300.0, write_timeout: float | None = None,
                 compressed: bool = False, drain_timeout: float = 60.0,
                 remote: str | os.PathLike[str] | None = None,
                 remote_keep_last: int | None = None, remote_timeout: float = 300.0,
                 remote_options: Mapping[str, Any] | None = None,
                 replicas: int = 0, linger: float = 0.0, persist_every: int | None = None,
                 **writer_options: Any) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("DistributedSnapshotWriter needs torch.distributed initialized "
                               "(dist.init_process_group) first")
        if "keep_last" in writer_options:
            raise ValueError("keep_last prunes files per directory, and every checkpoint has "
                             "its own step directory: it is not supported here")
        if coord_timeout <= 0 or (write_timeout is not None and write_timeout <= 0):
            raise ValueError("coord_timeout and write_timeout must be positive")
        if replicas < 0 or (persist_every is not None and persist_every < 1):
            raise ValueError(f"replicas must be >= 0 and persist_every >= 1 or None, got "
                             f"replicas={replicas!r}, persist_every={persist_every!r}")
        self.replicas = int(replicas)
        self.persist_every = persist_every
        self._submits = 0   # persist_every's count: every step has its own directory
        self.directory = os.path.abspath(os.fspath(directory))
        self.process_group = process_group
        self.rank, self.world_size = _rank_and_world(process_group)
        self.coord_timeout = float(coord_timeout)
        self.write_timeout = float(write_timeout if write_timeout is not None else coord_timeout)
        self.compressed = compressed
        self.drain_timeout = drain_timeout
        self.remote = check_remote(remote, self.directory, remote_keep_last, remote_timeout,
                                   remote_options)
        os.makedirs(self.directory, exist_ok=True)
        self._group = _new_group(process_group, self.coord_timeout)
        self._root = dist.get_global_rank(self._group, 0)
        # every rank must agree: the remote tier adds a collective (a group) and exchanges
        remotes = _all_gather_msg(self.remote is not None, self.world_size, self._group)
        if len(set(remotes)) > 1:
            dist.destroy_process_group(self._group)
            raise ValueError(f"remote= is set on ranks {[r for r, on in enumerate(remotes) if on]}"
                             " only: pass the same remote on every rank")
        # remote_keep_last is not the per-rank writer's: its series rule would take
        # rank0.fdl and rank1.fdl of one step for one series; Uploads rotates whole steps
        keeper = _keeper(self, writer_options)   # step_<N>/ are one RAM series
        self._writer = SnapshotWriter(self.directory, remote=self.remote,
                                      remote_timeout=remote_timeout,
                                      remote_options=remote_options, linger=linger,
                                      **writer_options)
        # a lingering sidecar is found by its key: one per rank, not per shared directory
        self._writer._life.options["linger_key"] = os.path.join(self.directory,
                                                                f".rank{self.rank}")
        self._uploads: Uploads | None = None
        if self.remote is not None:
            self._upload_group, self._uploads = _start_uploads(
                self, process_group, remote_timeout, remote_options, remote_keep_last)
        self._replicator = replicator = None if keeper is None else Replicator(
            # transfers' own deadlines come first: a gloo timeout closes all of a rank's links
            self.directory, _new_group(process_group, 10 * self.coord_timeout), self.rank,
            self.world_size, self.replicas, node_id(), self.coord_timeout, keeper)
        self._coord = Coordinator(self._writer, self._group, self._root, self.rank,
                                  self.world_size, self.coord_timeout, self.write_timeout,
                                  on_commit=None if self._uploads is None else self._uploads.add,
                                  replicator=replicator)
        self._shard_memo = ShardMemo()   # a state submit's walk, kept for the next
        self._started = False
        self._closed = False

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
        return self._coord.broken

    def start(self) -> "DistributedSnapshotWriter":
        """Start this rank's sidecar and coordinator thread (submit does it too)."""
        if self._closed:
            raise RuntimeError("this DistributedSnapshotWriter is closed; make a new one")
        if not self._started:
            self._writer.start()
            self._coord.start()
            if self._uploads is not None:
                self._uploads.start()
            if self._replicator is not None:
                self._replicator.start()
            self._started = True
            _live.add(self)
        return self

    def close(self, timeout: float | None = None) -> None:
        """Coordinate every queued checkpoint, then stop the sidecar.

        Call it on every rank (the queued checkpoints need every rank's
        coordinator). Each queued checkpoint is bounded by ``write_timeout``
        plus two exchanges of ``coord_timeout``; with ``timeout``, the
        handles still pending after it fail and the sidecar is stopped.
        With ``remote``, the sidecar then gives uploads up to ``remote_timeout``
        and the ranks agree on each step's remote commit; a step not committed
        remotely fails its ``uploaded()``, and the steps of an earlier run that
        this writer was uploading and did not commit are logged (an error
        naming them).
        """
        if self._closed:
            return
        self._closed = True
        _live.discard(self)
        self._shard_memo = ShardMemo()   # lets go of the last state's tensors
        deadline = None if timeout is None else time.monotonic() + timeout
        groups: list[Any] = []
        ended = self._coord.stop(timeout)
        if self._replicator is not None:   # the queued steps replicate before the sidecar goes
            groups += self._replicator.close(None if deadline is None else max(
                0.1, deadline - time.monotonic()), ended)
        if self._uploads is not None:   # an earlier run's steps reach the sidecar first
            self._uploads.handed_over(None if deadline is None
                                      else max(0.1, deadline - time.monotonic()))
        left = None if deadline is None else max(0.1, deadline - time.monotonic())
        self._writer.close(left)   # the sidecar settles every upload before it exits
        groups += [self._group] if ended else []
        if self._uploads is not None:
            left = None if deadline is None else max(0.1, deadline - time.monotonic())
            if self._uploads.stop(left) and ended:
                groups.append(self._upload_group)
        for group in groups:
            try:
                dist.destroy_process_group(group)
            except Exception as e:  # the world may be gone already; the group with it
                log.debug("destroying a coordination group: %s", e)

    finish = close

    # -- submit --------------------------------------------------------------------
    def submit(self, model: nn.Module | Mapping[Any, Any], step: int, *,
               metrics: Mapping[str, float] | None = None, epoch: int | None = None,
               optimizer: torch.optim.Optimizer | None = None,
               extra: Any = None, persist: bool | None = None) -> DistributedWriteHandle:
        """Stage this rank's part of checkpoint ``step``; return once it is copied.

        ``model`` is this rank's model (with ``optimizer`` and ``extra``), or
        a state mapping with the value rules of :meth:`SnapshotWriter.submit`
        (modules, optimizers, stateful objects, tensors, plain values), whose
        DTensors may sit anywhere: each rank stages its pieces of every
        tensor, a replicated block or plain tensor once (see docs/distributed.md).
        A state without DTensors is each rank's own file, and ranks may differ
        (the HF Trainer's DDP save: the model on the main process, RNG on all).
        Every rank must submit the same steps, in the same order, each
        greater than the steps still pending (and a state of the same
        structure); a step may come again once its earlier checkpoint
        resolved, unless it is committed (its directory holds a manifest).
        No collective runs here. The handle resolves once rank 0 committed
        the manifest (on every rank), or fails on every rank.
        ``persist=False``: memory-only (this rank's file in its sidecar's RAM, the
        manifest named ``manifest.ram.msgpack``); None: as ``persist_every`` says.
        ``metrics``/``epoch``/``extra`` go to this rank's metadata; rank 0's
        metrics and epoch also to the manifest. If this raises (after the
        writer accepted the call), the checkpoint still takes part in
        coordination, so that the other ranks' handles fail rather than wait.
        """
        if self._closed:
            raise RuntimeError("this DistributedSnapshotWriter is closed; make a new one")
        if self._coord.broken is not None:
            raise self._coord.broken
        started = time.monotonic()
        step = operator.index(step)
        self.start()
        d = step_dir(self.directory, step)
        name = _rank_file(self.rank, self.compressed)
        pending = self._coord.newest_pending()
        handle = self._coord.handle(d, step, os.path.join(d, name))
        if persist is None:
            self._submits += 1
            persist = self.persist_every is None or self._submits % self.persist_every == 0
        item = _Item(handle, step, started, metrics, epoch, persist=bool(persist))
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
            if isinstance(model, Held):   # a state mapping staged by _hold (snapsvc.dcp)
                self._ranged(item, "a state mapping")
                item.records, item.sharded = model.info
                item.tree = model.tree
                handle.local = send_held(self._writer, model, handle.file, extra)
            elif isinstance(model, Mapping) and _holds_dtensor(model):
                if optimizer is not None or extra is not None:
                    raise TypeError("with a state mapping, put optimizers and extra values "
                                    "inside the mapping")
                self._ranged(item, "a state mapping")
                flat, item.records, item.sharded = _state_plan(model, self.rank,
                                                               self._shard_memo)
                item.tree = flat.tree   # its outline and digests: the coordinator's work
                # a Flat: submit's internal form of a state taken apart (engine.plan)
                handle.local = self._writer.submit(cast(Any, flat), handle.file, metrics=metrics,
                                                   epoch=epoch, persist=item.persist)
            elif isinstance(model, nn.Module) and _is_sharded(model):
                self._ranged(item, "a sharded model")
                extra = check_plain(extra, "extra")   # before it is wrapped: errors name it
                snap, item.records, item.sharded = _shard_plan(model, optimizer, self.rank)
                handle.local = self._writer.submit(snap, handle.file, metrics=metrics,
                                                   epoch=epoch,
                                                   extra={SHARDS_KEY: item.records,
                                                          "extra": extra},
                                                   persist=item.persist)
            else:
                handle.local = self._writer.submit(model, handle.file, metrics=metrics,
                                                   epoch=epoch, optimizer=optimizer, extra=extra,
                                                   persist=item.persist)
        except BaseException as e:
            item.error = e
            self._coord.queue.put(item)   # keep every rank's sequence of exchanges aligned
            raise
        item.stage_s = time.monotonic() - started
        self._coord.queue.put(item)
        return handle

    def _hold(self, state: Mapping[Any, Any], planned: tuple | None = None) -> Held:
        """Copy this rank's pieces of a state mapping into a slot now, as submit() would, and
        keep it for ``submit(held, step)``; ``planned``: its ``_state_plan`` (dcp keeps it)."""
        if self._closed:
            raise RuntimeError("this DistributedSnapshotWriter is closed; make a new one")
        self.start()
        flat, records, sharded = planned or _state_plan(state, self.rank, self._shard_memo)
        held = hold(self._writer, cast(Any, flat))
        held.info = (records, sharded)
        return held

    def _ranged(self, item: _Item, what: str) -> None:
        """``item`` is saved as pieces, read back by byte range."""
        if self.compressed:
            raise ValueError(f"{what} is saved uncompressed, so that each rank can read the "
                             "byte ranges it needs; use compressed=False")
        item.what = what.removeprefix("a ")

    def stats(self) -> dict[str, Any]:
        """Counts of checkpoints, and this rank's SnapshotWriter figures under ``"writer"``."""
        uploads: dict[str, Any] = {} if self._uploads is None else dict(self._uploads.counts)
        if self._replicator is not None:
            uploads.update(self._replicator.counts)
        return {**self._coord.counts, **uploads, "broken": self._coord.broken is not None,
                "writer": self._writer.stats()}


def _keeper(w: DistributedSnapshotWriter, writer_options: dict[str, Any]) -> Keeper | None:
    """With replicas, what decides which steps stay in RAM (the sidecar then drops
    none by count); ``keep_in_memory`` is 2 unless given, with or without."""
    keep = writer_options.setdefault("keep_in_memory", 2)
    if not w.replicas:
        return None
    writer_options["keep_in_memory"] = _SIDECAR_KEEP
    return Keeper(w.directory, w.rank, w.world_size, keep, writer_options.get("memory_limit"))


def _start_uploads(w: DistributedSnapshotWriter, process_group: Any, remote_timeout: float,
                   remote_options: Mapping[str, Any] | None,
                   remote_keep_last: int | None) -> tuple[Any, Uploads]:
    """The remote tier of ``w``: its rank's sidecar set up for a shared directory, and
    the :class:`Uploads` that commit whole steps (with the group they agree in)."""
    assert w.remote is not None
    # A rank's sidecar must not upload at its start what it finds in the shared
    # directory: the other ranks' files are there too (their sidecars upload them).
    # It deletes the step's remote manifest before its files: a step saved again
    # (a run resumed from an earlier one) is never complete over other bytes. At its
    # start it removes only its own rank's leftovers: another rank's upload may be live.
    w._writer._life.options.update(remote_scan=False, remote_uncommit=(MANIFEST_NAME,),
                                   remote_names=f"rank{w.rank}.*")
    group_timeout = w.coord_timeout + upload_wait(remote_timeout)
    group = _new_group(process_group, group_timeout)
    # at its start, the steps an earlier run left local-only are uploaded (ranks
    # agree which; each hands its own files to its sidecar): see .uploads
    return group, Uploads(w.remote, w.directory, group, dist.get_global_rank(group, 0), w.rank,
                          w.world_size, remote_timeout=remote_timeout,
                          remote_options=dict(remote_options or {}), keep_last=remote_keep_last,
                          upload=w._writer._upload_durable, group_timeout=group_timeout)


@atexit.register
def _close_at_exit() -> None:
    """An interpreter exit without close(): coordinate what is queued, bounded."""
    for w in list(_live):
        try:
            w.close(timeout=w.drain_timeout)
        except Exception:  # never block interpreter exit on a checkpoint
            log.exception("closing a snapsvc distributed writer at exit failed")

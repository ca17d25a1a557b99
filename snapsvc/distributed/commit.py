"""The coordinator thread of one rank: one exchange per checkpoint, in submit order.

::

    wait for this rank's write (write_timeout)
    all_gather (ok | error, step, size, crc32, entries)      [coord group]
    (a state whose outline differs between ranks: all_gather the outlines,
     then fail naming the ranks and paths)                    [coord group]
    rank 0: if every rank ok, write the manifest
    broadcast (committed, error) from rank 0                 [coord group]
    resolve the handle: a report, or DistributedCheckpointError naming the ranks
    (with a remote tier: hand the committed step to :mod:`.uploads`)
    (with replicas: hand every rank's replication report, and the committed
     step, to the replication thread: see :mod:`.replicas.send`)

A failed exchange (a rank died, hung or fell out of step) leaves the group's
state unknown: the coordinator is then ``broken`` and the writer refuses
every further submit.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import socket
import threading
import time
from typing import Any, Callable

from ..engine.handles import WriteReport
from ..engine.writer import SnapshotWriter
from ..errors import DistributedCheckpointError
from ..files.meta import read_meta
from ..files.ramtier import held
from ..format import fdl, kinds, protocol
from ..state.paths import outline
from .coord import _all_gather_msg, _broadcast_msg, _reason
from .handles import DistributedWriteHandle, DistributedWriteReport, _Item, _settle
from .manifest import MANIFEST_NAME, RAM_MANIFEST_NAME, Manifest, RankFile, _write_manifest
from .pieces import _entry_table

__all__ = ["Coordinator"]

log = logging.getLogger("snapsvc")


class Coordinator:
    """Runs the exchanges of one rank on its own thread (see the module docstring)."""

    def __init__(self, writer: SnapshotWriter, group: Any, root: int, rank: int,
                 world_size: int, coord_timeout: float, write_timeout: float,
                 on_commit: Callable[[DistributedWriteHandle], None] | None = None,
                 replicator: Any = None) -> None:
        self.writer = writer
        # with a remote tier: given each step committed on every rank, in commit order
        self.on_commit = on_commit
        # with replicas: the replication thread (.replicas.Replicator); each exchange
        # carries its report, and hands it every rank's, with the step if committed
        self.replicator = replicator
        self.group = group
        self.root = root
        self.rank = rank
        self.world_size = world_size
        self.coord_timeout = coord_timeout
        self.write_timeout = write_timeout
        self.queue: "queue.Queue[_Item | None]" = queue.Queue()
        self.lock = threading.Lock()
        self.unresolved: dict[int, DistributedWriteHandle] = {}
        self.broken: DistributedCheckpointError | None = None
        self.counts = {"submitted": 0, "committed": 0, "failed": 0}
        self.thread: threading.Thread | None = None
        self.host = socket.gethostname()
        self._seq = 0

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="snapsvc-coordinator",
                                       daemon=True)
        self.thread.start()

    def handle(self, path: str, step: int, file: str) -> DistributedWriteHandle:
        """A new handle, unresolved until its exchange settles it."""
        with self.lock:
            self._seq += 1
            handle = DistributedWriteHandle(self._seq, path, step, self.rank, file,
                                            remote=self.on_commit is not None,
                                            replicas=self.replicator is not None)
            self.unresolved[handle.seq] = handle
        self.counts["submitted"] += 1
        return handle

    def newest_pending(self) -> int | None:
        """The highest step still being coordinated, or None."""
        with self.lock:
            return max((h.step for h in self.unresolved.values()), default=None)

    def stop(self, timeout: float | None) -> bool:
        """Finish what is queued; True if the thread ended within ``timeout``.
        Past it, every handle still unresolved fails."""
        if self.thread is None:
            return True
        self.queue.put(None)
        self.thread.join(timeout)
        if not self.thread.is_alive():
            return True
        with self.lock:
            late = list(self.unresolved.values())
            self.unresolved.clear()
        err = DistributedCheckpointError(
            f"the writer was closed before these checkpoints were coordinated "
            f"(close timeout {timeout} s)")
        for h in late:
            _settle(h, exc=err)
        log.error("snapsvc: %d checkpoint(s) not coordinated within %.1f s: %s",
                  len(late), timeout or 0.0, ", ".join(h.path for h in late))
        return False

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            try:
                self._one(item)
            except BaseException as e:  # never let the thread die silently
                log.exception("snapsvc: coordinating step %d failed", item.step)
                self._fail(item, DistributedCheckpointError(
                    f"step {item.step}: coordination failed on rank {self.rank}: {_reason(e)}",
                    step=item.step, failures={self.rank: _reason(e)}))
                self.broken = self.broken or DistributedCheckpointError(
                    f"coordination failed on rank {self.rank} ({_reason(e)}); this writer "
                    "accepts no more submits", step=item.step)

    def _fail(self, item: _Item, err: DistributedCheckpointError) -> None:
        self.counts["failed"] += 1
        with self.lock:
            self.unresolved.pop(item.handle.seq, None)
        try:   # a step every rank failed to write leaves no empty directory behind
            os.rmdir(item.handle.path)
        except OSError:   # not empty (a rank's files, kept for a post-mortem), or gone already
            pass
        _settle(item.handle, exc=err)
        try:
            item.handle._replicas.set_exception(err)
        except Exception:  # InvalidStateError: resolved already (no replicas)
            pass

    def _local(self, item: _Item) -> tuple[dict[str, Any], WriteReport | None]:
        """This rank's outcome, as sent to the others."""
        out: dict[str, Any] = {"step": item.step, "ok": False, "error": None,
                               "host": self.host, "pid": os.getpid(), "what": item.what,
                               "digests": None}
        if item.error is not None:
            out["error"] = f"submit() raised {_reason(item.error)}"
            return out, None
        if item.tree is not None:   # here, not in submit(): off the training thread
            try:
                item.outline = outline(item.tree)
                # as the metadata packs it: OrderedDicts and the like split off (kinds)
                out["digests"] = item.digests = (
                    _digest("\n".join(item.outline).encode()),
                    _digest(protocol.pack_value(kinds.split({"state": item.tree}))))
            except Exception as e:   # a bug if it happens: this step fails, not the writer
                out["error"] = f"describing its state: {_reason(e)}"
                return out, None
        assert item.handle.local is not None   # submit() set it, or item.error says why not
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
            out["error"] = f"its write was skipped (SnapshotWriter policy {self.writer.policy!r})"
            return out, None
        # a memory-only step's file is its RAM copy
        source = item.handle.file if item.persist else (held(item.handle.file) or item.handle.file)
        try:
            meta = read_meta(source)
        except Exception as e:
            out["error"] = f"reading back its metadata: {_reason(e)}"
            return out, None
        optim, data = ({k: c[k] for k in ("file", "size", "crc32")} if c else None
                       for c in (meta.optimizer, meta.data))
        entries = None
        if item.records is not None:
            try:
                entries = _entry_table(source, item.records,
                                       data["file"] if data else None)
            except Exception as e:
                out["error"] = f"reading back its entry table: {_reason(e)}"
                return out, None
        out.update(ok=True, file=os.path.basename(item.handle.file), size=meta.size,
                   crc32=meta.crc32, optim=optim, entries=entries, data=data)
        return out, report

    def _differences(self, item: _Item) -> dict[int, str]:
        """The ranks whose state's structure differs from rank 0's, and how (a
        second exchange: of the outlines, each a line per leaf)."""
        outlines = _all_gather_msg(item.outline, self.world_size, self.group)
        first, out = set(outlines[0]), {}
        for r, lines in enumerate(outlines[1:], 1):
            extra, lacks = sorted(set(lines) - first), sorted(first - set(lines))
            if extra or lacks:
                out[r] = (f"its state differs from rank 0's: it has {extra[:3]} where rank 0 "
                          f"has {lacks[:3]} (every rank must submit the same keys, with values "
                          "of the same kinds)")
        return out or {0: "the ranks' states have the same leaves in different orders"}

    def _one(self, item: _Item) -> None:
        step = item.step
        if self.broken is not None:
            self._fail(item, DistributedCheckpointError(
                f"step {step}: not coordinated, after an earlier failure: {self.broken}",
                step=step, timed_out=self.broken.timed_out))
            return
        mine, report = self._local(item)
        mine["replicas"] = None if self.replicator is None else self.replicator.report()
        t0 = time.monotonic()
        try:
            gathered = _all_gather_msg(mine, self.world_size, self.group)
        except Exception as e:
            self.broken = DistributedCheckpointError(
                f"step {step}: exchanging write results with the other ranks failed "
                f"(coord_timeout={self.coord_timeout:g} s): {_reason(e)}; a rank died, hung or "
                "fell out of step, so no manifest was written. This writer accepts no more "
                "submits.", step=step, timed_out=True)
            self._fail(item, self.broken)
            return
        failures = {r: g["error"] for r, g in enumerate(gathered) if not g["ok"]}
        steps = [g["step"] for g in gathered]
        if len(set(steps)) > 1:
            failures = {r: f"submitted step {s} (ranks out of step: every rank must submit the "
                        "same steps in the same order)" for r, s in enumerate(steps)}
        elif not failures and len({g["what"] for g in gathered}) > 1:
            failures = {r: f"submitted a {g['what']} (every rank must submit the same kind)"
                        for r, g in enumerate(gathered)}
        elif not failures and len({g["digests"][0] for g in gathered if g["digests"]}) > 1:
            # the same condition on every rank: each holds every digest
            try:
                failures = self._differences(item)
            except Exception as e:
                self.broken = DistributedCheckpointError(
                    f"step {step}: exchanging state outlines with the other ranks failed "
                    f"(coord_timeout={self.coord_timeout:g} s): {_reason(e)}. This writer "
                    "accepts no more submits.", step=step, timed_out=True)
                self._fail(item, self.broken)
                return
        if item.sharded is not None and "state" in item.sharded:
            differs = [r for r, g in enumerate(gathered) if g["digests"] != gathered[0]["digests"]]
            item.sharded["state"]["differs"] = differs
        decision: list[Any] = [False, None]
        if self.rank == 0 and not failures:
            try:
                manifest = Manifest(
                    step=step, world_size=self.world_size,
                    ranks=[RankFile(r, g["file"], g["size"], g["crc32"], g["optim"], g["entries"],
                                    g["data"])
                           for r, g in enumerate(gathered)],
                    format_version=fdl.VERSION,
                    epoch=None if item.epoch is None else int(item.epoch),
                    metrics={str(k): float(v) for k, v in (item.metrics or {}).items()},
                    sharded=item.sharded)
                _write_manifest(item.handle.path, manifest,
                                MANIFEST_NAME if item.persist else RAM_MANIFEST_NAME)
                decision = [True, None]
            except Exception as e:
                decision = [False, f"writing the manifest on rank 0: {_reason(e)}"]
        committed_here = decision[0]
        agreed = True   # every rank knows the decision
        try:
            decision = _broadcast_msg(decision, self.root, self.group)
        except Exception as e:
            self.broken = DistributedCheckpointError(
                f"step {step}: the commit decision did not arrive from rank 0 "
                f"(coord_timeout={self.coord_timeout:g} s): {_reason(e)}. This writer accepts "
                "no more submits.", step=step, timed_out=True)
            if not committed_here:
                self._fail(item, DistributedCheckpointError(
                    f"{self.broken} The checkpoint may or may not be complete: "
                    "latest_checkpoint() decides.", step=step, timed_out=True))
                return
            log.warning("%s (the manifest is committed; this rank reports success)", self.broken)
            decision, agreed = [True, None], False
        coord_s = time.monotonic() - t0
        committed = decision[0] and agreed
        if self.replicator is not None:   # every step, persisted or not
            self.replicator.add(item.handle if committed else None,
                                [g.get("replicas") for g in gathered])
            if decision[0] and not agreed:
                try:
                    item.handle._replicas.set_exception(DistributedCheckpointError(
                        f"not replicated: {self.broken}", step=step))
                except Exception:  # InvalidStateError
                    pass
        if not decision[0]:
            if decision[1] is not None:
                failures = {0: decision[1]}
            detail = "; ".join(f"rank {r}: {why}" for r, why in sorted(failures.items()))
            self._fail(item, DistributedCheckpointError(
                f"step {step} not committed (no manifest) because of rank(s) "
                f"{sorted(failures)}: {detail}", step=step, failures=failures))
            return
        if self.on_commit is not None and item.persist:
            if agreed:
                self.on_commit(item.handle)
            else:
                item.handle.fail_upload(f"not uploaded: {self.broken}")
        elif self.on_commit is not None:
            item.handle.fail_upload("not uploaded: a memory-only step (persist=False)")
        total = sum(g["size"] + sum(c["size"] for c in (g["optim"], g["data"]) if c)
                    for g in gathered)
        self.counts["committed"] += 1
        with self.lock:
            self.unresolved.pop(item.handle.seq, None)
        assert report is not None   # committed: this rank's write reported durable
        _settle(item.handle, DistributedWriteReport(
            path=item.handle.path, bytes=report.bytes, entries=report.entries,
            stage_s=item.stage_s, slot_wait_s=report.slot_wait_s, queue_s=report.queue_s,
            encode_s=report.encode_s,
            write_s=report.write_s, fsync_s=report.fsync_s,
            total_s=time.monotonic() - item.started, seq=item.handle.seq, step=step,
            file=item.handle.file, manifest=os.path.join(
                item.handle.path, MANIFEST_NAME if item.persist else RAM_MANIFEST_NAME),
            rank=self.rank, world_size=self.world_size, total_bytes=total, coord_s=coord_s))


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()

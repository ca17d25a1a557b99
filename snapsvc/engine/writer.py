"""``SnapshotWriter``: the trainer's side of the checkpoint sidecar.

Data flow between the two processes::

    trainer process                                   writer process (snapsvc.writer)
    ---------------                                   -------------------------------
    submit(model or state, path)
      | check values, pack metadata body (protocol)
      | pick slot k of the layout's pool (pools.py; policy block/skip/latest)
      | copy tensors ---> slot k (copier.py) ======= one shared-memory mapping per slot ======
      |   (a model's cached plan: one torch.cat     (sent once: {SLOT k, layout} + handle;
      |    per dtype group of the slot)              the writer builds its fdl.Encoder)
      | claim[k] = seq
      | req pipe: {WRITE seq, k, path, body} --->  claim k (or skip if superseded)
      v return WriteHandle                         encode .fdl(.gz) from slot k
                                                   temp file -> fsync -> rename -> .meta
    reader thread (sidecar.py) <--- rep pipe: {DONE seq, ok | error, bytes, timings}
      resolve handle; slot k free again
      writer sentinel fires -> BrokenWriterError on every pending handle

Who owns what::

    client.py   SnapshotWriter: pending writes, handles, policies, close   _lock (_cond)
    sidecar.py  Sidecar: the process, pipes, handshake, reader thread      _send_lock
    pools.py    SlotPools: slots per layout, copy plans, memory budget     the writer's _lock
    copier.py   Copier: blocking copy, overlap thread, CUDA stream         its own _lock

Locking. ``_cond`` (one lock) guards every piece of shared state: pending
writes, slots, pools and plans, the broken/closing flags and the counters.
``_life`` serializes starting, restarting and stopping the sidecar; it may
be taken before ``_cond``, never after. No lock is held while tensors are
copied, while waiting for the sidecar to start, or while a handle's
callbacks run. Every wait ends on close, on the sidecar's death, or at a
timeout. All public methods are safe to call from any thread.

Messages are msgpack written synchronously with ``send_bytes``, so a submit
that returned has its message in the kernel's pipe buffer: a SIGKILL of the
trainer cannot lose it, and the writer drains the pipe before it exits.
Reports come back in submit order because the writer works in order.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.multiprocessing as tmp
from torch import nn

from ..errors import BrokenWriterError, EncodeError, PathError, WriteFailedError
from ..files.checkpoint import layout_hash, persistent_buffers
from ..files.durable import check_final_name, remove_stale_temps
from ..files.meta import meta_path
from ..format import fdl, protocol
from ..format.layout import Layout
from ..state.resume import optimizer_state
from ..state.tree import check_plain, flatten
from .copier import Copier
from .pools import RESERVED, Plan, Pool, Slot, SlotPools, walk
from .sidecar import Sidecar, describe
from .snapshot import ModelSnapshot, as_metrics
from .worker import REVOKED

__all__ = ["SnapshotWriter", "WriteHandle", "WriteReport", "POLICIES"]

log = logging.getLogger("snapsvc")

POLICIES = ("block", "skip", "latest")
_META_ROOM = 64 << 10   # what the sidecar adds to a submit's metadata: sizes, CRCs, names
_live: "weakref.WeakSet[SnapshotWriter]" = weakref.WeakSet()


@dataclass
class WriteReport:
    """How one submitted snapshot went. Times are seconds."""

    path: str
    bytes: int = 0          # file size on disk
    entries: int = 0
    skipped: bool = False   # policy "skip" found no slot, or "latest" replaced it
    stage_s: float = 0.0    # submit(): the training loop's stall
    queue_s: float = 0.0    # message sent -> writer starts
    encode_s: float = 0.0   # encoding and compression
    write_s: float = 0.0    # in the OS's write calls
    fsync_s: float = 0.0    # fsyncs of file, metadata and directory
    total_s: float = 0.0    # submit() called -> report received
    seq: int = 0


class WriteHandle:
    """A pending write, like a ``concurrent.futures.Future`` of a :class:`WriteReport`."""

    def __init__(self, seq: int, path: str) -> None:
        self.seq = seq
        self.path = path
        self._future: Future[WriteReport] = Future()

    def result(self, timeout: float | None = None) -> WriteReport:
        """The report; raises the write's error, or ``TimeoutError`` after ``timeout``."""
        return self._future.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    def done(self) -> bool:
        return self._future.done()

    def add_done_callback(self, fn: Callable[["WriteHandle"], Any]) -> None:
        """Call ``fn(handle)`` when done (at once if already done)."""
        self._future.add_done_callback(lambda _f: fn(self))

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<WriteHandle seq={self.seq} {self.path!r} {state}>"


@dataclass
class _Pending:
    handle: WriteHandle
    slot: Slot
    started: float
    stage_s: float
    gen: int


@dataclass
class _What:
    """What one submit copies. A model without an optimizer is only walked
    here; its sources come from its cached plan, or are listed under the lock."""

    sources: list[torch.Tensor] = field(default_factory=list)
    key: tuple = ()
    layout: Callable[[], Layout] | None = None
    pin: bool = False
    optim: dict[str, Any] | None = None
    tree: Any = None
    model: nn.Module | None = None
    walked: list[torch.Tensor | None] | None = None


def _what(params: list[tuple[str, torch.Tensor]], buffers: list[tuple[str, torch.Tensor]],
          optim: list[tuple[str, torch.Tensor]] = (),  # type: ignore[assignment]
          state: list[tuple[str, str, torch.Tensor]] = (),  # type: ignore[assignment]
          structural_hash: str | None = None) -> _What:
    model_pairs = [*params, *buffers, *((n, t) for _, n, t in state)]
    # Refused whatever pool a same-shaped snapshot made before; the optimizer
    # state is a file of its own. The sidecar's encoder runs the same check.
    fdl.check_entries(model_pairs)
    fdl.check_entries(list(optim))
    pairs = [*model_pairs, *optim]
    pin = torch.cuda.is_available() and any(t.is_cuda for _, t in pairs)
    key = (len(params), len(buffers), len(optim), pin, tuple(k for k, _, _ in state),
           tuple((n, t.shape, t.dtype) for n, t in pairs))
    h = layout_hash(params, buffers) if structural_hash is None else structural_hash
    return _What([t for _, t in pairs], key,
                 lambda: Layout.of(params, buffers, h, optim, state), pin)


class SnapshotWriter:
    """Owns one writer sidecar process and the shared-memory slots it reads.

    ``directory``: base for relative paths (created if missing); directories
    inside a path are created at submit. ``slots``: snapshots in flight per
    layout (memory is ``slots x snapshot bytes``); pools of layouts the last
    submit did not use are freed once idle, and ``max_slot_bytes`` caps all
    slots together. ``policy`` when every slot is busy: ``"block"`` waits
    (up to submit's ``timeout``), ``"skip"`` drops this snapshot,
    ``"latest"`` replaces the newest queued, unstarted one.
    ``keep_last``: per directory, keep the newest N files of each series this
    writer wrote, a series being the names that differ only in their digits
    (``step100.fdl``, ``step200.fdl``); ``best.fdl`` is a series of its own.
    ``compress_level``: isal gzip level for ``.gz`` paths. ``restart``: a
    dead sidecar is restarted by the next submit. ``drain_timeout``: how
    long an interpreter exit without :meth:`close` waits for queued writes.
    ``sigterm``: turn SIGTERM (when its handler is still the default) into
    ``SystemExit`` so ``with`` blocks and the exit drain run; the handler is
    put back when the last writer closes. ``overlap``: submit() returns once
    the copy is enqueued (see :mod:`snapsvc.copier`); pair it with
    :meth:`guard`. The WRITE message then leaves after the copy, so a trainer
    SIGKILLed in that window loses that snapshot, which blocking mode never
    does. ``incremental``: a model's submit copies into a slot only the
    tensors changed since that slot last held them (``_version`` and storage
    pointer); opt-in, because a write through ``p.data`` does not bump
    ``_version`` and is missed; ``"check"`` verifies every skipped tensor and
    logs any such miss (see :mod:`snapsvc.copier`). ``stats()["staged_bytes"]``
    counts what was copied. ``nice``: added to the sidecar's nice value. ``fault_hook``: for
    tests, a picklable ``hook(stage, path)`` run inside the sidecar (see
    :func:`snapsvc.durable.set_fault_hook`).

    Every public method may be called from any thread.
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None, *, slots: int = 2,
                 policy: str = "block", keep_last: int | None = None,
                 compress_level: int | None = None, start_method: str = "spawn",
                 restart: bool = True, drain_timeout: float = 60.0, sigterm: bool = True,
                 overlap: bool = False, incremental: bool | str = False, nice: int = 10,
                 max_slot_bytes: int | None = None,
                 fault_hook: Callable[[str, str], None] | None = None) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        if compress_level is not None and not 0 <= compress_level <= 3:
            raise ValueError(f"compress_level must be 0..3 (isal's levels), got {compress_level}")
        if not 0 <= nice <= 19:
            raise ValueError(f"nice must be 0..19, got {nice}")
        if incremental not in (False, True, "check"):
            raise ValueError(f"incremental must be False, True or 'check', got {incremental!r}")
        if max_slot_bytes is not None and max_slot_bytes < 1:
            raise ValueError(f"max_slot_bytes must be >= 1 or None, got {max_slot_bytes}")
        self.directory = os.path.abspath(directory) if directory is not None else None
        self.slots = slots
        self.policy = policy
        self.restart = restart
        self.drain_timeout = drain_timeout
        self.overlap = overlap
        self.sigterm = sigterm
        options = {"keep_last": keep_last, "compress_level": compress_level, "nice": nice,
                   "fault_hook": fault_hook}
        self._cond = threading.Condition(threading.Lock())
        self._life = threading.Lock()
        self._sidecar = Sidecar(tmp.get_context(start_method), options, self._on_report,
                                self._on_exit)
        self._pools = SlotPools(slots, max_slot_bytes)
        self._copier = Copier(overlap, incremental)
        self._pending: dict[int, _Pending] = {}
        self._dirs: set[str] = set()
        self._seq = 0
        self._active = 0          # submits past the open check, not yet queued or failed
        self._broken: BrokenWriterError | None = None
        self._closing = False
        self._closed = False
        self._counts = {"submitted": 0, "written": 0, "skipped": 0, "failed": 0,
                        "broken": 0, "restarts": 0, "bytes": 0, "staged_bytes": 0}
        self._stalls: deque[float] = deque(maxlen=10_000)

    # -- lifecycle -------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        """The sidecar's process id (None before start)."""
        return self._sidecar.pid

    def __enter__(self) -> "SnapshotWriter":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> "SnapshotWriter":
        """Launch the sidecar; return once it has confirmed it is ready."""
        self._ensure_running()
        return self

    def _check_open(self) -> None:
        """Raise if closing (cond held)."""
        if self._closing or self._closed:
            raise RuntimeError("this SnapshotWriter is closed; make a new one")

    def _ensure_running(self) -> None:
        """Start the sidecar, or restart a dead one; one thread at a time."""
        with self._life:
            with self._cond:
                self._check_open()
                broken, started = self._broken, self._sidecar.proc is not None
            if started and broken is None and self._sidecar.exited():
                # Died with nothing pending, and the reader has not said so yet:
                # let it, rather than queue this snapshot to a dead process.
                self._sidecar.join_reader(5)
                with self._cond:
                    broken = self._broken
            if started and broken is None:
                return
            if broken is not None:
                if not self.restart:
                    raise broken
                self._copier.wait()  # the copier drops what it held for the dead writer first
                self._sidecar.reap()
                log.warning("restarting the writer sidecar after: %s", broken)
            with self._cond:
                dirs = set(self._dirs)
            if self.directory is not None:
                os.makedirs(self.directory, exist_ok=True)
                dirs.add(self.directory)
            for d in dirs:
                for path in remove_stale_temps(d):
                    log.warning("removed %s left by a dead writer", path)
            self._sidecar.start()
            with self._cond:
                self._broken = None
                if broken is not None:
                    self._counts["restarts"] += 1
                if self.directory is not None:
                    self._dirs.add(self.directory)
                self._cond.notify_all()
            _live.add(self)
            if self.sigterm:
                _exit_on_sigterm()

    def finish(self, timeout: float | None = None) -> None:
        """Wait for every queued snapshot to be written, then stop the sidecar.

        New submits are refused from the start; submits already copying are
        waited for. After ``timeout`` seconds the sidecar is killed; the
        snapshots it had not written are logged by path and their handles fail.
        """
        self._not_from_reader("finish")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._life:
            with self._cond:
                if self._closed:
                    return
                self._closing = True
                self._cond.notify_all()  # submits waiting for a slot give up
                while (self._pending or self._active) and self._broken is None:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    self._cond.wait(0.5 if left is None else min(left, 0.5))
                late = [p.handle.path for p in self._pending.values()]
            if late:
                log.error("snapsvc: %d snapshot(s) not written within %.1f s: %s",
                          len(late), timeout, ", ".join(late))
            self._copier.shutdown()  # overlap copies finish (memcpy) before STOP goes out
            if self._sidecar.proc is not None:
                self._sidecar.send(protocol.pack(protocol.STOP))
                left = None if deadline is None else max(0.1, deadline - time.monotonic())
                if not self._sidecar.wait_exit(left):
                    self._sidecar.kill()
                self._sidecar.reap()
            with self._cond:
                self._closed = True
                if not self._active:  # else the last submit still copying releases them
                    self._pools.clear()
            _live.discard(self)
            _restore_sigterm()

    close = finish

    # -- submit ----------------------------------------------------------------
    def submit(self, model_or_state: nn.Module | Mapping[Any, Any] | ModelSnapshot,
               path: str | os.PathLike[str], *, metrics: Mapping[str, float] | None = None,
               epoch: int | None = None, optimizer: torch.optim.Optimizer | None = None,
               extra: Any = None, timeout: float | None = None) -> WriteHandle:
        """Stage a snapshot into a slot and queue it; return once the copy is done.

        ``model_or_state`` is a model, a :class:`ModelSnapshot`, or a mapping
        of training state (models, optimizers, schedulers, tensors, nested
        containers, plain values: see :mod:`snapsvc.state`). After this
        returns the inputs may change freely: the file holds the values of
        this moment. With a model, ``optimizer`` captures its state in the
        same copy, written beside the model (see :mod:`snapsvc.resume`), and
        ``extra`` is plain data (dicts, lists, tuples, str, bytes, numbers)
        stored in the metadata. ``timeout``: how long policy ``"block"`` may
        wait for a free slot (``TimeoutError``). Everything that can be
        refused is refused before a slot is taken.
        """
        started = time.monotonic()
        self._not_from_reader("submit")
        path = self._resolve(path)
        extra = check_plain(extra, "extra")
        if isinstance(model_or_state, ModelSnapshot):
            metrics = model_or_state.metrics if metrics is None else metrics
            epoch = model_or_state.epoch if epoch is None else epoch
        metrics, epoch = as_metrics(metrics), _check_epoch(epoch)
        what = self._what(model_or_state, optimizer, extra)
        self._ensure_running()
        with self._cond:
            self._check_open()
            pool, gone, sources, plan = self._pool(what)
            pool.users += 1  # not trimmed while this submit uses it
            self._active += 1
            self._counts["submitted"] += 1
        try:
            if gone:  # the sidecar unmaps them; their memory is freed on both sides
                self._sidecar.send(protocol.pack(protocol.FREE, slots=[s.id for s in gone]))
            body = _pack_body(path, pool[0].buffer_bytes, epoch=epoch, metrics=metrics,
                              extra=extra, optim=what.optim, state=what.tree)
            return self._stage_and_queue(pool, sources, plan, path, body, started, timeout)
        finally:
            with self._cond:
                self._active -= 1
                pool.users -= 1
                if self._closed and not self._active:  # close() timed out while we copied
                    self._pools.clear()
                self._cond.notify_all()

    def _what(self, obj: Any, optimizer: torch.optim.Optimizer | None, extra: Any) -> _What:
        if isinstance(obj, ModelSnapshot):
            if optimizer is not None:
                raise TypeError("optimizer= needs the model itself, not a ModelSnapshot")
            return _what(list(obj.params.items()), list(obj.buffers.items()))
        if isinstance(obj, nn.Module):
            if optimizer is None:
                return _What(model=obj, walked=walk(obj))
            params, buffers = list(obj.named_parameters()), list(persistent_buffers(obj))
            optim, info = optimizer_state(optimizer, {id(p): n for n, p in params})
            what = _what(params, buffers, optim)
            what.optim = info
            return what
        if isinstance(obj, Mapping):
            if optimizer is not None or extra is not None:
                raise TypeError("with a state mapping, put optimizers and extra values "
                                "inside the mapping")
            flat = flatten(obj)
            what = _what(flat.params, flat.buffers, state=flat.rest,
                         structural_hash=flat.structural_hash)
            what.tree = flat.tree
            return what
        raise TypeError(f"submit() takes an nn.Module, a state Mapping or a ModelSnapshot, "
                        f"not {type(obj).__name__}")

    def _pool(self, what: _What) -> tuple[Pool, list[Slot], list[torch.Tensor], Plan | None]:
        """(pool, slots released as idle, copy sources, the model's cached plan
        if they come from one) for ``what`` (cond held).

        A model's plan is looked up and made here, under the lock, so two
        threads submitting the same model share one plan and one pool.
        """
        if what.model is None:
            pool, gone = self._pools.pool(what.key, what.layout, what.pin)
            return pool, gone, what.sources, None
        plan = self._pools.plan(what.model, what.walked)
        if plan is not None:
            return plan.pool, self._pools.use(plan.pool), plan.sources, plan
        params = list(what.model.named_parameters())
        full = _what(params, list(persistent_buffers(what.model)))
        pool, gone = self._pools.pool(full.key, full.layout, full.pin)
        plan = Plan.make(what.walked, full.sources, pool)
        self._pools.remember(what.model, plan)
        return pool, gone, full.sources, plan

    def _stage_and_queue(self, pool: Pool, sources: list[torch.Tensor], plan: Plan | None, path: str,
                         body: bytes, started: float, timeout: float | None) -> WriteHandle:
        gen = self._register(pool, timeout)
        slot = self._acquire(pool, timeout)
        if slot is None:
            return self._skipped(path, started)
        try:
            slot.copying = self.overlap
            rest, copied = self._copier.stage(slot, sources, plan)
        except BaseException:
            self._free(slot)
            raise
        stage_s = time.monotonic() - started
        with self._cond:
            self._counts["staged_bytes"] += copied
            self._stalls.append(stage_s)
            if self._broken is not None or self._sidecar.gen != gen or self._closed:
                # died (or was restarted, or closed at its timeout) while we copied:
                # nobody would resolve it, and the slot may hold half a copy
                slot.seq = None
                slot.copying = False
                slot.held = None
                self._cond.notify_all()
                raise self._broken or BrokenWriterError(
                    "the writer sidecar stopped while this snapshot was copied; submit again")
            self._seq += 1
            seq = self._seq
            handle = WriteHandle(seq, path)
            slot.seq = seq
            self._pending[seq] = _Pending(handle, slot, started, stage_s, gen)
        msg = {"path": path, "body": body}
        if rest is None:
            self._dispatch(slot, seq, msg)
        else:
            self._copier.later(self._finish_copy, rest, slot, seq, msg)
        return handle

    def _not_from_reader(self, what: str) -> None:
        if threading.current_thread() is self._sidecar.reader:
            raise RuntimeError(f"{what}() from a done-callback would deadlock: callbacks run on "
                               "the thread that delivers reports; hand the work to another thread")

    def _free(self, slot: Slot) -> None:
        """Give back a slot whose copy did not complete (its contents are unknown)."""
        with self._cond:
            slot.seq = None
            slot.copying = False
            slot.held = None
            self._cond.notify_all()

    def _dispatch(self, slot: Slot, seq: int, msg: dict[str, Any]) -> None:
        """The slot holds the snapshot: let the writer claim it, then tell it.

        If the sidecar is gone (dead, or reaped by a close that timed out),
        the handle fails here, unless the reader thread already failed it.
        """
        lock = self._sidecar.claim_lock
        if lock is not None:
            with lock:
                slot.claim.fill_(seq)
            if self._sidecar.send(protocol.pack(protocol.WRITE, seq=seq, slot=slot.id,
                                                sent_at=time.monotonic(), **msg)):
                return
        with self._cond:
            p = self._pending.pop(seq, None)
            if p is not None:
                slot.seq = None
                self._counts["broken"] += 1
                self._cond.notify_all()
            err = self._broken or BrokenWriterError(
                "the writer sidecar is gone (closed or dead); this snapshot was not written")
        if p is not None:
            p.handle._future.set_exception(err)

    def _finish_copy(self, rest: Callable[[], None], slot: Slot, seq: int,
                     msg: dict[str, Any]) -> None:
        """Overlap mode, on the copier thread: complete the copy, then dispatch."""
        try:
            rest()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's handle
            with self._cond:
                p = self._pending.pop(seq, None)
                if p is not None:
                    self._counts["failed"] += 1
            self._free(slot)
            if p is not None:
                p.handle._future.set_exception(e)
            return
        with self._cond:
            slot.copying = False
            p = self._pending.get(seq)
            if p is None or p.gen != self._sidecar.gen:  # the writer died; handle failed
                slot.seq = None
                self._cond.notify_all()
                return
            self._cond.notify_all()
        self._dispatch(slot, seq, msg)

    def wait_staged(self, timeout: float | None = None) -> None:
        """Overlap mode: block until every snapshot's copy has finished."""
        self._copier.wait(timeout)

    def guard(self, optimizer: torch.optim.Optimizer) -> Any:
        """Make ``optimizer.step()`` wait for in-flight snapshot copies (overlap mode).

        Registers an optimizer step pre-hook and returns its removable
        handle. On CPU the hook blocks until the background copy is done; on
        CUDA it makes the current stream wait on the copy's event, so the CPU
        never blocks. Without it, overlap mode may write a snapshot that mixes
        two steps.
        """
        return self._copier.guard(optimizer)

    def wait_path(self, path: str | os.PathLike[str], timeout: float | None = None) -> None:
        """Wait until no write to ``path`` is pending (its outcome is on its handle).

        ``TimeoutError`` after ``timeout`` seconds. For callers about to
        remove or read that checkpoint.
        """
        path = self._resolve(path, create=False)
        self._wait_until(lambda: not any(p.handle.path == path
                                         for p in self._pending.values()),
                         timeout, f"a write to {path} is still pending")

    def _wait_until(self, ready: Callable[[], bool], timeout: float | None, what: str) -> None:
        """Wait on ``_cond`` for ``ready()``; the sidecar's death ends it too."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not ready():
                if self._broken is not None:
                    return
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"{what} after {timeout} s")
                self._cond.wait(0.5 if left is None else min(left, 0.5))

    def _resolve(self, path: str | os.PathLike[str], create: bool = True) -> str:
        raw = os.fspath(path)
        name = os.path.basename(raw)
        if not raw or raw.endswith(os.sep) or name in ("", ".", ".."):
            raise PathError(f"checkpoint path {raw!r} names a directory; give a file name")
        if self.directory is not None and not os.path.isabs(raw):
            raw = os.path.join(self.directory, raw)
        full = os.path.abspath(raw)
        try:
            full.encode("utf-8")  # it travels in a msgpack str; refuse it before taking a slot
        except UnicodeEncodeError:
            raise PathError(f"checkpoint path {full!r} is not valid UTF-8") from None
        if os.path.isdir(full):
            raise PathError(f"checkpoint path {full!r} is a directory; give a file name")
        check_final_name(meta_path(full))  # the longest name derived from it
        directory = os.path.dirname(full)
        if create:
            with self._cond:
                known = directory in self._dirs
            if not known:
                os.makedirs(directory, exist_ok=True)
                with self._cond:
                    self._dirs.add(directory)
        return full

    def _skipped(self, path: str, started: float) -> WriteHandle:
        stall = time.monotonic() - started
        with self._cond:
            self._seq += 1
            handle = WriteHandle(self._seq, path)
            self._counts["skipped"] += 1
            self._stalls.append(stall)
        handle._future.set_result(WriteReport(path=path, skipped=True, stage_s=stall,
                                              total_s=stall, seq=handle.seq))
        return handle

    def _acquire(self, pool: list[Slot], timeout: float | None) -> Slot | None:
        """A free slot of ``pool``, reserved for the caller, by the policy."""
        deadline = None if timeout is None else time.monotonic() + timeout
        revoked = None
        with self._cond:
            while True:
                if self._broken is not None:
                    raise self._broken
                self._check_open()
                slot = next((s for s in pool if s.seq is None and not s.copying), None)
                if slot is None and self.policy == "latest":
                    slot, revoked = self._revoke_newest(pool)
                if slot is not None:
                    slot.seq = RESERVED
                    break
                if self.policy == "skip":
                    return None
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"no free slot within {timeout} s: {len(pool)} "
                                       "snapshots of this layout are still being written")
                self._cond.wait(0.5 if left is None else min(left, 0.5))
        if revoked is not None:
            revoked.handle._future.set_result(WriteReport(
                path=revoked.handle.path, skipped=True, stage_s=revoked.stage_s,
                total_s=time.monotonic() - revoked.started, seq=revoked.handle.seq))
        return slot

    def _revoke_newest(self, pool: list[Slot]) -> tuple[Slot | None, _Pending | None]:
        """Take back the newest queued, unstarted snapshot's slot (cond held)."""
        for slot in sorted((s for s in pool if s.seq), key=lambda s: s.seq, reverse=True):
            if slot.copying:
                continue
            with self._sidecar.claim_lock:
                if int(slot.claim.item()) != slot.seq:
                    continue  # the writer already started it
                slot.claim.fill_(REVOKED)
            old = self._pending.pop(slot.seq)
            self._counts["skipped"] += 1
            return slot, old
        return None, None

    def _register(self, pool: list[Slot], timeout: float | None) -> int:
        """Hand a pool's shared memory to the current sidecar, once per generation.

        All slots at once, while the sidecar is likely idle: it maps them in
        queue order, so a slot registered later would wait behind writes.
        """
        with self._cond:
            gen = self._sidecar.gen
            todo = [s for s in pool if s.gen != gen and s.registering != gen]
            for slot in todo:
                slot.registering = gen  # another thread submitting it now waits instead
        for slot in todo:
            if not self._sidecar.send(protocol.pack(protocol.SLOT, slot=slot.id,
                                                    layout=slot.layout.to_msg()), slot.flat):
                self._sidecar.join_reader(5)  # it sees the death and sets _broken
                break
        # Wait until the writer has mapped them: until then their fds live only
        # in this process, and a submit must not depend on it staying alive.
        self._wait_until(lambda: all(s.gen == gen for s in pool) or self._closed
                         or self._sidecar.gen != gen, timeout,
                         "the writer sidecar has not mapped the slots")
        with self._cond:
            if self._broken is not None:
                raise self._broken
            if self._sidecar.gen != gen or self._closed:
                raise BrokenWriterError("the writer sidecar restarted or closed while this "
                                        "submit handed it its slots; submit again")
        return gen

    # -- reports (on the reader thread) ----------------------------------------
    def _on_report(self, gen: int, msg: dict[str, Any]) -> None:
        op = msg["op"]
        if op == protocol.SLOT_OK:
            with self._cond:
                slot = self._pools.by_id(msg["slot"])
                if slot is not None:
                    slot.gen = gen
                self._cond.notify_all()
            return
        if op != protocol.DONE:
            log.error("unexpected message from the writer: %r", op)
            return
        with self._cond:
            p = self._pending.pop(msg["seq"], None)
            if p is None:  # superseded under "latest": already resolved at submit
                return
            p.slot.seq = None
            ok = msg["ok"]
            skipped = ok and msg.get("superseded", False)
            self._counts["skipped" if skipped else "written" if ok else "failed"] += 1
            self._counts["bytes"] += msg.get("bytes", 0) if ok else 0
            self._cond.notify_all()
        if ok:
            p.handle._future.set_result(WriteReport(
                path=msg["path"], bytes=msg.get("bytes", 0), entries=msg.get("entries", 0),
                skipped=skipped, stage_s=p.stage_s, queue_s=msg["queue_s"],
                encode_s=msg.get("encode_s", 0.0), write_s=msg.get("write_s", 0.0),
                fsync_s=msg.get("fsync_s", 0.0), total_s=time.monotonic() - p.started,
                seq=msg["seq"]))
        else:
            p.handle._future.set_exception(WriteFailedError(
                msg["errno"] or 0, f"{msg['error']} (writing checkpoint)", msg["filename"]))

    def _on_exit(self, gen: int, proc: Any) -> None:
        with self._cond:
            failed = [p for p in self._pending.values() if p.gen == gen]
            orderly = self._closing or self._closed  # any other exit is a death
            err = BrokenWriterError(f"the writer sidecar {describe(proc)}; "
                                    f"{len(failed)} pending write(s) lost to it")
            if (not orderly or failed) and gen == self._sidecar.gen:
                self._broken = err
            for p in failed:
                del self._pending[p.handle.seq]
                if not p.slot.copying:  # else the copier frees it when done
                    p.slot.seq = None
            self._counts["broken"] += len(failed)
            self._cond.notify_all()
        if failed:
            log.error("%s: %s", err, ", ".join(p.handle.path for p in failed))
        for p in failed:
            p.handle._future.set_exception(err)

    # -- figures ---------------------------------------------------------------
    def is_idle(self) -> bool:
        """True when no snapshot is queued, being copied or being written."""
        with self._cond:
            return not self._pending and not self._active

    def stats(self) -> dict[str, Any]:
        """Running figures: counts, bytes written, restarts, slot memory and submit() stalls."""
        with self._cond:
            stalls = sorted(self._stalls)
            counts = dict(self._counts)
            pending = len(self._pending)
            slot_bytes = self._pools.nbytes
            slot_count = sum(1 for _ in self._pools)

        def pct(q: float) -> float:
            return stalls[min(len(stalls) - 1, int(q * len(stalls)))] if stalls else 0.0

        return {**counts, "pending": pending, "slot_bytes": slot_bytes, "slots": slot_count,
                "stall_p50_s": pct(0.50), "stall_p99_s": pct(0.99),
                "stall_max_s": stalls[-1] if stalls else 0.0, "pid": self.pid}


def _check_epoch(epoch: int | None) -> int:
    epoch = int(epoch or 0)
    if not -(1 << 63) <= epoch < (1 << 63):
        raise EncodeError(f"epoch {epoch} does not fit in int64")
    return epoch


def _pack_body(path: str, reserved: int, **values: Any) -> bytes:
    """The WRITE message's metadata values, packed once, before a slot is taken.

    Packed by the function the sidecar and the reader unpack with, and held
    to the reader's size limit (less room for what the sidecar adds: sizes,
    checksums and the buffer names), so a value accepted here is one that
    can be written and read back. ``reserved``: bytes the sidecar adds.
    """
    try:
        body = protocol.pack_value(values)
    except (TypeError, ValueError, OverflowError) as e:  # checked already: a bug if it happens
        raise EncodeError(f"{path}: the metadata cannot be packed ({e})") from None
    room = protocol.MAX_METADATA - _META_ROOM - reserved
    if len(body) > room:
        raise EncodeError(f"{path}: metrics, extra values and state tree take {len(body)} "
                          f"bytes of metadata; the limit is {room} (snapsvc.protocol."
                          "MAX_METADATA): keep large data in tensors")
    return body


def _sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _exit_on_sigterm() -> None:
    """Make SIGTERM unwind like an exception, so pending writes drain (main thread only)."""
    if threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _sigterm)


def _restore_sigterm() -> None:
    """Put SIGTERM's default back once no writer is left (main thread only)."""
    if not _live and threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGTERM) is _sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@atexit.register
def _close_at_exit() -> None:
    """An interpreter that exits without close(): let each sidecar drain, bounded."""
    for w in list(_live):
        try:
            w.finish(timeout=w.drain_timeout)
        except Exception:  # never block interpreter exit on a checkpoint
            log.exception("closing a snapsvc writer at exit failed")

"""``SnapshotWriter``: the trainer's side of the checkpoint sidecar.

Data flow between the two processes::

    trainer process                                   writer process (snapsvc.writer)
    ---------------                                   -------------------------------
    submit(model, path)
      | pick slot k (policy block/skip/latest)
      | copy params+buffers ---> slot k  ====== one shared-memory mapping per slot ======
      | claim[k] = seq                             (sent once: {SLOT k, layout} + handle)
      | req pipe: {WRITE seq, k, path, ...} ---->  claim k (or skip if superseded)
      v return WriteHandle                         encode .fdl(.gz) from slot k
                                                   temp file -> fsync -> rename -> .meta
    reader thread  <---- rep pipe: {DONE seq, ok | error, bytes, timings}
      resolve handle; slot k free again
      writer sentinel fires -> BrokenWriterError on every pending handle

Messages are msgpack written synchronously with ``send_bytes``, so a submit
that returned has its message in the kernel's pipe buffer: a SIGKILL of the
trainer cannot lose it, and the writer drains the pipe before it exits.
Reports come back in submit order because the writer works in order.
"""

from __future__ import annotations

import atexit
import functools
import logging
import operator
import os
import signal
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any, Callable, Mapping

import torch
import torch.multiprocessing as tmp
from torch import nn

from . import protocol, staging
from .checkpoint import layout_hash, persistent_buffers
from .durable import remove_stale_temps
from .errors import BrokenWriterError, EncodeError, WriteFailedError
from .resume import optimizer_state
from .snapshot import ModelSnapshot, as_metrics
from .state import check_plain, flatten
from .writer import REVOKED, writer_main

__all__ = ["SnapshotWriter", "WriteHandle", "WriteReport", "POLICIES"]

log = logging.getLogger("snapsvc")

POLICIES = ("block", "skip", "latest")
_RESERVED = 0          # slot.seq while a submit is staging into it
_START_TIMEOUT = 120.0  # spawn + import torch on a loaded 2-core box can be slow
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


class _Slot:
    def __init__(self, sid: int, layout: staging.Layout, pin: bool) -> None:
        self.id = sid
        self.layout = layout
        self.pinned = pin
        self.flat = staging.allocate(layout, pin=pin)
        self.views = staging.views(self.flat, layout)
        self.claim = staging.claim_word(self.flat)
        self.seq: int | None = None   # None free, _RESERVED staging, else in flight
        self.gen = -1                 # writer generation that has it mapped
        self.copying = False          # overlap mode: the copier thread is filling it
        # overlap mode copies at submit what an optimizer step does not change
        early = (staging.BUFFER, staging.STATE)
        self.early = [i for i, s in enumerate(layout.specs) if s.kind in early]
        self.late = [i for i, s in enumerate(layout.specs) if s.kind not in early]

    def release(self) -> None:
        if self.pinned:
            staging.unpin(self.flat)
            self.pinned = False


def _walk(model: nn.Module) -> list[torch.Tensor | None]:
    """Every parameter and buffer slot of every submodule, in one pass.

    Reads ``_parameters``/``_buffers`` directly: ``parameters()`` and
    ``buffers()`` would walk the tree twice and build names and sets, which
    costs milliseconds on models with thousands of tensors, on every submit.
    """
    out: list[torch.Tensor | None] = []
    for mod in model.modules():
        out.extend(mod._parameters.values())
        out.extend(mod._buffers.values())
    return out


@dataclass
class _Plan:
    """What submit() needs of a model, valid while its tensors stay the same."""

    walked: list[torch.Tensor | None]  # _walk(model) when planned
    sources: list[torch.Tensor]        # params, then persistent buffers: the copy's sources
    shapes: list[torch.Size]
    dtypes: list[torch.dtype]
    device: torch.device | None        # of the first source; a model moves as a whole
    pool: list[_Slot]

    def matches(self, walked: list[torch.Tensor | None]) -> bool:
        src = self.sources
        return (len(walked) == len(self.walked) and all(map(operator.is_, walked, self.walked))
                and all(t.shape == s for t, s in zip(src, self.shapes))
                and all(t.dtype is d for t, d in zip(src, self.dtypes))
                and (not src or src[0].device == self.device))


@dataclass
class _Pending:
    handle: WriteHandle
    slot: _Slot
    started: float
    stage_s: float
    gen: int


class SnapshotWriter:
    """Owns one writer sidecar process and the shared-memory slots it reads.

    ``directory``: base for relative paths (created if missing). ``slots``:
    snapshots in flight per model layout (memory is ``slots x model bytes``).
    ``policy`` when every slot is busy: ``"block"`` waits, ``"skip"`` drops
    this snapshot, ``"latest"`` replaces the newest queued, unstarted one.
    ``keep_last``: keep only the newest N files this writer wrote per
    directory. ``compress_level``: isal gzip level for ``.gz`` paths.
    ``restart``: a dead sidecar is restarted by the next submit.
    ``drain_timeout``: how long an interpreter exit without :meth:`close`
    waits for queued writes. ``sigterm``: turn SIGTERM (when its handler is
    still the default) into ``SystemExit`` so ``with`` blocks and the exit
    drain run instead of dying with writes queued; SIGINT already raises
    ``KeyboardInterrupt``. Writes not done in time are logged by path.
    ``overlap``: submit() returns once the copy is enqueued (buffers are
    copied at once, parameters and optimizer state on a background thread, or
    on a side CUDA stream into pinned memory); pair it with :meth:`guard`. The
    WRITE message then leaves after the copy, so a trainer SIGKILLed in that
    window loses that snapshot, which blocking mode never does.
    ``nice``: added to the sidecar's nice value (0 = training's priority); the
    default 10 lets a CPU-bound training loop keep the cores, at the price of
    later durability when they are all busy.
    ``fault_hook``: for tests, a picklable ``hook(stage, path)`` run inside the
    sidecar at "start" and at each durable-write stage (see
    :func:`snapsvc.durable.set_fault_hook`); raising ``OSError`` there
    simulates a disk fault.
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None, *, slots: int = 2,
                 policy: str = "block", keep_last: int | None = None,
                 compress_level: int | None = None, start_method: str = "spawn",
                 restart: bool = True, drain_timeout: float = 60.0, sigterm: bool = True,
                 overlap: bool = False, nice: int = 10,
                 fault_hook: Callable[[str, str], None] | None = None) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        if compress_level is not None and not 0 <= compress_level <= 3:
            raise ValueError(f"compress_level must be 0..3 (isal's levels), got {compress_level}")
        self.directory = os.path.abspath(directory) if directory is not None else None
        self.slots = slots
        self.policy = policy
        self.restart = restart
        self.drain_timeout = drain_timeout
        self.overlap = overlap
        self._copy_pool: ThreadPoolExecutor | None = None
        self._inflight: Future[None] | None = None
        self._copy_event: Any = None
        self._guarded = False
        self._warned = False
        self.sigterm = sigterm
        self._ctx = tmp.get_context(start_method)
        if not 0 <= nice <= 19:
            raise ValueError(f"nice must be 0..19, got {nice}")
        self._options = {"keep_last": keep_last, "compress_level": compress_level,
                         "nice": nice, "fault_hook": fault_hook}
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._pools: dict[tuple, list[_Slot]] = {}
        self._plans: "weakref.WeakKeyDictionary[nn.Module, _Plan]" = weakref.WeakKeyDictionary()
        self._pending: dict[int, _Pending] = {}
        self._dirs: set[str] = set()
        self._seq = 0
        self._sid = 0
        self._gen = 0
        self._proc: Any = None
        self._req: Any = None
        self._claim_lock: Any = None
        self._reader: threading.Thread | None = None
        self._broken: BrokenWriterError | None = None
        self._closed = False
        self._stream = None
        self._counts = {"submitted": 0, "written": 0, "skipped": 0, "failed": 0,
                        "broken": 0, "restarts": 0, "bytes": 0}
        self._stalls: deque[float] = deque(maxlen=10_000)

    # -- lifecycle -------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        """The sidecar's process id (None before start)."""
        return self._proc.pid if self._proc is not None else None

    def __enter__(self) -> "SnapshotWriter":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> "SnapshotWriter":
        """Launch the sidecar; return once it has confirmed it is ready."""
        if self._closed:
            raise RuntimeError("this SnapshotWriter is closed; make a new one")
        if self._proc is not None and self._broken is None:
            return self
        if self.directory is not None:
            os.makedirs(self.directory, exist_ok=True)
            self._dirs.add(self.directory)
        for d in self._dirs:
            for path in remove_stale_temps(d):
                log.warning("removed %s left by a dead writer", path)
        req_r, req_w = self._ctx.Pipe(duplex=False)
        rep_r, rep_w = self._ctx.Pipe(duplex=False)
        lock = staging.ClaimLock.create()
        proc = self._ctx.Process(target=writer_main, args=(req_r, rep_w, lock, self._options),
                                 name="snapsvc-writer", daemon=True)
        try:
            proc.start()
        except BaseException:
            for end in (req_r, req_w, rep_r, rep_w, lock):
                end.close()
            raise
        req_r.close()  # our copies of the child's ends: EOF must mean the peer is gone
        rep_w.close()
        ready = wait([rep_r, proc.sentinel], timeout=_START_TIMEOUT)
        msg = None
        if rep_r in ready:
            try:
                msg = protocol.unpack(rep_r.recv_bytes())
            except (EOFError, OSError):
                pass
        if msg is None or msg["op"] != protocol.READY:
            if not wait([proc.sentinel], timeout=5):  # exiting, or hung: give it 5 s
                proc.kill()
            proc.join(5)
            req_w.close()
            rep_r.close()
            lock.close()
            raise BrokenWriterError(f"the writer sidecar did not start: {_describe(proc)}")
        with self._cond:
            self._gen += 1
            gen = self._gen
            self._proc, self._req, self._claim_lock = proc, req_w, lock
            self._broken = None
        _live.add(self)
        if self.sigterm:
            _exit_on_sigterm()
        self._reader = threading.Thread(target=self._read_reports, args=(gen, rep_r, proc),
                                        name="snapsvc-reports", daemon=True)
        self._reader.start()
        return self

    def _ensure_running(self) -> None:
        if self._closed:
            raise RuntimeError("this SnapshotWriter is closed; make a new one")
        if self._proc is None:
            self.start()
            return
        if self._broken is None and _exited(self._proc):
            # Died with nothing pending, and the reader has not said so yet:
            # let it, rather than queue this snapshot to a dead process.
            self._reader.join(5)
        if self._broken is not None:
            if not self.restart:
                raise self._broken
            self.wait_staged()  # the copier drops what it held for the dead writer first
            self._reap()
            self._counts["restarts"] += 1
            log.warning("restarting the writer sidecar after: %s", self._broken)
            self.start()

    def _reap(self) -> None:
        """Forget a dead sidecar: join its reader, close our pipe ends."""
        if self._reader is not None:
            self._reader.join(5)
        if self._req is not None:
            self._req.close()
        if self._proc is not None:
            self._proc.join(5)
        if self._claim_lock is not None:
            self._claim_lock.close()
        self._proc = self._req = self._reader = self._claim_lock = None

    def finish(self, timeout: float | None = None) -> None:
        """Wait for every queued snapshot to be written, then stop the sidecar.

        After ``timeout`` seconds the sidecar is killed; the snapshots it had
        not written are logged by path and their handles fail.
        """
        self._not_from_reader("finish")
        if self._proc is None:
            self._closed = True
            self._release_slots()
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending and self._broken is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(0.5 if left is None else min(left, 0.5))
            late = [p.handle.path for p in self._pending.values()]
        if late:
            log.error("snapsvc: %d snapshot(s) not written within %.1f s: %s",
                      len(late), timeout, ", ".join(late))
        if self._copy_pool is not None:  # overlap copies finish (memcpy) before STOP goes out
            self._copy_pool.shutdown(wait=True)
            self._copy_pool = None
        self._send(protocol.pack(protocol.STOP))
        if not wait([self._proc.sentinel],
                    None if deadline is None else max(0.1, deadline - time.monotonic())):
            self._proc.kill()
        if self._reader is not None:
            self._reader.join(10)
        self._reap()
        self._closed = True
        _live.discard(self)
        self._release_slots()

    close = finish

    def _release_slots(self) -> None:
        for pool in self._pools.values():
            for slot in pool:
                slot.release()
        self._pools.clear()
        self._plans.clear()

    # -- reports ---------------------------------------------------------------
    def _read_reports(self, gen: int, rep: Any, proc: Any) -> None:
        try:
            while True:
                ready = wait([rep, proc.sentinel])
                if rep in ready:
                    try:
                        data = rep.recv_bytes()
                    except (EOFError, OSError):
                        data = None
                    if data is not None:
                        self._on_report(gen, protocol.unpack(data))
                        continue
                break
        except Exception:  # a bug here must not leave handles waiting forever
            log.exception("snapsvc: reading the writer's reports failed; stopping it")
            proc.kill()
        finally:
            rep.close()
        proc.join(5)
        self._on_exit(gen, proc)

    def _on_report(self, gen: int, msg: dict[str, Any]) -> None:
        op = msg["op"]
        if op == protocol.SLOT_OK:
            with self._cond:
                for pool in self._pools.values():
                    for slot in pool:
                        if slot.id == msg["slot"]:
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
            self._cond.notify_all()
        if msg["ok"]:
            report = WriteReport(
                path=msg["path"], bytes=msg.get("bytes", 0), entries=msg.get("entries", 0),
                skipped=msg.get("superseded", False), stage_s=p.stage_s, queue_s=msg["queue_s"],
                encode_s=msg.get("encode_s", 0.0), write_s=msg.get("write_s", 0.0),
                fsync_s=msg.get("fsync_s", 0.0), total_s=time.monotonic() - p.started,
                seq=msg["seq"])
            self._counts["skipped" if report.skipped else "written"] += 1
            self._counts["bytes"] += report.bytes
            p.handle._future.set_result(report)
        else:
            self._counts["failed"] += 1
            p.handle._future.set_exception(WriteFailedError(
                msg["errno"] or 0, f"{msg['error']} (writing checkpoint)", msg["filename"]))

    def _on_exit(self, gen: int, proc: Any) -> None:
        with self._cond:
            failed = [p for p in self._pending.values() if p.gen == gen]
            orderly = self._closed or (proc.exitcode == 0 and not failed)
            err = BrokenWriterError(f"the writer sidecar {_describe(proc)}; "
                                    f"{len(failed)} pending write(s) lost to it")
            if not orderly or failed:
                self._broken = err
            for p in failed:
                del self._pending[p.handle.seq]
                if not p.slot.copying:  # else the copier frees it when done
                    p.slot.seq = None
            self._cond.notify_all()
        if failed:
            self._counts["broken"] += len(failed)
            log.error("%s: %s", err, ", ".join(p.handle.path for p in failed))
        for p in failed:
            p.handle._future.set_exception(err)

    # -- submit ----------------------------------------------------------------
    def submit(self, model_or_state: nn.Module | Mapping[Any, Any] | ModelSnapshot,
               path: str | os.PathLike[str], *, metrics: Mapping[str, float] | None = None,
               epoch: int | None = None, optimizer: torch.optim.Optimizer | None = None,
               extra: Any = None) -> WriteHandle:
        """Stage a snapshot into a slot and queue it; return once the copy is done.

        ``model_or_state`` is a model, a :class:`ModelSnapshot`, or a mapping
        of training state (models, optimizers, schedulers, tensors, nested
        containers, plain values: see :mod:`snapsvc.state`). After this
        returns the inputs may change freely: the file holds the values of
        this moment. With a model, ``optimizer`` captures its state in the
        same copy, written beside the model (see :mod:`snapsvc.resume`), and
        ``extra`` is plain data (dicts, lists, tuples, str, bytes, numbers)
        stored in the metadata.
        """
        started = time.monotonic()
        optim_info = tree = None
        path = self._resolve(path)  # values first: nothing is allocated for a refused submit
        extra = check_plain(extra, "extra")
        if isinstance(model_or_state, ModelSnapshot):
            metrics = model_or_state.metrics if metrics is None else metrics
            epoch = model_or_state.epoch if epoch is None else epoch
        metrics = as_metrics(metrics)
        if isinstance(model_or_state, ModelSnapshot):
            if optimizer is not None:
                raise TypeError("optimizer= needs the model itself, not a ModelSnapshot")
            snap = model_or_state
            params, buffers = list(snap.params.items()), list(snap.buffers.items())
            sources = [t for _, t in params + buffers]
            pool = self._pool(params, buffers)
        elif isinstance(model_or_state, nn.Module):
            if optimizer is None:
                sources, pool = self._plan(model_or_state)
            else:
                sources, pool, optim_info = self._plan_with_optimizer(model_or_state, optimizer)
        elif isinstance(model_or_state, Mapping):
            if optimizer is not None or extra is not None:
                raise TypeError("with a state mapping, put optimizers and extra values "
                                "inside the mapping")
            flat = flatten(model_or_state)
            sources, tree = flat.tensors(), flat.tree
            pool = self._pool(flat.params, flat.buffers, state=flat.rest,
                              structural_hash=flat.structural_hash)
        else:
            raise TypeError(f"submit() takes an nn.Module, a state Mapping or a ModelSnapshot, "
                            f"not {type(model_or_state).__name__}")
        body = _pack_body(pool[0].layout, path, epoch=epoch, metrics=metrics, extra=extra,
                          optim=optim_info, state=tree)
        msg = {"path": path, "body": body}
        self._not_from_reader("submit")
        self._ensure_running()
        self._counts["submitted"] += 1
        self._register(pool)
        slot = self._acquire(pool)
        if slot is None:
            return self._skipped(path, started)
        try:
            rest = self._stage(slot, sources)
        except BaseException:
            self._free(slot)
            raise
        stage_s = time.monotonic() - started
        self._stalls.append(stage_s)
        with self._cond:
            if self._broken is not None:  # died while we copied: nobody would resolve it
                slot.seq = None
                slot.copying = False
                self._cond.notify_all()
                raise self._broken
            self._seq += 1
            seq = self._seq
            handle = WriteHandle(seq, path)
            slot.seq = seq
            self._pending[seq] = _Pending(handle, slot, started, stage_s, self._gen)
        if rest is None:
            self._dispatch(slot, seq, msg)
        else:
            self._inflight = self._copier().submit(self._finish_copy, rest, slot, seq, msg)
        return handle

    def _not_from_reader(self, what: str) -> None:
        if threading.current_thread() is self._reader:
            raise RuntimeError(f"{what}() from a done-callback would deadlock: callbacks run on "
                               "the thread that delivers reports; hand the work to another thread")

    def _free(self, slot: _Slot) -> None:
        with self._cond:
            slot.seq = None
            slot.copying = False
            self._cond.notify_all()

    def _dispatch(self, slot: _Slot, seq: int, msg: dict[str, Any]) -> None:
        """The slot holds the snapshot: let the writer claim it, then tell it."""
        self._set_claim(slot, seq)
        self._send(protocol.pack(protocol.WRITE, seq=seq, slot=slot.id,
                                 sent_at=time.monotonic(), **msg))  # ints, a checked str, bytes

    def _finish_copy(self, rest: Callable[[], None], slot: _Slot, seq: int,
                     msg: dict[str, Any]) -> None:
        """Overlap mode, on the copier thread: complete the copy, then dispatch."""
        try:
            rest()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's handle
            with self._cond:
                p = self._pending.pop(seq, None)
            self._free(slot)
            if p is not None:
                self._counts["failed"] += 1
                p.handle._future.set_exception(e)
            return
        with self._cond:
            slot.copying = False
            p = self._pending.get(seq)
            if p is None or p.gen != self._gen:  # the writer died meanwhile; handle failed
                slot.seq = None
                self._cond.notify_all()
                return
        self._dispatch(slot, seq, msg)

    def _copier(self) -> ThreadPoolExecutor:
        # One thread: copies finish, and messages go out, in submit order.
        if self._copy_pool is None:
            self._copy_pool = ThreadPoolExecutor(1, thread_name_prefix="snapsvc-copy")
        return self._copy_pool

    def wait_path(self, path: str | os.PathLike[str], timeout: float | None = None) -> None:
        """Wait until no write to ``path`` is pending (its outcome is on its handle).

        ``TimeoutError`` after ``timeout`` seconds. For callers about to
        remove or read that checkpoint.
        """
        path = self._resolve(path)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while any(p.handle.path == path for p in self._pending.values()):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"a write to {path} is still pending after {timeout} s")
                self._cond.wait(0.5 if left is None else min(left, 0.5))

    def wait_staged(self, timeout: float | None = None) -> None:
        """Overlap mode: block until every snapshot's copy has finished."""
        inflight = self._inflight
        if inflight is not None:
            inflight.result(timeout)

    def guard(self, optimizer: torch.optim.Optimizer) -> Any:
        """Make ``optimizer.step()`` wait for in-flight snapshot copies (overlap mode).

        Registers an optimizer step pre-hook and returns its removable
        handle. On CPU the hook blocks until the background copy is done; on
        CUDA it makes the current stream wait on the copy's event, so the CPU
        never blocks. Without it, overlap mode may write a snapshot that mixes
        two steps.
        """
        def hook(opt: Any, args: Any, kwargs: Any) -> None:
            event = self._copy_event
            if event is not None:
                torch.cuda.current_stream().wait_event(event)
            else:
                self.wait_staged()

        self._guarded = True
        return optimizer.register_step_pre_hook(hook)

    def _resolve(self, path: str | os.PathLike[str]) -> str:
        path = os.fspath(path)
        if self.directory is not None and not os.path.isabs(path):
            path = os.path.join(self.directory, path)
        path = os.path.abspath(path)
        try:
            path.encode("utf-8")  # it travels in a msgpack str; refuse it before taking a slot
        except UnicodeEncodeError:
            raise ValueError(f"checkpoint path {path!r} is not valid UTF-8") from None
        self._dirs.add(os.path.dirname(path))
        return path

    def _skipped(self, path: str, started: float) -> WriteHandle:
        with self._cond:
            self._seq += 1
            handle = WriteHandle(self._seq, path)
        self._counts["skipped"] += 1
        stall = time.monotonic() - started
        self._stalls.append(stall)
        handle._future.set_result(WriteReport(path=path, skipped=True, stage_s=stall,
                                              total_s=stall, seq=handle.seq))
        return handle

    def _plan(self, model: nn.Module) -> tuple[list[torch.Tensor], list[_Slot]]:
        """The tensors to copy from ``model`` and their pool, cached per model.

        Walking a module tree by name and hashing its layout costs
        milliseconds for thousands of tensors; the cache is checked instead by
        identity, shape and dtype of every tensor and the device of the first,
        which is enough to see a replaced, added, resized, cast or moved
        parameter or buffer.
        """
        walked = _walk(model)
        plan = self._plans.get(model)
        if plan is None or not plan.matches(walked):
            named, persistent = list(model.named_parameters()), list(persistent_buffers(model))
            sources = [t for _, t in named + persistent]
            plan = _Plan(walked, sources, [t.shape for t in sources], [t.dtype for t in sources],
                         sources[0].device if sources else None, self._pool(named, persistent))
            self._plans[model] = plan
        return plan.sources, plan.pool

    def _plan_with_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer
                             ) -> tuple[list[torch.Tensor], list[_Slot], dict[str, Any]]:
        """Model and optimizer tensors, their pool, and the optimizer's description.

        Not cached: optimizer state appears at the first step and its
        hyperparameters change under schedulers; resume checkpoints are rare.
        """
        named, persistent = list(model.named_parameters()), list(persistent_buffers(model))
        optim, info = optimizer_state(optimizer, {id(p): n for n, p in named})
        pool = self._pool(named, persistent, optim)
        return [t for _, t in named + persistent + optim], pool, info

    def _pool(self, params: list[tuple[str, torch.Tensor]],
              buffers: list[tuple[str, torch.Tensor]],
              optim: list[tuple[str, torch.Tensor]] = (),  # type: ignore[assignment]
              state: list[tuple[str, str, torch.Tensor]] = (),  # type: ignore[assignment]
              structural_hash: str | None = None) -> list[_Slot]:
        tensors = [*params, *buffers, *((n, t) for _, n, t in state), *optim]
        pin = torch.cuda.is_available() and any(t.is_cuda for _, t in tensors)
        key = (len(params), len(buffers), len(optim), pin, tuple(k for k, _, _ in state),
               tuple((n, t.shape, t.dtype) for n, t in tensors))
        pool = self._pools.get(key)
        if pool is None:
            if structural_hash is None:
                structural_hash = layout_hash(params, buffers)
            layout = staging.Layout.of(params, buffers, structural_hash, optim, state)
            pool = []
            for _ in range(self.slots):
                self._sid += 1
                pool.append(_Slot(self._sid, layout, pin))
            self._pools[key] = pool
        return pool

    def _acquire(self, pool: list[_Slot]) -> _Slot | None:
        """A free slot of ``pool``, reserved for the caller, by the policy."""
        with self._cond:
            while True:
                if self._broken is not None:
                    raise self._broken
                for slot in pool:
                    if slot.seq is None:
                        slot.seq = _RESERVED
                        return slot
                if self.policy == "skip":
                    return None
                if self.policy == "latest":
                    slot = self._revoke_newest(pool)
                    if slot is not None:
                        return slot
                self._cond.wait(0.5)

    def _revoke_newest(self, pool: list[_Slot]) -> _Slot | None:
        """Take back the newest queued, unstarted snapshot's slot (cond held)."""
        for slot in sorted((s for s in pool if s.seq), key=lambda s: s.seq, reverse=True):
            with self._claim_lock:
                if int(slot.claim.item()) != slot.seq:
                    continue  # the writer already started it
                slot.claim.fill_(REVOKED)
            old = self._pending.pop(slot.seq)
            self._counts["skipped"] += 1
            old.handle._future.set_result(WriteReport(
                path=old.handle.path, skipped=True, stage_s=old.stage_s,
                total_s=time.monotonic() - old.started, seq=old.handle.seq))
            slot.seq = _RESERVED
            return slot
        return None

    def _set_claim(self, slot: _Slot, seq: int) -> None:
        with self._claim_lock:
            slot.claim.fill_(seq)

    def _register(self, pool: list[_Slot]) -> None:
        """Hand a pool's shared memory to the current sidecar, once per generation.

        All slots at once, while the sidecar is likely idle: it maps them in
        queue order, so a slot registered later would wait behind writes.
        """
        gen = self._gen
        todo = [slot for slot in pool if slot.gen != gen]
        if not todo:
            return
        try:
            with self._send_lock:
                for slot in todo:
                    self._req.send_bytes(protocol.pack(protocol.SLOT, slot=slot.id,
                                                       layout=slot.layout.to_msg()))
                    self._req.send(slot.flat)
        except (BrokenPipeError, ConnectionResetError) as e:
            self._reader.join(5)  # it sees the death and sets _broken
            raise self._broken or BrokenWriterError(f"the writer sidecar is gone ({e})") from e
        # Wait until the writer has mapped them: until then their fds live only
        # in this process, and a submit must not depend on it staying alive.
        with self._cond:
            while any(slot.gen != gen for slot in todo):
                if self._broken is not None:
                    raise self._broken
                self._cond.wait(0.5)

    def _stage(self, slot: _Slot, sources: list[torch.Tensor]) -> Callable[[], None] | None:
        """Copy ``sources`` into ``slot``.

        Blocking mode copies everything and returns None. Overlap mode copies
        the buffers now (forward() updates them, and no optimizer hook can
        guard that) and returns the rest of the copy, to run on the copier
        thread (CPU) or already queued on a side stream (CUDA, where what is
        returned waits for the DMA to land).
        """
        if not self.overlap:
            if slot.pinned:
                stream = self._side_stream()
                stream.wait_stream(torch.cuda.current_stream())
                staging.copy_into(slot.views, sources, stream)
                stream.synchronize()
            else:
                staging.copy_into(slot.views, sources)
            return None
        if not self._guarded and not self._warned:
            self._warned = True
            log.warning("overlap=True without writer.guard(optimizer): a snapshot may mix "
                        "values from two steps")
        early = [sources[i] for i in slot.early], [slot.views[i] for i in slot.early]
        late = [sources[i] for i in slot.late], [slot.views[i] for i in slot.late]
        slot.copying = True
        if not slot.pinned:
            staging.copy_into(early[1], early[0])
            return functools.partial(staging.copy_into, late[1], late[0])
        stream = self._side_stream()
        stream.wait_stream(torch.cuda.current_stream())
        staging.copy_into(early[1], early[0], stream)
        buffers_done = torch.cuda.Event()
        buffers_done.record(stream)
        torch.cuda.current_stream().wait_event(buffers_done)  # GPU-side wait, CPU runs on
        staging.copy_into(late[1], late[0], stream)
        copied = torch.cuda.Event()
        copied.record(stream)
        self._copy_event = copied
        return copied.synchronize

    def _side_stream(self) -> "torch.cuda.Stream":
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def _send(self, data: bytes) -> None:
        try:
            with self._send_lock:
                self._req.send_bytes(data)
        except (BrokenPipeError, ConnectionResetError, OSError) as e:
            # The sidecar is dead; the reader thread fails every pending handle.
            log.debug("send to the writer failed: %s", e)

    # -- figures ---------------------------------------------------------------
    def is_idle(self) -> bool:
        """True when no snapshot is queued or being written."""
        with self._cond:
            return not self._pending

    def stats(self) -> dict[str, Any]:
        """Running figures: counts, bytes written, restarts and submit() stalls."""
        stalls = sorted(self._stalls)

        def pct(q: float) -> float:
            return stalls[min(len(stalls) - 1, int(q * len(stalls)))] if stalls else 0.0

        with self._cond:
            pending = len(self._pending)
        slot_bytes = sum(s.layout.nbytes for pool in self._pools.values() for s in pool)
        return {**self._counts, "pending": pending, "slot_bytes": slot_bytes,
                "stall_p50_s": pct(0.50), "stall_p99_s": pct(0.99),
                "stall_max_s": stalls[-1] if stalls else 0.0, "pid": self.pid}


def _pack_body(layout: staging.Layout, path: str, *, epoch: int | None,
               **values: Any) -> bytes:
    """The WRITE message's metadata values, packed once, before a slot is taken.

    Packed by the function the sidecar and the reader unpack with, and held
    to the reader's size limit (less room for what the sidecar adds), so a
    value accepted here is one that can be written and read back.
    """
    epoch = int(epoch or 0)
    if not -(1 << 63) <= epoch < (1 << 63):
        raise EncodeError(f"epoch {epoch} does not fit in int64")
    try:
        body = protocol.pack_value({"epoch": epoch, **values})
    except (TypeError, ValueError, OverflowError) as e:  # checked already: a bug if it happens
        raise EncodeError(f"{path}: the metadata cannot be packed ({e})") from None
    room = protocol.MAX_METADATA - _META_ROOM - sum(
        len(s.name.encode("utf-8")) + 8 for s in layout.specs if s.kind == staging.BUFFER)
    if len(body) > room:
        raise EncodeError(f"{path}: metrics, extra values and state tree take {len(body)} "
                          f"bytes of metadata; the limit is {room} (snapsvc.protocol."
                          "MAX_METADATA): keep large data in tensors")
    return body


def _exited(proc: Any) -> bool:
    """Has the process exited? Through its sentinel: is_alive() would waitpid()
    and race the reader thread's join() for the exit status."""
    return bool(wait([proc.sentinel], timeout=0))


def _describe(proc: Any) -> str:
    if proc is None:
        return "is not running"
    code = proc.exitcode
    if code is None:
        return f"(pid {proc.pid}) did not answer in time"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"(pid {proc.pid}) was killed by {name}"
    return f"(pid {proc.pid}) exited with code {code}"


def _sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _exit_on_sigterm() -> None:
    """Make SIGTERM unwind like an exception, so pending writes drain (main thread only)."""
    if threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _sigterm)


@atexit.register
def _close_at_exit() -> None:
    """An interpreter that exits without close(): let each sidecar drain, bounded."""
    for w in list(_live):
        try:
            w.finish(timeout=w.drain_timeout)
        except Exception:  # never block interpreter exit on a checkpoint
            log.exception("closing a snapsvc writer at exit failed")

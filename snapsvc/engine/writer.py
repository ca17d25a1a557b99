"""``SnapshotWriter``: the trainer's side of the checkpoint sidecar, a thin façade.

Each public call is a few lines over named parts; the data flow, who owns
what and the locking are drawn in :mod:`snapsvc.engine`.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from typing import Any, Callable, Mapping

import torch
from torch import nn

from ..errors import UnsafeCallError
from ..remote.store import check_remote
from ..format import protocol
from ..state.tree import check_plain
from .book import Book
from .copier import Copier
from .dispatch import Dispatcher, using
from .handles import WriteHandle, WriteReport
from .life import AttachReport, Cadence, Life
from .plan import check_epoch, check_path, pack_body, request
from .pools import SlotPools
from .link import Sidecar
from .slots import SlotBroker
from .snapshot import ModelSnapshot, as_metrics

__all__ = ["SnapshotWriter", "WriteHandle", "WriteReport", "POLICIES"]


POLICIES = ("block", "skip", "latest")

# option -> (is this value accepted?, what is) for the constructor's arguments
_OPTIONS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "slots": (lambda v: v >= 1, ">= 1"),
    "policy": (lambda v: v in POLICIES, f"one of {POLICIES}"),
    "keep_last": (lambda v: v is None or v >= 1, ">= 1 or None"),
    "compress_level": (lambda v: v is None or 0 <= v <= 3, "0..3 (isal's levels) or None"),
    "nice": (lambda v: v is None or 0 <= v <= 19, "0..19 or None"),
    "incremental": (lambda v: v in (False, True, "check"), "False, True or 'check'"),
    "max_slot_bytes": (lambda v: v is None or v >= 1, ">= 1 or None"),
    "persist_every": (lambda v: v is None or v >= 1, ">= 1 or None"),
    "keep_in_memory": (lambda v: v >= 1, ">= 1"),
    "linger": (lambda v: v >= 0, ">= 0 (seconds)"),
    "memory_limit": (lambda v: v is None or v >= 1, ">= 1 (bytes) or None"),
}


def _check_options(start_method: str | None, **values: Any) -> None:
    """Refuse a constructor argument out of its range, naming what is accepted."""
    if start_method is not None:
        warnings.warn("SnapshotWriter(start_method=...) is deprecated and ignored: the sidecar "
                      "is always a fresh interpreter that never imports __main__",
                      DeprecationWarning, stacklevel=3)
    for name, value in values.items():
        ok, expected = _OPTIONS[name]
        if not ok(value):
            raise ValueError(f"{name} must be {expected}, got {value!r}")


class SnapshotWriter:
    """Owns one writer sidecar process and the shared-memory slots it reads.

    Args:
        directory: base of relative paths (made if missing; a path's own
            directories are made at submit).
        slots: snapshots in flight; memory is about ``slots x snapshot bytes``
            (:mod:`snapsvc.engine.pools`). ``max_slot_bytes`` caps all slots.
        policy: when every slot is busy, ``"block"`` waits (up to submit's
            ``timeout``), ``"skip"`` drops this snapshot, ``"latest"`` replaces
            the newest queued, unstarted one.
        keep_last: per directory, keep the newest N files of each series this
            writer wrote: names that differ only in digits (``step100.fdl``,
            ``step200.fdl``); ``best.fdl`` is a series of its own.
        compress_level: isal gzip level (0-3) for ``.gz`` paths.
        restart: a dead sidecar is restarted by the next submit.
        drain_timeout: how long an interpreter exit without :meth:`close`
            waits for queued writes.
        sigterm: turn SIGTERM (while its handler is the default) into
            ``SystemExit``, so ``with`` blocks and the exit drain run.
        overlap: ``submit()`` returns once the copy is enqueued; pair it with
            :meth:`guard` (:mod:`snapsvc.engine.copier`). A trainer SIGKILLed
            before the copy ends loses that snapshot; blocking mode never does.
        incremental: skip frozen parameters the slot holds unchanged; ``"check"``
            verifies each skip (:mod:`snapsvc.engine.copier` says what it misses).
        nice: the sidecar's nice increment; None is 10 beside a process that
            has initialized CUDA, else 0 (a niced sidecar starves beside CPU
            training, and saves then wait for a free slot).
        fault_hook: for tests, an importable ``hook(stage, path)`` run in the sidecar.
        start_method: deprecated and ignored (:mod:`snapsvc.engine.link`).
        memory_limit: bytes of RAM for slots plus the RAM tier's copies (a service's
            ``--memory`` when lower); older RAM copies are evicted, never a snapshot in flight.
        remote: a second tier, ``s3://``/``gs://``/``az://`` or a mounted
            directory; each durable checkpoint is copied there by the sidecar,
            ``.meta`` last (:mod:`snapsvc.remote.upload`); ``handle.uploaded()``
            says when. Credentials come from the environment.
        remote_keep_last: rotates the remote tier as ``keep_last`` does the local.
        remote_timeout: how long one upload (retries included) and :meth:`close` wait for uploads.
        remote_options: passed to obstore's ``from_url`` (and to the boto3 client
            that aborts leftover multipart uploads); checked here.
        persist_every: persist the K-th, 2K-th, ... submit of each series, the others RAM only.
        keep_in_memory: the memory-only snapshots of each series the sidecar holds.
        linger: seconds a sidecar whose trainer died without :meth:`close` waits for the
            next writer of ``directory`` (``writer.attached``; docs/restart.md).
        service: a ``snapsvc serve`` socket to attach to (default: the service registered
            for ``directory``, if one runs); its ``--keep``, ``--remote`` and RAM tier apply,
            and :meth:`close` leaves it running.

    ``stats()["staged_bytes"]`` counts what was copied. Every public method
    may be called from any thread.
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None, *, slots: int = 2,
                 policy: str = "block", keep_last: int | None = None,
                 compress_level: int | None = None, start_method: str | None = None,
                 restart: bool = True, drain_timeout: float = 60.0, sigterm: bool = True,
                 overlap: bool = False, incremental: bool | str = False, nice: int | None = None,
                 max_slot_bytes: int | None = None,
                 fault_hook: Callable[[str, str], None] | None = None,
                 remote: str | os.PathLike[str] | None = None,
                 remote_keep_last: int | None = None, remote_timeout: float = 300.0,
                 remote_options: Mapping[str, Any] | None = None,
                 persist_every: int | None = None, keep_in_memory: int = 1,
                 linger: float = 0.0, service: str | os.PathLike[str] | None = None,
                 memory_limit: int | None = None) -> None:
        _check_options(slots=slots, policy=policy, keep_last=keep_last, nice=nice,
                       compress_level=compress_level, incremental=incremental,
                       max_slot_bytes=max_slot_bytes, persist_every=persist_every,
                       keep_in_memory=keep_in_memory, linger=linger, start_method=start_method,
                       memory_limit=memory_limit)
        self._cadence = Cadence(persist_every)
        self.directory = os.path.abspath(directory) if directory is not None else None
        self.remote = check_remote(remote, self.directory, remote_keep_last, remote_timeout,
                                   remote_options)
        self.slots = slots
        self.policy = policy
        self.restart = restart
        self.drain_timeout = drain_timeout
        self.overlap = overlap
        self.sigterm = sigterm
        self.service = os.path.abspath(service) if service is not None else None
        options = {"keep_last": keep_last, "compress_level": compress_level, "nice": nice,
                   "fault_hook": fault_hook, "remote": self.remote, "directory": self.directory,
                   "remote_keep_last": remote_keep_last, "remote_timeout": remote_timeout,
                   "remote_options": dict(remote_options or {}),
                   "keep_in_memory": keep_in_memory, "linger": float(linger),
                   "memory_limit": memory_limit}
        self.attached: AttachReport | None = None  # set at start: see AttachReport
        self._pid = os.getpid()  # the owner: a forked child never acts on this writer
        self._book = Book(self._on_reader, keep_last=keep_last is not None,
                          remote=self.remote is not None)
        self._sidecar = Sidecar(options, self._on_report, self._on_exit)
        self._pools = SlotPools(slots, max_slot_bytes, memory_limit)
        self._copier = Copier(overlap, incremental)
        self._broker = SlotBroker(self._book, self._sidecar, policy)
        self._dispatch = Dispatcher(self._book, self._sidecar, self._broker, self._copier,
                                    overlap, self._pools)
        self._life = Life(self, self._book, self._sidecar, self._copier, self._pools, options)

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
        self._check_caller("start", wait=False)
        self._life.ensure_running()
        return self

    def finish(self, timeout: float | None = None) -> None:
        """Wait for every queued snapshot to be written, then stop the sidecar.

        New submits are refused from the start; submits already copying are
        waited for. After ``timeout`` seconds the sidecar is killed; the
        snapshots it had not written are logged by path and their handles fail.
        With ``remote``, the sidecar then gives uploads up to ``remote_timeout``;
        each checkpoint not uploaded by then is logged and its ``uploaded()`` fails.
        In a forked child it does nothing: the writer and its sidecar are the
        parent's (so neither a ``with`` block nor the exit drain of a child
        touches them).
        """
        if os.getpid() != self._pid:
            return
        self._check_caller("finish")
        self._life.stop(timeout)

    close = finish

    # -- submit ----------------------------------------------------------------
    def submit(self, model_or_state: nn.Module | Mapping[Any, Any] | ModelSnapshot,
               path: str | os.PathLike[str], *, metrics: Mapping[str, float] | None = None,
               epoch: int | None = None, optimizer: torch.optim.Optimizer | None = None,
               extra: Any = None, timeout: float | None = None,
               persist: bool | None = None) -> WriteHandle:
        """Stage a snapshot into a slot and queue it; return once the copy is done.

        ``model_or_state`` is a model, a :class:`ModelSnapshot`, or a mapping
        of training state (models, optimizers, schedulers, tensors, nested
        containers, plain values: see :mod:`snapsvc.state`). After this
        returns the inputs may change freely: the file holds the values of
        this moment. With a model, ``optimizer`` captures its state in the
        same copy, written beside the model (see :mod:`snapsvc.state.resume`),
        and ``extra`` is plain data (dicts, lists, tuples, str, bytes,
        numbers) stored in the metadata. ``timeout``: how long policy
        ``"block"`` may wait for a free slot (``TimeoutError``). Everything
        that can be refused is refused before a slot is taken.

        ``persist=False``: held in the sidecar's RAM under ``path``, nothing written
        (``report.in_memory``; :mod:`snapsvc.files.ramtier`); None: as ``persist_every`` says.
        """
        started = time.monotonic()
        self._check_caller("submit")
        path = self._resolve(path, create=False, optimizer=optimizer is not None)
        if persist is None:
            persist = self._cadence.persist(path)
        if persist:   # a memory-only snapshot makes no folder on disk
            self._book.make_dir(os.path.dirname(path))
        extra = check_plain(extra, "extra")
        if isinstance(model_or_state, ModelSnapshot):
            metrics = model_or_state.metrics if metrics is None else metrics
            epoch = model_or_state.epoch if epoch is None else epoch
        metrics, epoch = as_metrics(metrics), check_epoch(epoch)
        with self._book.cond:
            self._book.check_open()   # refused before its walk: a closed writer keeps nothing
        req = request(model_or_state, optimizer, extra, self._pools.memo)
        with using(self, req) as (pool, sources, plan):
            body = pack_body(path, pool.buffer_bytes, req.plain, epoch=epoch,
                             metrics=metrics, extra=extra, optim=req.optim, state=req.tree,
                             extra_state=req.extra_state)
            return self._dispatch.stage(pool, sources, plan, path, body, started, timeout,
                                        persist)

    def _upload_durable(self, path: str | os.PathLike[str]) -> WriteHandle:
        """Upload ``path``, durable already, through the sidecar's uploader (for
        DistributedSnapshotWriter: its ranks decide what each uploads)."""
        self._check_caller("upload", wait=False)
        if self.remote is None:
            raise ValueError("this SnapshotWriter has no remote tier (remote=None)")
        path = self._resolve(path, create=False)
        self._life.ensure_running()
        with self._book.cond:
            self._book.check_open()
            handle = self._book.durable(path, self._sidecar.gen)
        # a sidecar gone already fails the handle through book.lose
        self._sidecar.send(protocol.pack(protocol.UPLOAD, seq=handle.seq, path=path))
        return handle

    def _check_caller(self, what: str, *, wait: bool = True) -> None:
        """Refuse a call from a forked child, and (``wait``: a call that waits
        for reports) from the reader thread, i.e. inside a done-callback."""
        if os.getpid() != self._pid:
            raise UnsafeCallError(
                f"{what}() in process {os.getpid()}, a fork of process {self._pid} that owns "
                "this SnapshotWriter: a forked child cannot use its parent's writer (it would "
                "act on the parent's sidecar and slots); make a new SnapshotWriter in the child")
        if wait and self._on_reader():
            raise UnsafeCallError(f"{what}() inside a done-callback would deadlock: callbacks "
                                  "run on the thread that delivers reports; hand the work to "
                                  "another thread")

    def _on_reader(self) -> bool:
        return threading.current_thread() is self._sidecar.reader

    def _resolve(self, path: str | os.PathLike[str], create: bool = True, *,
                 optimizer: bool = False) -> str:
        """The checked absolute path; its directory is made (once) when ``create``."""
        full = check_path(self.directory, path, optimizer=optimizer, remote=self.remote)
        if create:
            self._book.make_dir(os.path.dirname(full))
        return full

    # -- waits -----------------------------------------------------------------
    def wait_staged(self, timeout: float | None = None) -> None:
        """Overlap mode: block until every snapshot's copy has finished."""
        self._check_caller("wait_staged", wait=False)
        self._copier.wait(timeout)

    def guard(self, optimizer: torch.optim.Optimizer) -> Any:
        """Make ``optimizer.step()`` wait for in-flight snapshot copies (overlap mode).

        Registers an optimizer step pre-hook and returns its removable
        handle. On CPU the hook blocks until the background copy is done; on
        CUDA it makes the current stream wait on the copy's event, so the CPU
        never blocks. ``step(closure)`` of a torch optimizer waits at the end
        of the closure, so the forward and backward inside it overlap the copy.
        Without it, overlap mode may write a snapshot that mixes two steps.
        """
        return self._copier.guard(optimizer)

    def wait_path(self, path: str | os.PathLike[str], timeout: float | None = None) -> None:
        """Wait until no write to ``path`` is pending (its outcome is on its handle).

        ``TimeoutError`` after ``timeout`` seconds. For callers about to
        remove or read that checkpoint. Inside a done-callback:
        :class:`~snapsvc.errors.UnsafeCallError` at once.
        """
        self._check_caller("wait_path")
        path = self._resolve(path, create=False)
        pending = self._book.pending
        self._book.wait_until(lambda: not any(p.handle.path == path for p in pending.values()),
                              timeout, f"a write to {path} is still pending")

    # -- reports (on the reader thread) ----------------------------------------
    def _on_report(self, gen: int, msg: dict[str, Any]) -> None:
        self._book.report(gen, msg, self._pools.by_id)

    def _on_exit(self, gen: int, proc: Any) -> None:
        self._book.lose(gen, proc, self._sidecar.gen)

    # -- figures ---------------------------------------------------------------
    def is_idle(self) -> bool:
        """True when no snapshot is queued, being copied or being written."""
        with self._book.cond:
            return not self._book.pending and not self._book.active

    def stats(self) -> dict[str, Any]:
        """Running figures: counts, bytes written, restarts, slot memory and submit() stalls."""
        with self._book.cond:
            counts, pending, stalls = self._book.figures()
            slot_bytes = self._pools.nbytes
            slot_count = sum(1 for _ in self._pools)
        return {**counts, "pending": pending, "slot_bytes": slot_bytes, "slots": slot_count,
                "stall_p50_s": _percentile(stalls, 0.50), "stall_p99_s": _percentile(stalls, 0.99),
                "stall_max_s": stalls[-1] if stalls else 0.0, "pid": self.pid}


def _percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0

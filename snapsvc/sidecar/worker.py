"""The writer sidecar's loop, in its own interpreter (see :mod:`snapsvc.engine.link`).

It reads control messages from the trainer's socket, encodes each snapshot
straight out of its shared-memory slot into a durable ``.fdl`` file plus
metadata, and reports back in submit order. See :mod:`snapsvc.sidecar` for
the whole data flow.

No torch. Neither this module nor :mod:`snapsvc.sidecar.writes` (the encoders
and the durable write) imports torch, and the interpreter's boot never runs
``snapsvc/__init__`` (which does): a slot's tensors are spans of its mapping,
so the sidecar costs a bare interpreter's start and memory, not torch's. It
answers READY and maps the slots it is handed at once, while
:mod:`snapsvc.sidecar.writes` is imported on a thread; only the first WRITE
waits for that import, in the sidecar, not in the training loop.

A WRITE is claimed before it is written (:mod:`snapsvc.format.claims`): a
snapshot the trainer took back under the "latest" policy is skipped.

The writer ignores SIGINT (a Ctrl-C in the terminal reaches the whole process
group; the trainer decides when to stop) and outlives its parent just long
enough to finish every snapshot already handed to it.
"""

from __future__ import annotations

import importlib
import logging
import mmap
import os
import pickle
import signal
import socket
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Callable

from ..files.durable import set_fault_hook, unlink_quietly
from ..format import protocol
from ..format.claims import STARTED, WORD, ClaimLock

__all__ = ["writer_main", "boot"]

log = logging.getLogger("snapsvc.writer")

_PARENT_POLL_S = 0.5


class _Slot:
    """A slot as the sidecar holds it: its mapping (an arena: any layout that
    fits), the layout it holds now, and encoders for the last few layouts.

    A WRITE whose layout differs from the last one the slot held carries it, or
    where it places every tensor as that one did, only its names and hash (names
    change, the tensor bytes stay where they are). Encoders are built
    by :mod:`snapsvc.sidecar.writes` once it is imported, at most once per kept
    layout.
    """

    KEEP = 4  # layouts whose encoders are kept (a few alternate: best, last, ...)

    def __init__(self, memory: mmap.mmap, layout: dict[str, Any]) -> None:
        self.memory = memory
        # [layout message, its Encoders, why it cannot be written, or None
        # until the next write], least recently used first; the last is held now
        self.kept: list[list[Any]] = []
        self.use(layout)

    def use(self, layout: dict[str, Any]) -> None:
        """Lay the arena out as ``layout`` from now on."""
        for i, entry in enumerate(self.kept):
            if entry[0] == layout:
                self.kept.append(self.kept.pop(i))
                return
        self.kept.append([layout, None])
        del self.kept[:-self.KEEP]

    def rename(self, renamed: dict[str, Any]) -> None:
        """Lay the arena out as the layout held now, under other names (and hash)."""
        self.use({**self.kept[-1][0], **renamed})

    def encoders(self, files: Any) -> Any:
        """The encoders of the layout held now (built by ``files``), or why it cannot be written."""
        entry = self.kept[-1]
        if entry[1] is None:
            entry[1] = files.encoders(entry[0], self.memory)
        return entry[1]


class _Sidecar:
    def __init__(self, req: Connection, req_sock: socket.socket, rep: Connection,
                 lock: ClaimLock) -> None:
        self.req = req
        self.req_sock = req_sock  # the socket under ``req``: slots' fds arrive on it
        self.rep = rep
        self.lock = lock
        # -> snapsvc.sidecar.writes.Files once imported (set by writer_main)
        self.later: _Later | None = None
        self.uploads_started = False
        self.slots: dict[int, _Slot] = {}
        self.parent: int | None = os.getppid()  # None: a service's session, no parent to watch
        self.stopping = False  # set by a service's SIGTERM: finish what is in the socket, end
        self.reports_lost = False
        self.orphaned = False  # the trainer died without STOP: linger may apply
        self.failures: list[dict[str, Any]] = []  # failed writes no trainer heard of
        self._send_lock = threading.Lock()  # the uploader thread reports too

    def files(self) -> Any:
        """The writing half (waits for its import); starts its uploader after READY."""
        assert self.later is not None
        files = self.later.get()
        if files.uploader is not None and not self.uploads_started:
            self.uploads_started = True
            files.uploader.start()
        return files

    def report(self, op: str, **fields: Any) -> None:
        with self._send_lock:
            if self.reports_lost:
                return
            try:
                self.rep.send_bytes(protocol.pack(op, **fields))
            except (BrokenPipeError, ConnectionResetError, OSError):
                # The trainer is gone; keep writing what it handed over.
                self.reports_lost = True
        if self.reports_lost and op == protocol.DONE and not fields.get("ok", True):
            self.failures.append({"path": fields["path"], "error": fields.get("error")})

    def claim(self, slot: _Slot, seq: int) -> bool:
        with self.lock:
            if WORD.unpack_from(slot.memory)[0] != seq:
                return False
            WORD.pack_into(slot.memory, 0, STARTED)
            return True

    def write(self, msg: dict[str, Any], trash: list[str]) -> dict[str, Any]:
        """Write one snapshot; its report. Files replaced or rotated away go
        to ``trash``, to be freed once the report is out."""
        files = self.files()  # the first write waits for the import: part of its queue time
        started = time.monotonic()
        seq, path = msg["seq"], msg["path"]
        base = {"seq": seq, "path": path, "queue_s": started - msg["sent_at"]}
        slot = self.slots.get(msg["slot"])
        if slot is not None:   # before the claim: even a superseded write tells what the
            if "layout" in msg:   # slot holds now
                slot.use(msg["layout"])
            elif "renamed" in msg:
                slot.rename(msg["renamed"])
        why = "was never registered with this writer" if slot is None else slot.encoders(files)
        if isinstance(why, str):  # a trainer bug, reported rather than fatal to every later write
            return {**base, "ok": False, "errno": None, "filename": path,
                    "error": f"slot {msg['slot']} {why}"}
        assert slot is not None   # an unknown slot's why is a str
        if not self.claim(slot, seq):
            return {**base, "ok": True, "superseded": True}
        return files.write(why, msg, base, trash,
                           sum(len(s.memory) for s in self.slots.values()))

    def recv_slot(self) -> mmap.mmap:
        """Map the shared memory whose fd follows a SLOT message (``SCM_RIGHTS``)."""
        _, fds, _, _ = socket.recv_fds(self.req_sock, 1, 1)
        if len(fds) != 1:  # the stream is out of step: nothing after this can be trusted
            raise OSError(f"a slot's file descriptor did not arrive ({len(fds)} came)")
        try:
            return mmap.mmap(fds[0], 0)  # all of it; the encoders check the layout's offsets
        finally:
            os.close(fds[0])  # the mapping keeps the memory

    def handle(self, msg: dict[str, Any]) -> bool:
        """Act on one message; False means stop."""
        op = msg["op"]
        if op == protocol.WRITE:
            trash: list[str] = []
            done = self.write(msg, trash)
            self.report(protocol.DONE, **done)
            self.files().upload(done)  # after the report: uploads are off the durable clock
            try:
                unlink_quietly(trash)  # freeing old data is not on the durable clock
            except OSError as e:  # a leftover temp name; the next start removes it
                log.warning("could not remove an old checkpoint's data: %s", e)
        elif op == protocol.SLOT:
            # Its fd is the next thing on the socket: read it before anything can fail.
            self.slots[msg["slot"]] = _Slot(self.recv_slot(), msg["layout"])
            self.report(protocol.SLOT_OK, slot=msg["slot"])
        elif op == protocol.UPLOAD:  # durable already: straight to the uploader
            self.files().upload({"ok": True, "seq": msg["seq"], "path": msg["path"]})
        elif op == protocol.FREE:
            for sid in msg["slots"]:
                self.slots.pop(sid, None)  # the last reference: the mapping and its fd go
        elif op == protocol.STOP:
            return False
        else:
            log.error("unknown control message %r", op)
        return True

    def run(self, options: dict[str, Any]) -> None:
        handed = False
        try:
            self.serve()
            if self.orphaned and options.get("linger") and options.get("directory"):
                linger = importlib.import_module(".linger", __package__)
                handed = linger.linger(self.files(), options.get("linger_key")
                                       or options["directory"], options["linger"],
                                       self.failures)
        finally:  # uploads get up to remote_timeout after the last message
            if self.later is not None and self.later.remote:
                self.files().close_uploads()
            if not handed and self.later is not None and (self.later.ready()
                                                          or options.get("held")):
                self.files().drop_ram()  # held as long as this sidecar, or its successor

    def serve(self) -> None:
        self.report(protocol.READY, pid=os.getpid())
        while True:
            if self.later is not None and self.later.ready():
                self.files().rotate_released()  # also starts the uploader, once imported
            if not self.req.poll(_PARENT_POLL_S):
                if self.stopping or (self.parent is not None and os.getppid() != self.parent):
                    log.warning("trainer %d is gone or the service stops; finishing what it "
                                "handed over", self.parent)
                    self.orphaned = True
                    self.drain()
                    return
                continue
            try:
                data = self.req.recv_bytes()
            except EOFError:  # the trainer closed its end without STOP: it died
                self.orphaned = True
                return
            if not self.handle(protocol.unpack(data)):
                return

    def drain(self) -> None:
        """After the parent died: handle every message already in the socket."""
        while self.req.poll(0):
            try:
                if not self.handle(protocol.unpack(self.req.recv_bytes())):
                    return
            except EOFError:
                return


class _Later:
    """Imports on a thread, from READY on; :meth:`get` waits for it (or raises its error)."""

    def __init__(self, load: Callable[[], Any], remote: bool = False) -> None:
        self._load = load
        self.remote = remote  # the loaded Files has an uploader to close at exit
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="snapsvc-import", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._value = self._load()
        except BaseException as e:  # noqa: BLE001 - raised by get() on the loop's thread
            self._error = e

    def ready(self) -> bool:
        """Loaded without error (then :meth:`get` does not wait)."""
        return not self._thread.is_alive() and self._error is None

    def get(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def boot() -> None:
    """Entry point of the sidecar's interpreter (see :mod:`snapsvc.engine.link`).

    Its arguments are the file descriptors it inherited: request socket,
    report pipe, sentinel and claim lock. Each is made non-inheritable, so
    nothing the writer might start keeps them (and the sentinel) open. The
    first message holds the pickled options.
    """
    req_fd, rep_fd, sentinel_fd, lock_fd = (int(a) for a in sys.argv[1:5])
    for fd in (req_fd, rep_fd, sentinel_fd, lock_fd):
        os.set_inheritable(fd, False)
    req = Connection(os.dup(req_fd))
    options = pickle.loads(req.recv_bytes())
    writer_main(req, socket.socket(fileno=req_fd), Connection(rep_fd, readable=False),
                ClaimLock(lock_fd), options)


def _batch_scheduling() -> None:
    """Run as a batch task (Linux ``SCHED_BATCH``, no privilege needed): its fair
    share of the CPU, but a WRITE that wakes it never preempts the trainer, whose
    submit is still returning (a woken sidecar at nice 0 took 1.5-4 ms of a
    Lightning save that way on 2 busy cores)."""
    policy = getattr(os, "SCHED_BATCH", None)
    if policy is None:
        return
    try:
        os.sched_setscheduler(0, policy, os.sched_param(0))
    except OSError as e:   # a container that forbids it: the default policy, still correct
        log.info("the writer sidecar keeps the default scheduling policy: %s", e)


def writer_main(req: Connection, req_sock: socket.socket, rep: Connection, lock: ClaimLock,
                options: dict[str, Any]) -> None:
    """The writer's loop, in its own process: the sidecar's ``boot`` calls it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Past RLIMIT_FSIZE a write should fail with EFBIG, not kill the sidecar.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    # Training must not wait on the sidecar: on a busy box it yields the CPU.
    os.nice(options.get("nice", 0))
    _batch_scheduling()
    hook = options.get("fault_hook")
    set_fault_hook(hook)
    if hook is not None:
        hook("start", "")

    side = _Sidecar(req, req_sock, rep, lock)
    remote = None
    if options.get("remote") is not None:
        remote = {k: options[k] for k in ("remote", "directory", "remote_keep_last",
                                          "remote_timeout", "remote_options")}
        # a rank of DistributedSnapshotWriter: no scan at start, its step's manifest
        # uncommitted, only its own files removed at start
        remote["remote_scan"] = options.get("remote_scan", True)
        remote["remote_uncommit"] = options.get("remote_uncommit", ())
        remote["remote_names"] = options.get("remote_names")  # its own files only

    def files() -> Any:
        writes = importlib.import_module(".writes", __package__)
        ramtier = importlib.import_module("..files.ramtier", __package__)
        return writes.Files(options.get("keep_last"), options.get("compress_level"),
                            options.get("written", ()), remote=remote, report=side.report,
                            keep_in_memory=options.get("keep_in_memory", 1),
                            # what a dead sidecar or service of the directory left in RAM
                            held=[*options.get("held", ()),
                                  *ramtier.adopt(options.get("directory"))],
                            memory_limit=options.get("memory_limit"))

    side.later = _Later(files, remote is not None)
    side.run(options)

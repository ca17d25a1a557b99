"""The writer sidecar process as the trainer sees it: start, handshake, reports, death.

One :class:`Sidecar` owns one process at a time (a *generation*): its pipes,
the claim lock both sides share, and the reader thread that delivers its
reports. The process loop itself is :func:`snapsvc.engine.worker.writer_main`.

Death is seen through the process sentinel, never by waiting for a message:
the reader thread waits on ``[report pipe, sentinel]`` and, when the process
is gone, calls ``on_exit(gen, proc)`` once, after every report already in the
pipe. ``is_alive()`` is never used: it would ``waitpid`` and race the reader's
``join`` for the exit status.

Slots travel as file descriptors over a Unix socket of their own
(``SCM_RIGHTS``), each sent just before its SLOT message: if the process dies
before it reads one, the kernel closes the fds still in flight with the
socket. (Pickled down the pipe instead, a slot's fd would wait in this
process's ``multiprocessing`` resource sharer for a reader that never comes.)

A child of ``os.fork()`` inherits the parent's ``multiprocessing`` list of
children, sidecars included, and at its exit ``multiprocessing`` would
SIGTERM every daemonic one: in the child the sidecars are taken off that
list at once (:func:`_disown_in_child`). The owner refuses every other call
from a child (:class:`~snapsvc.engine.writer.SnapshotWriter` checks the pid).

Locking. :meth:`start` and :meth:`reap` change which process this is; the
owner calls them under its own lifecycle lock, never concurrently.
:meth:`send` may be called from any thread: ``_send_lock`` keeps a message
and the pickled storage that follows it together on the pipe. The callbacks
run on the reader thread with no lock of this class held.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import weakref
from multiprocessing import process as mp_process
from multiprocessing.connection import wait
from typing import Any, Callable

from ..errors import BrokenWriterError
from ..format import protocol
from . import staging
from .worker import writer_main

__all__ = ["Sidecar", "describe"]

log = logging.getLogger("snapsvc")

START_TIMEOUT = 120.0  # spawn + import torch on a loaded 2-core box can be slow
_started: "weakref.WeakSet[Sidecar]" = weakref.WeakSet()


def _disown_in_child() -> None:
    """After a fork, in the child: the parent's sidecars are not this process's
    children; multiprocessing's exit handler must not terminate them."""
    for sidecar in list(_started):
        if sidecar.proc is not None:
            mp_process._children.discard(sidecar.proc)


os.register_at_fork(after_in_child=_disown_in_child)


class Sidecar:
    """The current writer process, its pipes and its reader thread."""

    def __init__(self, ctx: Any, options: dict[str, Any],
                 on_report: Callable[[int, dict[str, Any]], None],
                 on_exit: Callable[[int, Any], None]) -> None:
        self._ctx = ctx
        self._options = options
        self._on_report = on_report
        self._on_exit = on_exit
        self._send_lock = threading.Lock()
        self.gen = 0
        self.proc: Any = None
        self.claim_lock: staging.ClaimLock | None = None
        self.reader: threading.Thread | None = None
        self._req: Any = None
        self._fds: socket.socket | None = None  # slots' fds go down it (see the module docstring)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, timeout: float = START_TIMEOUT) -> int:
        """Spawn a process, wait for its READY (or its death), start the reader; the new gen."""
        req_r, req_w = self._ctx.Pipe(duplex=False)
        rep_r, rep_w = self._ctx.Pipe(duplex=False)
        fds_r, fds_w = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        lock = staging.ClaimLock.create()
        proc = self._ctx.Process(target=writer_main,
                                 args=(req_r, rep_w, lock, self._options, fds_r),
                                 name="snapsvc-writer", daemon=True)
        try:
            proc.start()
        except BaseException:
            for end in (req_r, req_w, rep_r, rep_w, lock, fds_r, fds_w):
                end.close()
            raise
        for end in (req_r, rep_w, fds_r):  # our copies of the child's ends: EOF must
            end.close()                    # mean the peer is gone, and its death frees the fds
        msg = None
        if rep_r in wait([rep_r, proc.sentinel], timeout=timeout):
            try:
                msg = protocol.unpack(rep_r.recv_bytes())
            except (EOFError, OSError, ValueError):
                pass
        if msg is None or msg["op"] != protocol.READY:
            if not wait([proc.sentinel], timeout=5):  # exiting, or hung: give it 5 s
                proc.kill()
            proc.join(5)
            for end in (req_w, rep_r, lock, fds_w):
                end.close()
            raise BrokenWriterError(f"the writer sidecar did not start: {describe(proc)}")
        self.gen += 1
        self.proc, self._req, self._fds, self.claim_lock = proc, req_w, fds_w, lock
        self.reader = threading.Thread(target=self._read, args=(self.gen, rep_r, proc),
                                       name="snapsvc-reports", daemon=True)
        self.reader.start()
        _started.add(self)
        return self.gen

    def send(self, data: bytes, slot: Any = None) -> bool:
        """Send one message (a SLOT message: with the fd of the slot's shared
        memory ``slot``, sent first); False if the process is gone."""
        try:
            with self._send_lock:
                if slot is not None:
                    fd, _ = slot.untyped_storage()._share_fd_cpu_()
                    socket.send_fds(self._fds, [b"s"], [fd])
                self._req.send_bytes(data)
            return True
        except (BrokenPipeError, ConnectionResetError, OSError, AttributeError) as e:
            # Dead (or reaped: _req is None): the reader thread fails what is pending.
            log.debug("send to the writer failed: %s", e)
            return False

    def exited(self) -> bool:
        """Has the current process exited? (through its sentinel)"""
        return self.proc is not None and bool(wait([self.proc.sentinel], timeout=0))

    def wait_exit(self, timeout: float | None) -> bool:
        return bool(wait([self.proc.sentinel], timeout))

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()

    def join_reader(self, timeout: float = 10.0) -> None:
        if self.reader is not None and self.reader is not threading.current_thread():
            self.reader.join(timeout)

    def reap(self) -> None:
        """Forget a dead or stopped process: join its reader, close our ends."""
        self.join_reader()
        with self._send_lock:
            for end in (self._req, self._fds):
                if end is not None:
                    end.close()
            self._req = self._fds = None
        if self.proc is not None:
            self.proc.join(5)
        if self.claim_lock is not None:
            self.claim_lock.close()
        self.proc = self.reader = self.claim_lock = None

    def _read(self, gen: int, rep: Any, proc: Any) -> None:
        try:
            while True:
                ready = wait([rep, proc.sentinel])  # the sentinel is the way out
                if rep in ready:
                    try:
                        data = rep.recv_bytes()
                    except (EOFError, OSError):
                        data = None
                    if data is not None:
                        self._on_report(gen, protocol.unpack(data))
                        continue
                break
        except BaseException:  # a bug here must not leave handles waiting forever
            log.exception("snapsvc: reading the writer's reports failed; stopping it")
            proc.kill()
        finally:
            rep.close()
        proc.join(5)
        self._on_exit(gen, proc)


def describe(proc: Any) -> str:
    """How a writer process ended (or that it did not answer)."""
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

"""The writer sidecar process as the trainer sees it: start, handshake, reports, death.

One :class:`Sidecar` owns one process at a time (a *generation*): its
channels, the claim lock both sides share, and the reader thread that
delivers its reports. The process loop itself is :func:`snapsvc.sidecar.worker.writer_main`.

The process is a fresh interpreter of its own (``sys.executable -c``, given
the trainer's ``sys.path``), not a ``multiprocessing`` child: it never
imports the trainer's ``__main__``, so a script needs no
``if __name__ == "__main__"`` guard, ``python -c``, a REPL and a notebook
work, and a script's heavy imports (transformers, lightning) never slow the
sidecar's start. What it needs travels as inherited file descriptors
(``pass_fds``): the request socket, the report pipe, the claim lock and the
write end of a sentinel pipe. Its options (with a picklable ``fault_hook``)
are the first message; each slot's shared memory follows its ``SLOT``
message as a file descriptor (``SCM_RIGHTS`` on the Unix request socket).

Death is seen through the sentinel, never by waiting for a message: the
sentinel pipe's read end, as ``multiprocessing`` does it, reads EOF once the
process has exited (only the sidecar holds the write end). The reader thread
waits on ``[report pipe, sentinel]`` and, when the process is gone, calls
``on_exit(gen, proc)`` once, after every report already in the pipe.

Locking. :meth:`start` and :meth:`reap` change which process this is; the
owner calls them under its own lifecycle lock, never concurrently.
:meth:`send` may be called from any thread: ``_send_lock`` keeps a message
and the file descriptor that follows it together on the socket. The
callbacks run on the reader thread with no lock of this class held.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

from ..errors import BrokenWriterError
from ..format import protocol
from ..format.claims import ClaimLock

__all__ = ["Sidecar", "describe", "nice_of"]

log = logging.getLogger("snapsvc")

START_TIMEOUT = 120.0  # a bare interpreter answers in about a second; generous for a loaded box
# The whole program of the sidecar's interpreter: the trainer's import path
# (so it imports this very snapsvc, and tests' hooks), then the writer's
# entry. The package's __init__ (it imports torch: seconds, ~220 MB) is
# registered but never run: nothing the sidecar imports needs torch.
_BOOT = ("import sys, importlib.util as u; sys.path[:] = {path!r}; "
         "s = u.find_spec('snapsvc'); sys.modules['snapsvc'] = u.module_from_spec(s); "
         "from snapsvc.sidecar.worker import boot; boot()")


def nice_of(nice: int | None) -> int:
    """The sidecar's nice increment: ``nice``, or for None, 10 beside a training
    process that has initialized CUDA (its CPU is spare) and 0 beside one that
    trains on the CPU (a niced writer would starve, and saves wait for it)."""
    if nice is not None:
        return nice
    torch = sys.modules.get("torch")   # not imported here: the sidecar side needs no torch
    return 10 if torch is not None and torch.cuda.is_initialized() else 0


class Process:
    """The sidecar's interpreter: its ``Popen`` and the sentinel that reads EOF once it exited."""

    def __init__(self, popen: subprocess.Popen, sentinel: int) -> None:
        self._popen = popen
        self.pid = popen.pid
        self.sentinel = sentinel

    @property
    def exitcode(self) -> int | None:
        """The exit status (minus the signal that killed it), None while it runs."""
        return self._popen.poll()

    def kill(self) -> None:
        self._popen.kill()  # a no-op once it has been reaped

    def join(self, timeout: float) -> None:
        """Reap it if it exits within ``timeout`` seconds."""
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def close(self) -> None:
        os.close(self.sentinel)


class Sidecar:
    """The current writer process, its channels and its reader thread."""

    def __init__(self, options: dict[str, Any],
                 on_report: Callable[[int, dict[str, Any]], None],
                 on_exit: Callable[[int, Any], None]) -> None:
        self._options = options
        self._on_report = on_report
        self._on_exit = on_exit
        self._send_lock = threading.Lock()
        self.gen = 0
        self.proc: Process | None = None
        self.claim_lock: ClaimLock | None = None
        self.reader: threading.Thread | None = None
        self._req: Connection | None = None
        self._req_sock: socket.socket | None = None  # the same socket, for SCM_RIGHTS

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, timeout: float = START_TIMEOUT) -> int:
        """Start an interpreter, wait for its READY (or its death), start the reader; the new gen."""
        options = pickle.dumps({**self._options, "nice": nice_of(self._options.get("nice"))})
        # (an unpicklable hook fails here, not there)
        req_sock, child_req = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        rep_r, child_rep = os.pipe()
        sentinel, child_sentinel = os.pipe()
        lock = ClaimLock.create()
        fds = (child_req.fileno(), child_rep, child_sentinel, lock.fd)
        try:
            popen = subprocess.Popen(
                [sys.executable, "-c", _BOOT.format(path=sys.path), *map(str, fds)],
                pass_fds=fds, stdin=subprocess.DEVNULL)
        except BaseException:
            for fd in (rep_r, sentinel):
                os.close(fd)
            req_sock.close()
            lock.close()
            raise
        finally:  # our copies of the child's ends: EOF must mean the peer is gone
            child_req.close()
            os.close(child_rep)
            os.close(child_sentinel)
        proc = Process(popen, sentinel)
        req = Connection(os.dup(req_sock.fileno()))
        rep = Connection(rep_r, writable=False)
        msg = None
        try:
            req.send_bytes(options)
        except OSError:  # died at once; described below
            pass
        if rep in wait([rep, sentinel], timeout=timeout):
            try:
                msg = protocol.unpack(rep.recv_bytes())
            except (EOFError, OSError, ValueError):
                pass
        if msg is None or msg["op"] != protocol.READY:
            if not wait([sentinel], timeout=5):  # exiting, or hung: give it 5 s
                proc.kill()
            proc.join(5)
            for end in (req, req_sock, rep, proc, lock):
                end.close()
            raise BrokenWriterError(f"the writer sidecar did not start: {describe(proc)}")
        self.gen += 1
        self.proc, self._req, self._req_sock, self.claim_lock = proc, req, req_sock, lock
        self.reader = threading.Thread(target=self._read, args=(self.gen, rep, proc),
                                       name="snapsvc-reports", daemon=True)
        self.reader.start()
        return self.gen

    def send(self, data: bytes, fd: int | None = None) -> bool:
        """Send one message (and a slot's shared-memory fd after it); False if the process is gone."""
        try:
            with self._send_lock:
                self._req.send_bytes(data)  # type: ignore[union-attr]
                if fd is not None:
                    socket.send_fds(self._req_sock, [b"\0"], [fd])  # type: ignore[arg-type]
            return True
        except (BrokenPipeError, ConnectionResetError, OSError, AttributeError) as e:
            # Dead (or reaped: _req is None): the reader thread fails what is pending.
            log.debug("send to the writer failed: %s", e)
            return False

    def exited(self) -> bool:
        """Has the current process exited? (through its sentinel)"""
        return self.proc is not None and bool(wait([self.proc.sentinel], timeout=0))

    def wait_exit(self, timeout: float | None) -> bool:
        return bool(wait([self.proc.sentinel], timeout))  # type: ignore[union-attr]

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
            for end in (self._req, self._req_sock):
                if end is not None:
                    end.close()
            self._req = self._req_sock = None
        if self.proc is not None:
            self.proc.join(5)
            self.proc.close()
        if self.claim_lock is not None:
            self.claim_lock.close()
        self.proc = self.reader = self.claim_lock = None

    def _read(self, gen: int, rep: Connection, proc: Process) -> None:
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


def describe(proc: Process | None) -> str:
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

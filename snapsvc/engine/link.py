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

Signals. A message goes out whole or not at all: one *sender* thread per
generation writes every message (and the slot fd after it) to the socket.
Python runs signal handlers on the main thread only, so a Ctrl-C or a
SIGTERM (turned into ``SystemExit``) that arrives while a large WRITE waits
for a busy sidecar interrupts the caller's wait, never the send: a message
cut half-way would make the sidecar read the next bytes as its body. The
replies (reports) are read on the reader thread for the same reason, and a
signal during :meth:`start` stops the half-started process.

Locking. :meth:`start` and :meth:`reap` change which process this is; the
owner calls them under its own lifecycle lock, never concurrently.
:meth:`post` and :meth:`send` may be called from any thread: the sender
keeps a message and the file descriptor that follows it together on the
socket, in the order they were posted. The callbacks run on the reader
thread with no lock of this class held.
"""

from __future__ import annotations

import errno
import logging
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

from ..errors import BrokenWriterError, UnsafePathError
from ..files.rendezvous import HELLO, peer_uid
from ..format import protocol
from ..format.claims import ClaimLock

__all__ = ["Sidecar", "Sent", "describe", "nice_of", "ServiceProcess", "ServiceUnavailable"]

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


class Sent:
    """One posted message: :meth:`wait` for whether it reached the socket whole."""

    def __init__(self, data: bytes, fd: int | None) -> None:
        self.data, self.fd = data, fd
        self.ok = False
        self._done = threading.Event()

    def wait(self) -> bool:
        """True once sent, False if the process was gone. A signal interrupts
        only this wait: the message still goes out whole."""
        self._done.wait()
        return self.ok

    def finish(self, ok: bool) -> None:
        self.ok = ok
        self._done.set()


def _send_all(outbox: "queue.SimpleQueue[Sent | None]", req: Connection,
              req_sock: socket.socket) -> None:
    """The sender thread of one generation: write each posted message whole, in order."""
    while (job := outbox.get()) is not None:
        ok = False
        try:
            req.send_bytes(job.data)
            if job.fd is not None:
                socket.send_fds(req_sock, [b"\0"], [job.fd])
            ok = True
        except (OSError, ValueError) as e:  # dead (EPIPE), or our end closed
            log.debug("send to the writer failed: %s", e)
        finally:
            job.finish(ok)


class Sidecar:
    """The current writer process, its channels and its reader thread."""

    def __init__(self, options: dict[str, Any],
                 on_report: Callable[[int, dict[str, Any]], None],
                 on_exit: Callable[[int, Any], None]) -> None:
        self._options = options
        self._on_report = on_report
        self._on_exit = on_exit
        self._send_lock = threading.Lock()  # guards _outbox: nothing is posted after the stop
        self._outbox: queue.SimpleQueue[Sent | None] | None = None
        self._sender: threading.Thread | None = None
        self.gen = 0
        self.proc: Process | ServiceProcess | None = None
        self.claim_lock: ClaimLock | None = None
        self.reader: threading.Thread | None = None
        self._req: Connection | None = None
        self._req_sock: socket.socket | None = None  # the same socket, for SCM_RIGHTS
        self.service_info: dict[str, Any] | None = None  # a service's HELLO, when attached to one

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, timeout: float = START_TIMEOUT, service: str | None = None) -> int:
        """Start an interpreter (or attach to the ``snapsvc serve`` listening on
        ``service``), wait for its READY (or its death), start the reader; the new gen."""
        proc: Process | ServiceProcess
        if service is not None:
            proc, req, req_sock, rep, lock, self.service_info = _connect(
                service, self._options.get("remote"), timeout, self._options.get("memory_limit"))
        else:
            proc, req, req_sock, rep, lock = self._spawn()
            self.service_info = None
        msg = None
        try:
            if service is None:
                try:
                    req.send_bytes(pickle.dumps({**self._options,
                                                 "nice": nice_of(self._options.get("nice"))}))
                except OSError:  # died at once; described below
                    pass
            if rep in wait([rep, proc.sentinel], timeout=timeout):
                try:
                    msg = protocol.unpack(rep.recv_bytes())
                except (EOFError, OSError, ValueError):
                    pass
        except BaseException:  # a Ctrl-C while it boots: no half-started process is left
            proc.kill()
            proc.join(5)
            for end in (req, req_sock, rep, proc, lock):
                end.close()
            raise
        if msg is None or msg["op"] != protocol.READY:
            if not wait([proc.sentinel], timeout=5):  # exiting, or hung: give it 5 s
                proc.kill()
            proc.join(5)
            for end in (req, req_sock, rep, proc, lock):
                end.close()
            raise BrokenWriterError(f"the writer sidecar did not start: {describe(proc)}")
        self.gen += 1
        self.proc, self._req, self._req_sock, self.claim_lock = proc, req, req_sock, lock
        self._outbox = queue.SimpleQueue()
        self._sender = threading.Thread(target=_send_all, args=(self._outbox, req, req_sock),
                                        name="snapsvc-sender", daemon=True)
        self._sender.start()
        self.reader = threading.Thread(target=self._read, args=(self.gen, rep, proc),
                                       name="snapsvc-reports", daemon=True)
        self.reader.start()
        return self.gen

    def _spawn(self) -> tuple[Process, Connection, socket.socket, Connection, ClaimLock]:
        """A fresh sidecar interpreter and our ends of its channels."""
        pickle.dumps(self._options)  # an unpicklable hook fails here, not there
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
        return (Process(popen, sentinel), Connection(os.dup(req_sock.fileno())), req_sock,
                Connection(rep_r, writable=False), lock)

    def post(self, data: bytes, fd: int | None = None) -> Sent | None:
        """Queue one message (and a slot's shared-memory fd after it) for the
        sender thread; None if the process is reaped. ``fd`` must stay open
        until the message is sent."""
        with self._send_lock:
            if self._outbox is None:
                return None
            job = Sent(data, fd)
            self._outbox.put(job)
            return job

    def send(self, data: bytes, fd: int | None = None) -> bool:
        """Send one message and wait for it; False if the process is gone (the
        reader thread then fails what is pending)."""
        job = self.post(data, fd)
        return job is not None and job.wait()

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
            if self._outbox is not None:
                self._outbox.put(None)
            self._outbox = None
        if self._sender is not None:  # the process is gone: a blocked send fails at once
            self._sender.join(10)
            self._sender = None
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

    def _read(self, gen: int, rep: Connection, proc: Process | ServiceProcess) -> None:
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


class ServiceUnavailable(BrokenWriterError):
    """No ``snapsvc serve`` answers on a socket, or it refused this trainer.
    ``dead``: nothing listens there (refused, or no socket file): the service is gone."""

    dead = False


class ServiceProcess:
    """A ``snapsvc serve`` service as one generation sees it: its sentinel reads
    EOF once the service ended this trainer's session (or died); never killed."""

    def __init__(self, pid: int, sentinel: int, sock: socket.socket, path: str) -> None:
        self.pid, self.sentinel, self.path = pid, sentinel, path
        self._sock = sock

    @property
    def exitcode(self) -> int | None:
        return None

    def kill(self) -> None:
        """End this session (the service lives on): it reads EOF after what it was sent."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def join(self, timeout: float) -> None:
        pass

    def close(self) -> None:
        os.close(self.sentinel)
        self._sock.close()


def _connect(path: str, remote: str | None, timeout: float, memory: int | None) -> tuple[
        ServiceProcess, Connection, socket.socket, Connection, ClaimLock, dict[str, Any]]:
    """Attach to the service on ``path``: hello (with the trainer's ``memory_limit``) and
    the claim lock's fd out, its hello and the session's sentinel back (``SCM_RIGHTS``)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(min(timeout, 10.0))
    try:
        sock.connect(path)
        uid = peer_uid(sock)
        if uid != os.getuid():
            raise UnsafePathError(f"{path} is served by uid {uid}, not this user (uid "
                                  f"{os.getuid()}): refused; run the service as this user")
        lock = ClaimLock.create()
        conn = None
        try:
            conn = Connection(os.dup(sock.fileno()))
            conn.send_bytes(protocol.pack(HELLO, pid=os.getpid(), remote=remote, memory=memory))
            socket.send_fds(sock, [b"\0"], [lock.fd])
            msg = protocol.unpack(conn.recv_bytes()) if conn.poll(timeout) else None
            if msg is None or msg["op"] != HELLO:
                why = msg.get("error") if msg else f"no answer in {timeout:.0f} s"
                raise ServiceUnavailable(f"the snapsvc service on {path} refused this trainer: "
                                         f"{why}")
            _, fds, _, _ = socket.recv_fds(sock, 1, 1)
            if len(fds) != 1:
                raise ServiceUnavailable(f"the snapsvc service on {path} sent no sentinel")
        except BaseException:
            lock.close()
            if conn is not None:
                conn.close()
            raise
    except EOFError:
        sock.close()
        raise ServiceUnavailable(f"the snapsvc service on {path} hung up (it runs as another "
                                 "user, or it is stopping)") from None
    except OSError as e:  # nothing listens (ENOENT, ECONNREFUSED), or it hung up
        sock.close()
        if isinstance(e, UnsafePathError):
            raise
        gone = ServiceUnavailable(f"no snapsvc service answers on {path} ({e}); start one "
                                  f"with `snapsvc serve DIRECTORY --socket {path}`")
        gone.dead = e.errno in (errno.ECONNREFUSED, errno.ENOENT)
        raise gone from None
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    proc = ServiceProcess(msg["pid"], fds[0], socket.socket(fileno=os.dup(sock.fileno())), path)
    return (proc, conn, sock, Connection(os.dup(sock.fileno()), writable=False), lock,
            {k: v for k, v in msg.items() if k != "op"})


def describe(proc: Process | ServiceProcess | None) -> str:
    """How a writer process ended (or that it did not answer)."""
    if proc is None:
        return "is not running"
    if isinstance(proc, ServiceProcess):
        return f"service on {proc.path} (pid {proc.pid}) ended this trainer's session or died"
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

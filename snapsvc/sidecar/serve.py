"""``snapsvc serve``: the sidecar as a service of its own, for one trainer at a time.

A daemon or a sidecar container that outlives its trainers. It listens on a
Unix socket (the directory's rendezvous socket, or ``--socket``) and registers
that socket for its directory (:func:`snapsvc.files.rendezvous.register_service`),
so a plain ``SnapshotWriter(directory)`` finds it. Each trainer that connects
gets a *session*: the worker loop of :mod:`snapsvc.sidecar.worker`, the same
messages and slot fds, on that one socket both ways::

    trainer                                  service
    HELLO pid, remote + claim lock's fd  ->
                                         <-  HELLO pid, held, failures + the session's sentinel
                                         <-  READY, then the worker loop (SLOT, WRITE, ...)

The sentinel is a pipe's read end: the trainer reads EOF once its session
ended (its STOP, its death) or the service died. The RAM copies, the
``keep_last`` series and the uploader belong to the service (one
:class:`~snapsvc.sidecar.writes.Files`), so they outlast every session; a
write that failed after its trainer died is reported to the next one at its
HELLO. A second trainer while one is attached is refused (``BUSY``) and
starts a sidecar of its own. Both ends check the peer's uid (``SO_PEERCRED``).
SIGTERM or SIGINT: the session finishes what is in its socket, then the
socket, the record and the RAM copies go. No torch here.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import threading
from multiprocessing.connection import Connection
from typing import Any

from ..files.ramtier import adopt
from ..files.rendezvous import (BUSY, HELLO, peer_uid, register_service, socket_path,
                                unregister_service)
from ..format import protocol
from ..format.claims import ClaimLock
from .linger import _listen
from .worker import _Later, _Sidecar
from .writes import Files

__all__ = ["Service"]

log = logging.getLogger("snapsvc.writer")

_HELLO_TIMEOUT = 10.0


class _Routed:
    """The service's Files as one session uses it: the seqs it uploads are noted,
    so an upload of an earlier trainer is never reported to this one."""

    def __init__(self, files: Files, seqs: set[int]) -> None:
        self._files, self._seqs = files, seqs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._files, name)

    def upload(self, done: dict[str, Any]) -> None:
        self._seqs.add(done["seq"])
        self._files.upload(done)


class Service:
    """One ``snapsvc serve``: :meth:`run` until SIGTERM/SIGINT."""

    def __init__(self, directory: str, *, sock: str | None = None, keep_last: int | None = None,
                 remote: str | None = None, keep_in_memory: int = 1,
                 remote_timeout: float = 300.0, memory: int | None = None) -> None:
        self.directory = os.path.abspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        path = sock or socket_path(self.directory, create=True)
        assert path is not None
        self.path = os.path.abspath(path)
        self.remote = remote
        spec: dict[str, Any] | None = None if remote is None else {
            "remote": remote, "directory": self.directory, "remote_keep_last": None,
            "remote_timeout": remote_timeout, "remote_options": {}, "remote_scan": True,
            "remote_uncommit": (), "remote_names": None}
        self.memory = memory  # --memory: slots plus RAM copies (a trainer's lower limit too)
        self.files = Files(keep_last, None, (), remote=spec, report=self._upload_report,
                           keep_in_memory=keep_in_memory, memory_limit=memory,
                           held=adopt(self.directory))  # what a dead one left in RAM
        self.session: _Sidecar | None = None
        self.seqs: set[int] = set()  # the current session's uploads
        self.failures: list[dict[str, Any]] = []  # writes failed after their trainer left
        self.stopping = False
        self._busy = threading.Lock()  # held while a trainer is attached (or queued)
        self._inbox: queue.Queue[socket.socket] = queue.Queue()

    def _upload_report(self, op: str, **fields: Any) -> None:
        """An upload's outcome (uploader thread): to the trainer that asked for it, if attached."""
        side = self.session
        if side is None or fields.get("seq") not in self.seqs:
            if fields.get("error"):
                log.error("uploading %s failed: %s", fields.get("path"), fields["error"])
            return
        side.report(op, **fields)

    def _stop(self, signum: int, frame: object) -> None:
        self.stopping = True
        side = self.session
        if side is not None:
            side.stopping = True

    def run(self) -> None:
        """Serve trainers one at a time until SIGTERM or SIGINT; then clean up."""
        server = _listen(self.path)
        if server is None:
            raise OSError(f"something else listens on {self.path} (a service or a lingering "
                          "sidecar of this directory): stop it, or pass another --socket")
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._stop)
        acceptor = threading.Thread(target=self._accept, args=(server,), name="snapsvc-accept",
                                    daemon=True)
        try:
            register_service(self.directory, self.path)
            if self.files.uploader is not None:
                self.files.uploader.start()
            acceptor.start()
            print(f"snapsvc serve: {self.directory} on {self.path} (pid {os.getpid()})",
                  flush=True)
            while not self.stopping:
                try:
                    peer = self._inbox.get(timeout=0.5)
                except queue.Empty:
                    self.files.rotate_released()
                    continue
                self._session(peer)  # releases _busy
        finally:
            self.stopping = True
            if acceptor.is_alive():
                acceptor.join(5)
            server.close()
            while not self._inbox.empty():
                self._inbox.get().close()
            for end in (lambda: os.unlink(self.path),
                        lambda: unregister_service(self.directory, self.path)):
                try:
                    end()
                except FileNotFoundError:
                    pass
            if self.remote is not None:
                self.files.close_uploads()
            self.files.drop_ram()

    def _accept(self, server: socket.socket) -> None:
        """Hand each connection of this user to the loop, or refuse it while one is attached."""
        server.settimeout(0.5)
        while not self.stopping:
            try:
                peer, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            peer.settimeout(None)
            uid = peer_uid(peer)
            if uid != os.getuid():
                log.error("refused a connection from uid %d (this service runs as uid %d)",
                          uid, os.getuid())
                peer.close()
            elif self._busy.acquire(blocking=False):
                self._inbox.put(peer)
            else:
                self._refuse(peer, "another trainer is attached to it (one at a time)")

    def _refuse(self, peer: socket.socket, why: str) -> None:
        """Answer a trainer's HELLO with BUSY and hang up (its claim lock's fd is dropped)."""
        conn = Connection(os.dup(peer.fileno()))
        try:
            if conn.poll(_HELLO_TIMEOUT) and protocol.unpack(conn.recv_bytes())["op"] == HELLO:
                for fd in socket.recv_fds(peer, 1, 1)[1]:  # read before we answer and hang up
                    os.close(fd)
            conn.send_bytes(protocol.pack(BUSY, error=why))
        except (EOFError, OSError, ValueError) as e:
            log.warning("refusing a trainer failed: %s", e)
        finally:
            conn.close()
            peer.close()

    def _session(self, peer: socket.socket) -> None:
        """Serve one trainer until its STOP, its death or our SIGTERM."""
        conn = rep = None
        sentinel_r = sentinel_w = -1
        lock: ClaimLock | None = None
        try:
            conn = Connection(os.dup(peer.fileno()))
            rep = Connection(os.dup(peer.fileno()), readable=False)
            sentinel_r, sentinel_w = os.pipe()
            if not conn.poll(_HELLO_TIMEOUT):
                return
            hello = protocol.unpack(conn.recv_bytes())
            _, fds, _, _ = socket.recv_fds(peer, 1, 1)
            if fds:
                lock = ClaimLock(fds[0])
            if hello["op"] != HELLO or lock is None:
                return
            if hello.get("remote") not in (None, self.remote):
                conn.send_bytes(protocol.pack(BUSY, error=(
                    f"the trainer's remote={hello['remote']!r} is not the service's "
                    f"--remote {self.remote!r}")))
                return
            failures, self.failures = self.failures, []
            conn.send_bytes(protocol.pack(HELLO, pid=os.getpid(), held=self.files.held(),
                                          failures=failures, remote=self.remote,
                                          memory=self.memory))
            limits = [v for v in (self.memory, hello.get("memory")) if v is not None]
            self.files.memory_limit = min(limits) if limits else None  # for this session
            socket.send_fds(peer, [b"\0"], [sentinel_r])
            os.close(sentinel_r)
            sentinel_r = -1
            log.info("trainer %s attached", hello.get("pid"))
            side = _Sidecar(conn, peer, rep, lock)
            side.parent = None  # no parent to watch: EOF, STOP or SIGTERM end the session
            side.stopping = self.stopping
            self.seqs = set()
            side.later = _Later(lambda: _Routed(self.files, self.seqs))
            side.uploads_started = True  # the service's uploader, started once
            self.session = side
            try:
                side.serve()
            finally:
                self.session = None
                self.failures += side.failures
                self.files.memory_limit = self.memory
            log.info("trainer %s detached", hello.get("pid"))
        except (EOFError, OSError, ValueError) as e:
            log.warning("a trainer's session failed: %s", e)
        finally:
            # free before the trainer sees its sentinel close: the trainer it hands over
            # to may connect the moment its close() returns
            self._busy.release()
            for fd in (sentinel_r, sentinel_w):
                if fd >= 0:
                    os.close(fd)
            for end in (conn, rep, peer):
                if end is not None:
                    end.close()
            if lock is not None:
                lock.close()

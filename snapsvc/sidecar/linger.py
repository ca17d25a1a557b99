"""A sidecar whose trainer died waits ``linger`` seconds for the next one.

By then it has written everything the dead trainer handed over (the loop's
drain). It keeps its RAM copies (:mod:`snapsvc.files.ramtier`), so
``snapsvc.load`` of a memory-only snapshot works meanwhile, and listens on its
directory's socket (:mod:`snapsvc.files.rendezvous`). A new writer of the same
user that connects takes over its RAM copies, its ``keep_last`` files and the
failures it could not report; then this process exits without freeing the RAM
copies (the new sidecar owns them now). At the deadline it exits and frees them.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import stat
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

from ..files.rendezvous import ATTACH, peer_uid, socket_path
from ..format import protocol

__all__ = ["linger"]

log = logging.getLogger("snapsvc.writer")


def _listen(path: str) -> socket.socket | None:
    """Bind ``path``, replacing a stale socket of ours; None when a live one serves it."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid():
            log.error("%s is not a socket of this user: not lingering", path)
            return None
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
            log.warning("another sidecar lingers for this directory (%s): not lingering", path)
            return None
        except OSError:  # stale: its sidecar is gone
            os.unlink(path)
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket is 0600 from its first moment
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    sock.listen(4)
    return sock


def linger(files: Any, directory: str, seconds: float, failures: list[dict[str, Any]]) -> bool:
    """Wait up to ``seconds`` for a trainer to attach; True when one took over."""
    path = socket_path(directory, create=True)
    assert path is not None
    # A SIGTERM (docker stop, a job's end) unwinds: the socket and the RAM copies go.
    # One that comes while the socket is being made waits until its removal is armed
    # (it came at once where a test SIGTERMs the sidecar the moment the socket shows up).
    term: dict[str, bool] = {"armed": False, "caught": False}

    def on_term(signum: int, frame: object) -> None:
        if term["armed"]:
            sys.exit(128 + signum)
        term["caught"] = True

    signal.signal(signal.SIGTERM, on_term)
    server = _listen(path)
    if server is None:
        if term["caught"]:
            sys.exit(128 + signal.SIGTERM)
        return False
    deadline = time.monotonic() + seconds
    log.warning("the trainer is gone; lingering %.0f s on %s for the next one", seconds, path)
    try:
        term["armed"] = True
        if term["caught"]:
            sys.exit(128 + signal.SIGTERM)
        while (left := deadline - time.monotonic()) > 0:
            server.settimeout(min(left, 0.5))
            try:
                peer, _ = server.accept()
            except TimeoutError:
                files.rotate_released()
                continue
            if peer_uid(peer) != os.getuid():  # only the same user gets in
                log.error("refused a connection from uid %d", peer_uid(peer))
                peer.close()
                continue
            conn = Connection(peer.detach())
            try:
                if not conn.poll(5) or protocol.unpack(conn.recv_bytes())["op"] != ATTACH:
                    continue
                conn.send_bytes(protocol.pack(ATTACH, pid=os.getpid(), held=files.held(),
                                              written=files.written_files(), failures=failures))
                return True
            except (EOFError, OSError, ValueError) as e:
                log.warning("an attach failed: %s", e)
            finally:
                conn.close()
        return False
    finally:
        server.close()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

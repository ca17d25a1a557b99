"""Where a lingering sidecar waits for the next trainer of its directory.

A sidecar whose trainer died without ``close()`` (``SnapshotWriter(linger=>0)``)
listens on a Unix socket named by a hash of its checkpoint directory, in the
user's runtime folder: ``$XDG_RUNTIME_DIR/snapsvc`` or ``/tmp/snapsvc-<uid>``,
mode 0700 (a symlink, a foreign owner or open modes are refused with
:class:`~snapsvc.errors.UnsafePathError`). The socket's path is the record: a
new writer on that directory finds it there. Both ends check the other's uid
with ``SO_PEERCRED``. No torch: both the trainer and the sidecar import this.
"""

from __future__ import annotations

import hashlib
import os
import socket
import struct
from multiprocessing.connection import Connection
from typing import Any

from ..errors import UnsafePathError
from ..format import protocol
from .ramtier import check_private

__all__ = ["runtime_dir", "socket_path", "peer_uid", "attach", "ATTACH", "HELLO", "BUSY",
           "register_service",
           "unregister_service", "service_socket"]

ATTACH = "attach"
HELLO = "hello"   # trainer <-> service: the handshake (then the claim lock's fd, the sentinel's)
BUSY = "busy"     # service -> trainer: another trainer is attached
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def runtime_dir(create: bool = False) -> str | None:
    """The user's private runtime folder (made 0700 when ``create``); None if missing."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    path = os.path.join(xdg, "snapsvc") if xdg else f"/tmp/snapsvc-{os.getuid()}"
    return path if check_private(path, create) else None


def socket_path(directory: str, create: bool = False, suffix: str = ".sock") -> str | None:
    """The socket a lingering sidecar of ``directory`` listens on (None: no runtime folder)."""
    folder = runtime_dir(create)
    if folder is None:
        return None
    key = hashlib.sha256(os.path.abspath(directory).encode()).hexdigest()[:16]
    return os.path.join(folder, key + suffix)


def register_service(directory: str, sock: str) -> str:
    """Record that a service of ``directory`` listens on ``sock``; the record's path."""
    record = socket_path(directory, create=True, suffix=".service")
    assert record is not None
    temp = f"{record}.{os.getpid()}.tmp"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(os.path.abspath(sock) + "\n")
    os.replace(temp, record)
    return record


def unregister_service(directory: str, sock: str) -> None:
    """Remove the record of ``directory`` if it still names ``sock`` (a newer service's stays)."""
    record = socket_path(directory, suffix=".service")
    if record is not None and service_socket(directory) == os.path.abspath(sock):
        try:
            os.unlink(record)
        except FileNotFoundError:
            pass


def service_socket(directory: str) -> str | None:
    """The socket a registered service of ``directory`` listens on, or None.
    The record must be a plain file of this user (never a symlink)."""
    record = socket_path(directory, suffix=".service")
    if record is None:
        return None
    try:
        fd = os.open(record, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise UnsafePathError(f"{record} cannot be read safely ({e}): remove it") from None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise UnsafePathError(f"{record} is owned by uid {st.st_uid} with mode "
                                  f"{st.st_mode & 0o777:o}; expected this user's (uid "
                                  f"{os.getuid()}), 0600: refused; remove it")
        return f.read(4096).strip() or None


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (``SO_PEERCRED``)."""
    return _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))[1]


def attach(directory: str, timeout: float = 30.0) -> dict[str, Any] | None:
    """Take over what a lingering sidecar of ``directory`` holds: its RAM copies,
    the files its ``keep_last`` series rotate, the failures no trainer heard
    of. None when no sidecar lingers there. The sidecar exits after answering,
    leaving its RAM copies to the caller's new sidecar."""
    path = socket_path(directory)
    if path is None or not os.path.exists(path):
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except OSError:  # gone meanwhile, or a stale socket file: nothing to take over
        sock.close()
        return None
    uid = peer_uid(sock)
    if uid != os.getuid():
        sock.close()
        raise UnsafePathError(f"{path} is served by uid {uid}, not this user (uid "
                              f"{os.getuid()}): refused; remove it or run as its owner")
    conn = Connection(sock.detach())
    try:
        conn.send_bytes(protocol.pack(ATTACH, pid=os.getpid()))
        if not conn.poll(timeout):
            return None
        state = protocol.unpack(conn.recv_bytes())
        return state if state["op"] == ATTACH else None  # a busy service's answer: nothing
    except (EOFError, OSError):  # it reached its deadline as we came
        return None
    finally:
        conn.close()

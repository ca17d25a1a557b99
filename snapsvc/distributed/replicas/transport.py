"""Files between two ranks over a gloo group: what replication and RAM restores send.

A header (msgpack: names, sizes, an error), then each file's bytes as
messages of :data:`CHUNK` bytes. Both ends stream through two reused
buffers (a :class:`Pipe`): the sender reads chunk k+1 from the file while
chunk k is on the wire, the receiver writes chunk k into its file while chunk
k+1 arrives. So no end maps or faults in the file's pages on the transfer's
path: a receive into a fresh tmpfs mapping costs a page fault and a zeroed
page per 4 KiB, more than the copy itself, while ``pwrite`` fills tmpfs pages
in the kernel's own loop (and a full tmpfs is ``ENOSPC``, not a SIGBUS).

Each message waits on a deadline of its own (:func:`_wait`), not on gloo's
timeout: a gloo timeout closes every pair of the group on that rank.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from ...format.protocol import pack_value, unpack_value
from ..coord import _reason

__all__ = ["CHUNK", "Pipe", "send_files", "recv_header", "recv_files", "recv_to_folder"]

CHUNK = 8 << 20   # bytes per message of a file: two of them in flight per end

# ops given up on past their deadline, with the buffers gloo may still write: kept alive
_abandoned: list[tuple[Any, Any]] = []


def _wait(work: Any, timeout: float | None, what: str, keep: Any = None) -> None:
    """Wait for the gloo op ``work``, at most ``timeout`` seconds (None: as the group
    says). Our own deadline, not gloo's: a gloo timeout closes every pair of the group
    on this rank, so one lost peer would cut this rank off from all the others. An op
    given up on stays pending, its buffers (``keep``) alive, its link never used again."""
    if timeout is None:
        work.wait()
        return
    done, errors = threading.Event(), []

    def waiter() -> None:
        try:
            work.wait()
        except Exception as e:
            errors.append(e)
        finally:
            done.set()

    threading.Thread(target=waiter, name="snapsvc-replica-wait", daemon=True).start()
    if not done.wait(timeout):
        # those done since are dropped: each kept buffer is up to a chunk
        _abandoned[:] = [(w, k) for w, k in _abandoned if not w.is_completed()]
        _abandoned.append((work, keep))
        raise TimeoutError(f"{what}: not done within {timeout:g} s")
    if errors:
        raise errors[0]


def _send(t: torch.Tensor, peer: int, group: Any, timeout: float | None) -> None:
    _wait(dist.isend(t, peer, group=group), timeout, f"sending {t.numel()} bytes to rank {peer}",
          t)


def _recv(t: torch.Tensor, peer: int, group: Any, timeout: float | None) -> None:
    _wait(dist.irecv(t, peer, group=group), timeout,
          f"receiving {t.numel()} bytes from rank {peer}", t)


def _send_bytes(data: bytes, peer: int, group: Any, timeout: float | None = None) -> None:
    t = torch.frombuffer(bytearray(data) or bytearray(1), dtype=torch.uint8)
    _send(torch.tensor([t.numel()], dtype=torch.int64), peer, group, timeout)
    _send(t, peer, group, timeout)


def _recv_bytes(peer: int, group: Any, timeout: float | None = None) -> bytes:
    n = torch.zeros(1, dtype=torch.int64)
    _recv(n, peer, group, timeout)
    t = torch.empty(int(n), dtype=torch.uint8)
    _recv(t, peer, group, timeout)
    return t.numpy().tobytes()


class Pipe:
    """Two chunk buffers, touched once and reused, and a thread for the file side."""

    def __init__(self, size: int = CHUNK) -> None:
        self.size = max(1, min(size, CHUNK))   # files up to ``size`` need no more
        self.bufs = [torch.ones(self.size, dtype=torch.uint8) for _ in range(2)]
        self.io = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="snapsvc-pipe")

    def renew(self) -> None:
        """After a failed transfer: gloo may still write the old buffers."""
        self.bufs = [torch.ones(self.size, dtype=torch.uint8) for _ in range(2)]

    def close(self) -> None:
        self.io.shutdown(wait=True)

    def send(self, fd: int, n: int, peer: int, group: Any, timeout: float | None) -> None:
        """``n`` bytes of ``fd`` to ``peer``: chunk k+1 read while chunk k is sent."""
        count = -(-n // CHUNK)
        read = self.io.submit(_pread, fd, self.bufs[0], min(CHUNK, n), 0)
        for k in range(count):
            m = read.result()
            if k + 1 < count:
                off = (k + 1) * CHUNK
                read = self.io.submit(_pread, fd, self.bufs[(k + 1) % 2], min(CHUNK, n - off),
                                      off)
            _send(self.bufs[k % 2][:m], peer, group, timeout)

    def recv(self, fd: int, n: int, peer: int, group: Any, timeout: float | None) -> None:
        """``n`` bytes from ``peer`` into ``fd``: chunk k written while k+1 arrives. A
        write that fails (``OSError``: a full tmpfs) raises once every chunk came."""
        writes: list[concurrent.futures.Future[None] | None] = [None, None]
        error: OSError | None = None

        def settle(j: int) -> None:
            nonlocal error
            w, writes[j] = writes[j], None
            try:
                if w is not None:
                    w.result()
            except OSError as e:
                error = error or e

        try:
            for k in range(-(-n // CHUNK)):
                buf = self.bufs[k % 2][:min(CHUNK, n - k * CHUNK)]
                settle(k % 2)   # its buffer is free
                _recv(buf, peer, group, timeout)
                if error is None:
                    writes[k % 2] = self.io.submit(_pwrite, fd, buf, k * CHUNK)
        finally:
            settle(0)
            settle(1)
        if error is not None:
            raise error


def _pread(fd: int, buf: torch.Tensor, m: int, off: int) -> int:
    view = buf.numpy().data[:m]
    got = 0
    while got < m:
        k = os.preadv(fd, [view[got:]], off + got)
        if k == 0:
            raise OSError(f"file shorter than announced: {off + got} bytes, expected {off + m}")
        got += k
    return m


def _pwrite(fd: int, buf: torch.Tensor, off: int) -> None:
    view = buf.numpy().data
    done = 0
    while done < len(view):
        done += os.pwritev(fd, [view[done:]], off + done)


def send_files(paths: list[str], peer: int, group: Any, error: str | None = None,
               timeout: float | None = None, pipe: Pipe | None = None) -> int:
    """The files ``paths`` (any may be missing) to ``peer``: a header (names, sizes,
    ``error``), then each non-empty file's bytes in chunks; the bytes sent.
    ``timeout``: seconds each message may take (None: as the group says);
    ``pipe``: buffers to reuse (else made for this call). A file that cannot be
    opened is sent as a header with its error, and no bytes."""
    present = [p for p in paths if os.path.exists(p)] if error is None else []
    fds: list[int] = []
    try:
        try:
            for path in present:
                fds.append(os.open(path, os.O_RDONLY | os.O_NOFOLLOW))
            sizes = [os.fstat(fd).st_size for fd in fds]   # the sizes of what is read
        except OSError as e:   # gone since, or a symlink: the peer still gets its header
            present, sizes, error = [], [], _reason(e)
        _send_bytes(pack_value({"names": [os.path.basename(p) for p in present],
                                "sizes": sizes, "error": error}), peer, group, timeout)
        with _pipe(pipe, max(sizes, default=0)) as p:
            for fd, n in zip(fds, sizes):
                if n:
                    p.send(fd, n, peer, group, timeout)
    finally:
        for fd in fds:
            os.close(fd)
    return sum(sizes)


def recv_header(peer: int, group: Any, timeout: float | None = None) -> dict[str, Any]:
    """The header :func:`send_files` sends first: ``names``, ``sizes``, ``error``."""
    header: dict[str, Any] = unpack_value(_recv_bytes(peer, group, timeout))
    return header


def recv_files(peer: int, group: Any, header: dict[str, Any],
               timeout: float | None = None) -> dict[str, torch.Tensor]:
    """The files of ``header`` into memory: name -> bytes (also to drain a refused one)."""
    files = {}
    for name, n in zip(header["names"], header["sizes"]):
        files[name] = torch.empty(n, dtype=torch.uint8)
        for off in range(0, n, CHUNK):
            _recv(files[name][off:off + CHUNK], peer, group, timeout)
    return files


def recv_to_folder(peer: int, group: Any, header: dict[str, Any], folder: str,
                   spare: Callable[[int], str | None] | None = None,
                   timeout: float | None = None, pipe: Pipe | None = None) -> None:
    """The files of ``header`` into ``folder`` (private, 0600), each through a temp
    file, then renamed, the metadata (``.meta``) last: it vouches for the rest.
    ``spare(n)``: a file whose pages to reuse for ``n`` bytes (renamed to the temp
    name), or None. A file-side error (``OSError``: a full tmpfs) still takes the
    rest of the origin's bytes, keeping the exchange in step, then raises."""
    temps: list[tuple[str, str]] = []
    sizes = header["sizes"]
    received = 0   # the files whose bytes were taken: the rest is drained on an OSError
    try:
        with _pipe(pipe, max(sizes, default=0)) as p:
            for i, (name, n) in enumerate(zip(header["names"], sizes)):
                final = os.path.join(folder, name)
                temp = f"{final}.{os.getpid()}.tmp"
                reuse = spare(n) if spare is not None and n else None
                if reuse is not None:
                    os.replace(reuse, temp)
                fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW |
                             (0 if reuse else os.O_TRUNC), 0o600)
                temps.append((temp, final))
                try:
                    try:
                        p.recv(fd, n, peer, group, timeout)
                    finally:
                        # taken: a failed write raises only once every chunk came (a
                        # failed receive is no OSError, or a TimeoutError: no drain)
                        received = i + 1
                    os.ftruncate(fd, n)   # a larger spare cut to size
                finally:
                    os.close(fd)
        for temp, final in sorted(temps, key=lambda tf: tf[1].endswith(".meta")):
            os.replace(temp, final)
    except BaseException as e:
        for temp, _ in temps:
            try:
                os.unlink(temp)
            except FileNotFoundError:
                pass
        if isinstance(e, OSError) and not isinstance(e, TimeoutError):
            recv_files(peer, group, {"names": header["names"][received:],
                                     "sizes": sizes[received:]}, timeout)
        raise


@contextlib.contextmanager
def _pipe(given: Pipe | None, largest: int) -> Iterator[Pipe]:
    """``given``, renewed after a failure; else a pipe made (and closed) for this call,
    its buffers no larger than the ``largest`` file needs."""
    pipe = given or Pipe(largest)
    try:
        yield pipe
    except BaseException:
        if given is not None:
            given.renew()
        raise
    finally:
        if given is None:
            pipe.close()

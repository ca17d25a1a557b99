"""Reading a checkpoint from the remote tier: ``load``, ``restore``, ``verify`` and
``read_checkpoint`` given a URL.

:func:`fetched` reads one committed remote checkpoint and yields a local path
the ordinary readers then take. Only a committed checkpoint is read: its
``.meta`` is fetched first and must exist (an upload cut off before its commit
has none). Each file it records is read in parallel ranged GETs straight into
memory (a Linux memory file; elsewhere a temp file), each range's CRC-32 taken
as it lands, the whole checked against the ``.meta`` before any reader sees
it. The path is a private temporary directory holding the ``.meta`` and a
link to each file's memory, so no copy of the checkpoint is written to disk
and a reader that maps the file (``restore``) copies from that memory
directly. The readers check again as they do any local file, so a corrupt or
truncated remote object is a :class:`~snapsvc.errors.FormatError` naming its
URL, and nothing the caller passed in is changed. No room for the bytes is an
``OSError`` naming where and how many, never a corrupt object.

Every fetch has a deadline (``timeout``, :data:`TIMEOUT` by default) that
bounds each request and the whole. :func:`accepts_url` wraps a reader so a
URL goes through :func:`fetched`.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import os
import shutil
import tempfile
import threading
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Coroutine, Iterator, TypeVar, cast

from isal import isal_zlib

from ..errors import FormatError
from ..files.metafile import META_SUFFIX, companions, read_meta
from ..files.verify import VerifyReport, verify as _verify_local
from .store import PART, Progress, Store, open_store
from .url import as_oserror, is_url, parse_url, split_url

__all__ = ["TIMEOUT", "fetched", "accepts_url", "verify", "run_sync"]

T = TypeVar("T")

# a read's deadline when none is given: the writer's remote_timeout default
TIMEOUT = 300.0
# ranged reads in flight for one fetch
_READS_IN_FLIGHT = 8


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to its end from synchronous code, also when the calling
    thread already runs an event loop (a notebook): then in a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, name="snapsvc-fetch")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return cast(T, box["value"])


class _NoRoom(OSError):
    """No room for a fetched file where it lands: a local error, not the remote object's."""


class _Landing:
    """Where one remote file's bytes land, range by range: a memory file (Linux),
    else a file in the fetch's temp directory; ``path`` names it for the readers."""

    def __init__(self, tmp: str, name: str, size: int, url: str) -> None:
        self.path = os.path.join(tmp, name)
        self.size = size
        self.url = url
        self.crcs: dict[int, tuple[int, int]] = {}  # offset -> (CRC-32, length) of each range
        self.memory = hasattr(os, "memfd_create")
        if self.memory:
            self.fd = os.memfd_create(f"snapsvc-fetch-{name}"[:240], os.MFD_CLOEXEC)
            os.symlink(f"/proc/{os.getpid()}/fd/{self.fd}", self.path)
        else:
            self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                              0o600)

    def land(self, at: int, data: memoryview) -> None:
        """``data`` at offset ``at``, every byte of it (a write may take fewer)."""
        self.crcs[at] = (isal_zlib.crc32(data), len(data))
        done = 0
        while done < len(data):
            try:
                n = os.pwrite(self.fd, data[done:], at + done)
            except OSError as e:
                raise self._no_room(e) from None
            if n <= 0:
                raise self._no_room(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
            done += n

    def _no_room(self, e: OSError) -> _NoRoom:
        where = "in memory" if self.memory else "on disk"
        return _NoRoom(e.errno or errno.EIO, f"fetching {self.url}: could not keep its "
                       f"{self.size} bytes {where} ({e.strerror or e}); free that much, or "
                       "point TMPDIR elsewhere", self.path)

    def crc32(self) -> tuple[int, int]:
        """(CRC-32, bytes) of what landed, ranges joined in file order."""
        crc, got = 0, 0
        for at in sorted(self.crcs):
            part, length = self.crcs[at]
            crc = isal_zlib.crc32_combine(crc, part, length)
            got += length
        return crc, got

    def close(self) -> None:
        os.close(self.fd)


async def _fetch(url: str, tmp: str, store: Store, landings: list[_Landing],
                 progress: Progress | None) -> str:
    """The checkpoint ``url`` into ``landings`` (closed by the caller), checked; its path."""
    name = split_url(url)[1]
    local = os.path.join(tmp, name)
    meta_bytes = await store.get(name + META_SUFFIX)
    if meta_bytes is None:
        raise FormatError("no metadata on the remote tier: the checkpoint was never "
                          "uploaded, or its upload did not commit", path=url + META_SUFFIX)
    with open(local + META_SUFFIX, "wb") as f:
        f.write(meta_bytes)
    try:
        meta = read_meta(local)
        files = [(name, meta.size, meta.crc32)] + [
            (c.name, c.size, c.crc32) for c in companions(local, meta)]  # optimizer, data
    except FormatError as e:
        raise FormatError(e.reason, path=url + META_SUFFIX) from None
    sizes = await asyncio.gather(*(store.size(key) for key, _, _ in files))
    for (key, size, crc32), actual in zip(files, sizes):
        where = store.key_url(key)
        if not (type(size) is int and type(crc32) is int):
            raise FormatError(f"its metadata records size {size!r} and crc32 {crc32!r}, not "
                              "integers", path=where)
        if actual is None:
            raise FormatError("the remote object is missing although its metadata exists; the "
                              "checkpoint was deleted in part; use an earlier one", path=where)
        if actual != size:
            raise FormatError(f"the remote object is {actual} bytes, its metadata says {size}: "
                              "truncated, or not the file this metadata describes; use an "
                              "earlier checkpoint", path=where)
        landings.append(_Landing(tmp, key, size, where))
    total = sum(size for _, size, _ in files)
    done = 0
    if progress is not None:
        progress("fetching", 0, total)
    gate = asyncio.Semaphore(_READS_IN_FLIGHT)

    async def part(landing: _Landing, key: str, start: int) -> None:
        nonlocal done
        async with gate:
            data = await store.get_range(key, start, min(start + PART, landing.size))
        landing.land(start, data)
        done += len(data)
        if progress is not None:
            progress("fetching", done, total)

    await asyncio.gather(*(part(landing, key, start)
                           for landing, (key, size, _) in zip(landings, files)
                           for start in range(0, size, PART)))
    for landing, (_, size, crc32) in zip(landings, files):
        crc, got = landing.crc32()
        if got != size or crc != crc32:
            raise FormatError(f"crc32 {crc:08x} of {got} bytes, metadata says {crc32:08x} of "
                              f"{size}: the remote object is corrupt or does not belong to this "
                              "metadata; use an earlier checkpoint", path=landing.url)
    return local


@contextmanager
def fetched(url: str, *, options: dict[str, Any] | None = None, timeout: float | None = None,
            progress: Progress | None = None) -> Iterator[str]:
    """The committed remote checkpoint ``url``, checked, as a local path for
    the duration of the ``with`` (see the module docstring). ``timeout``: the
    deadline of the whole fetch (:data:`TIMEOUT` by default), a ``TimeoutError``
    past it. ``progress(phase, bytes done, bytes in all)`` as bytes land."""
    split_url(url)  # a URL that cannot be read is a ValueError, before any request
    limit = TIMEOUT if timeout is None else float(timeout)
    tmp = tempfile.mkdtemp(prefix="snapsvc-fetch-")
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, ignore_errors=True)
        landings: list[_Landing] = []
        @stack.callback
        def _close_landings() -> None:
            for landing in landings:
                landing.close()
        try:
            store = open_store(split_url(url)[0], remote_timeout=limit, options=options)
            local = run_sync(asyncio.wait_for(_fetch(url, tmp, store, landings, progress),
                                              limit))
        except (FormatError, _NoRoom):
            raise
        except asyncio.TimeoutError:
            raise TimeoutError(errno.ETIMEDOUT, f"reading {url}: not done within timeout="
                               f"{limit:g} s; check the endpoint and the network, or pass a "
                               "longer timeout=") from None
        except Exception as e:  # the engine's errors (some OSErrors): one line, no secret
            raise as_oserror(e, f"reading {url}", options) from None
        try:
            yield local
        except FormatError as e:  # a reader's complaint about the copy: name the original
            where = url if e.path in (None, local) else f"{split_url(url)[0]}/" \
                f"{os.path.basename(e.path)}"
            raise FormatError(e.reason.replace(tmp + os.sep, ""), path=where, offset=e.offset,
                              entry=e.entry) from None


F = TypeVar("F", bound=Callable[..., Any])


def accepts_url(reader: F) -> F:
    """``reader(path, ...)`` that also takes a remote URL as ``path``, read
    through :func:`fetched` within ``timeout=`` seconds (a keyword the wrapped
    reader gains; :data:`TIMEOUT` by default, ignored for a local path)."""
    @functools.wraps(reader)
    def wrapper(path: Any, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        if not is_url(path):
            return reader(path, *args, **kwargs)
        with fetched(path, timeout=timeout) as local:
            result = reader(local, *args, **kwargs)
        if getattr(result, "path", None) == local:  # e.g. Checkpoint.path: name the original
            result.path = path
        return result
    return wrapper  # type: ignore[return-value]


def verify(path: str | os.PathLike[str], *, require_meta: bool = True,
           timeout: float | None = None, progress: Progress | None = None) -> VerifyReport:
    """:func:`snapsvc.files.verify.verify`, also for a remote URL: the problems
    then name the remote objects, and one that cannot be fetched is a problem
    (no room to hold it here is an ``OSError``: the checkpoint may be fine)."""
    if not is_url(path):
        return _verify_local(path, require_meta=require_meta)
    url = parse_url(str(path)).url
    try:
        with fetched(url, timeout=timeout, progress=progress) as local:
            report = _verify_local(local, require_meta=require_meta)
    except _NoRoom:
        raise
    except (FormatError, OSError) as e:
        return VerifyReport(url, problems=[str(e)])
    root = split_url(url)[0]
    report.problems = [p.replace(os.path.dirname(local), root) for p in report.problems]
    report.path = url
    return report

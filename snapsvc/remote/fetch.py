"""Reading a checkpoint from the remote tier: ``load``, ``restore``, ``verify`` and
``read_checkpoint`` given a URL.

:func:`fetched` copies one remote checkpoint into a private temporary
directory and yields the local path the ordinary readers then take; the
directory is removed afterwards. Only a committed checkpoint is read: its
``.meta`` must exist (an upload cut off before its commit has none). Each
data file is fetched in parallel ranged reads, and its size and CRC-32 are
checked against that ``.meta`` before any reader sees it; the readers check
again as they do for any local file, so a corrupt or truncated remote object
is a :class:`~snapsvc.errors.FormatError` naming its URL, and nothing the
caller passed in is changed. :func:`accepts_url` wraps a reader so a URL
goes through :func:`fetched`.
"""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
import tempfile
import threading
from contextlib import contextmanager
from typing import Any, Callable, Coroutine, Iterator, TypeVar

from isal import isal_zlib

from ..errors import FormatError
from ..files.metafile import META_SUFFIX, companions, read_meta
from ..files.verify import VerifyReport, verify as _verify_local
from .store import PART, Store, is_url, open_store, scrub, split_url

__all__ = ["fetched", "accepts_url", "verify", "run_sync"]

T = TypeVar("T")


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
    return box["value"]


def _crc_file(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(PART):
            crc = isal_zlib.crc32(chunk, crc)
    return crc


async def _fetch_file(store: Store, key: str, dest: str, size: int, crc32: int) -> None:
    """``key`` to ``dest``, refused unless it is ``size`` bytes of CRC-32 ``crc32``."""
    url = store.key_url(key)
    actual = await store.size(key)
    if actual is None:
        raise FormatError("the remote object is missing although its metadata exists; the "
                          "checkpoint was deleted in part; use an earlier one", path=url)
    if actual != size:
        raise FormatError(f"the remote object is {actual} bytes, its metadata says {size}: "
                          "truncated, or not the file this metadata describes; use an "
                          "earlier checkpoint", path=url)
    await store.download(key, dest, size)
    crc = await asyncio.to_thread(_crc_file, dest)
    if crc != crc32:
        raise FormatError(f"crc32 {crc:08x}, metadata says {crc32:08x}: the remote object is "
                          "corrupt or does not belong to this metadata; use an earlier "
                          "checkpoint", path=url)


async def _fetch(url: str, tmp: str, options: dict[str, Any] | None) -> str:
    root, name = split_url(url)
    store = open_store(root, options=options)
    local = os.path.join(tmp, name)
    meta_bytes = await store.get(name + META_SUFFIX)
    if meta_bytes is None:
        raise FormatError("no metadata on the remote tier: the checkpoint was never "
                          "uploaded, or its upload did not commit", path=url + META_SUFFIX)
    with open(local + META_SUFFIX, "wb") as f:
        f.write(meta_bytes)
    try:
        meta = read_meta(local)
        beside = companions(local, meta)  # the optimizer file, the data file
    except FormatError as e:
        raise FormatError(e.reason, path=url + META_SUFFIX) from None
    jobs = [_fetch_file(store, name, local, meta.size, meta.crc32)]
    jobs += [_fetch_file(store, c.name, os.path.join(tmp, c.name), c.size, c.crc32)
             for c in beside]
    await asyncio.gather(*jobs)
    return local


@contextmanager
def fetched(url: str, *, options: dict[str, Any] | None = None) -> Iterator[str]:
    """The committed remote checkpoint ``url``, checked, as a local path for
    the duration of the ``with``; its temporary copy is removed after."""
    tmp = tempfile.mkdtemp(prefix="snapsvc-fetch-")
    try:
        try:
            local = run_sync(_fetch(url, tmp, options))
        except FormatError:
            raise
        except OSError as e:
            raise OSError(e.errno, scrub(f"reading {url} failed: {e.strerror or e}",
                                         options)) from None
        except Exception as e:  # the engine's errors
            raise OSError(scrub(f"reading {url} failed: {type(e).__name__}: {e}",
                                options).splitlines()[0]) from None
        try:
            yield local
        except FormatError as e:  # a reader's complaint about the copy: name the original
            where = url if e.path in (None, local) else f"{split_url(url)[0]}/" \
                f"{os.path.basename(e.path)}"
            raise FormatError(e.reason.replace(tmp + os.sep, ""), path=where, offset=e.offset,
                              entry=e.entry) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


F = TypeVar("F", bound=Callable[..., Any])


def accepts_url(reader: F) -> F:
    """``reader(path, ...)`` that also takes a remote URL as ``path``."""
    @functools.wraps(reader)
    def wrapper(path: Any, *args: Any, **kwargs: Any) -> Any:
        if not is_url(path):
            return reader(path, *args, **kwargs)
        with fetched(path) as local:
            result = reader(local, *args, **kwargs)
        if getattr(result, "path", None) == local:  # e.g. Checkpoint.path: name the original
            result.path = path
        return result
    return wrapper  # type: ignore[return-value]


def verify(path: str | os.PathLike[str], *, require_meta: bool = True) -> VerifyReport:
    """:func:`snapsvc.files.verify.verify`, also for a remote URL: the problems
    then name the remote objects, and one that cannot be fetched is a problem."""
    if not is_url(path):
        return _verify_local(path, require_meta=require_meta)
    url = str(path)
    try:
        with fetched(url) as local:
            report = _verify_local(local, require_meta=require_meta)
    except (FormatError, OSError) as e:
        return VerifyReport(url, problems=[str(e)])
    root = split_url(url)[0]
    report.problems = [p.replace(os.path.dirname(local), root) for p in report.problems]
    report.path = url
    return report

"""The uploader: copies each locally durable checkpoint to the remote tier.

It runs in the writer sidecar (a thread of that process, with its own event
loop), so the training loop never waits on the network and later local writes
never wait behind an upload.

Order and commit. For one checkpoint: the remote ``.meta`` of that name is
deleted first (an overwrite of ``best.fdl`` never leaves a ``.meta`` next to
other bytes; with ``uncommit``, a multi-rank step's manifest too), the data files go up (in parallel, multipart above
:data:`~snapsvc.remote.store.PART`), each checked on the way against the
size and CRC-32 the local metadata records, and the ``.meta`` goes last: a
remote checkpoint is complete exactly when its ``.meta`` exists.

Queue. Newest first: when uploads fall behind, the last checkpoint submitted
goes next. At most ``backlog`` wait; the oldest beyond that are skipped and
reported. A name queued again replaces its older entry (which is reported
skipped). :meth:`Uploader.pending` tells the local rotation which files it
must not delete yet: a job's files are opened (under the writer's lock, so
never between a checkpoint's renames) when its upload starts, and from then
on deleting their names changes nothing for it.

Faults. Each request is retried by the engine with jittered backoff; a failed
attempt is retried whole, until ``remote_timeout`` after the upload started;
then the checkpoint is reported failed and the queue goes on. A local file
that does not match its metadata is not retried (it never will).

Restart. At start, unfinished uploads a dead writer left are aborted
(:meth:`~snapsvc.remote.store.Store.abort_stale_uploads`), and (unless
``scan=False``: a rank of a multi-rank writer, whose directory also holds the
other ranks' files; its ranks agree on what to upload, see
:mod:`snapsvc.distributed.uploads`) every checkpoint under the local directory that is
complete locally but not remotely (no remote ``.meta``, or one with other
bytes) is queued.

Retention (``keep_last``): after each upload, the remote checkpoints of the
same series (names in one folder that differ only in digits, as for the local
tier; ``best.fdl`` is its own series) beyond the newest ``keep_last`` by the
numbers in their names are deleted, ``.meta`` first, then the data.
"""

from __future__ import annotations

import asyncio
import collections
import io
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..files.durable import TMP_SUFFIX
from ..errors import FormatError
from ..files.metafile import META_SUFFIX, checkpoint_names, companions, read_meta

from .store import CorruptSource, Store, open_store, scrub

__all__ = ["BACKLOG", "UploadJob", "Uploader", "series_of"]

log = logging.getLogger("snapsvc.remote")

BACKLOG = 4
_DIGITS = re.compile(r"\d+")
_RETRY_S = (1.0, 2.0, 4.0, 8.0)  # between whole attempts, then 8 s each


def series_of(key: str) -> tuple[str, str]:
    """(folder, name with each run of digits as ``#``): the rotation series of a key."""
    folder, _, name = key.rpartition("/")
    return folder, _DIGITS.sub("#", name)


def _number(key: str) -> tuple[int, ...]:
    return tuple(int(d) for d in _DIGITS.findall(key.rpartition("/")[2]))


@dataclass
class UploadJob:
    """One checkpoint to upload: ``seq`` is the writer's (None when found at start)."""

    seq: int | None
    path: str  # the local main file
    key: str   # its key under the remote root


Callback = Callable[[UploadJob, "str | None", "str | None", bool], None]


class Uploader:
    """A thread that uploads checkpoints under ``directory`` to ``location``.

    ``on_done(job, url, error, skipped)`` is called from that thread for each
    job: ``url`` on success, else ``error`` (no credentials in it).
    ``files_lock`` is held by the writer around each local write and rotation.
    """

    def __init__(self, location: str, directory: str, *, remote_timeout: float,
                 options: dict[str, Any] | None, keep_last: int | None,
                 on_done: Callback, files_lock: threading.Lock | None = None,
                 backlog: int = BACKLOG, scan: bool = True,
                 uncommit: tuple[str, ...] = ()) -> None:
        self.location = location
        self.scan = scan  # queue at start what the directory holds and the remote lacks
        # names in a checkpoint's folder that vouch for it too (a multi-rank step's
        # manifest): deleted with its .meta, before any data
        self.uncommit = tuple(uncommit)
        self.directory = os.path.abspath(directory)
        self.remote_timeout = remote_timeout
        self.options = dict(options or {})
        self.keep_last = keep_last
        self.backlog = backlog
        self._on_done = on_done
        self._files_lock = files_lock or threading.Lock()
        self._mutex = threading.Lock()
        self._queue: collections.deque[UploadJob] = collections.deque()
        self._unopened: set[str] = set()  # paths whose files the local rotation must keep
        self._released: list[str] = []    # paths that left _unopened since the last call
        self._active = False
        self._close_by: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._event: asyncio.Event | None = None
        self._started = 0.0
        self._thread = threading.Thread(target=self._run, name="snapsvc-upload", daemon=True)

    # --- the writer's side -------------------------------------------------

    def start(self) -> None:
        self._started = time.time()
        self._thread.start()

    def key(self, path: str) -> str:
        """The remote key of the local file ``path`` (ValueError if outside the directory)."""
        rel = os.path.relpath(os.path.abspath(path), self.directory)
        if rel.startswith(os.pardir + os.sep) or rel == os.pardir or os.path.isabs(rel):
            raise ValueError(f"{path} is outside the writer's directory {self.directory}: "
                             "only files under it are uploaded")
        return rel.replace(os.sep, "/")

    def enqueue(self, seq: int | None, path: str) -> None:
        """Queue the checkpoint ``path`` (durable locally) for upload."""
        job = UploadJob(seq, os.path.abspath(path), self.key(path))
        dropped = []
        with self._mutex:
            for old in [j for j in self._queue if j.path == job.path]:
                self._queue.remove(old)
                dropped.append((old, "superseded: the same name was written again before "
                                     "this copy was uploaded"))
            self._queue.append(job)
            self._unopened.add(job.path)
            while len(self._queue) > self.backlog:
                old = self._queue.popleft()
                dropped.append((old, f"skipped: uploads fell behind and {self.backlog} newer "
                                     "checkpoints were queued (newest go first)"))
            for old, _ in dropped:
                self._forget(old)
        self._wake()
        for old, why in dropped:
            log.warning("not uploading %s: %s", old.path, why)
            self._on_done(old, None, why, True)

    def pending(self, path: str) -> bool:
        """Is ``path`` queued for upload and not yet opened? (then keep its files)"""
        with self._mutex:
            return os.path.abspath(path) in self._unopened

    def released(self) -> list[str]:
        """Paths no longer pending since the last call (the writer may rotate them now)."""
        with self._mutex:
            out, self._released = self._released, []
            return out

    def idle(self) -> bool:
        with self._mutex:
            return not self._queue and not self._active

    def close(self, timeout: float) -> None:
        """Upload what is queued for up to ``timeout`` s, then give up on the rest
        (each reported failed) and stop the thread."""
        deadline = time.monotonic() + timeout
        with self._mutex:
            self._close_by = deadline
        self._wake()
        if not self._thread.is_alive():
            return
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive() and self._loop is not None and self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(30.0)
        if self._thread.is_alive():
            log.error("the upload thread did not stop within 30 s of its deadline")

    def _wake(self) -> None:
        """Tell the upload thread's loop to look at the queue again."""
        loop, event = self._loop, self._event
        if loop is not None and event is not None:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the loop has ended: nothing is waiting
                pass

    def _forget(self, job: UploadJob) -> None:
        """Under _mutex: ``job``'s files are no longer the uploader's concern."""
        if job.path in self._unopened and not any(j.path == job.path for j in self._queue):
            self._unopened.discard(job.path)
            self._released.append(job.path)

    # --- the upload thread -------------------------------------------------

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException:  # a bug must not leave handles waiting: fail what is left
            log.exception("the upload thread failed")
        with self._mutex:
            left = list(self._queue)
            self._queue.clear()
            for job in left:
                self._forget(job)
        for job in left:
            self._on_done(job, None, "not uploaded: the writer closed before its turn "
                                     f"(remote_timeout={self.remote_timeout:g} s)", False)

    async def _main(self) -> None:
        self._event = asyncio.Event()
        self._task = asyncio.current_task()
        self._loop = asyncio.get_running_loop()
        store = open_store(self.location, remote_timeout=self.remote_timeout,
                           options=self.options)
        await self._restart(store)
        while True:
            job = await self._next()
            if job is None:
                return
            try:
                url, error = await self._upload(store, job), None
            except _Failed as e:
                url, error = None, str(e)
            except asyncio.CancelledError:  # close() ran out of time during this one
                self._on_done(job, None, "not uploaded: the writer closed before its upload "
                              f"committed (remote_timeout={self.remote_timeout:g} s)", False)
                raise
            finally:
                with self._mutex:
                    self._active = False
            if error is not None:
                log.error("uploading %s failed: %s", job.path, error)
            self._on_done(job, url, error, False)
            if url is not None and self.keep_last is not None:
                try:
                    await asyncio.wait_for(self._prune(store, job.key), self.remote_timeout)
                except (OSError, asyncio.TimeoutError) as e:
                    log.warning("remote rotation after %s failed: %s", job.key,
                                scrub(str(e), self.options))

    async def _next(self) -> UploadJob | None:
        """Wait for the newest job; None once closing and nothing is left."""
        assert self._event is not None
        while True:
            self._event.clear()  # before looking: a later enqueue sets it again
            with self._mutex:
                if self._queue:
                    self._active = True
                    return self._queue.pop()
                if self._close_by is not None:
                    return None
            await self._event.wait()

    async def _restart(self, store: Store) -> None:
        """Abort a dead writer's unfinished uploads; queue what it did not commit."""
        try:
            aborted = await asyncio.wait_for(store.abort_stale_uploads(), self.remote_timeout)
            if aborted:
                log.info("aborted %d unfinished upload(s) under %s", aborted, store.url)
            if not self.scan:
                return
            remote = {o.key: o.size for o in await asyncio.wait_for(store.list(),
                                                                     self.remote_timeout)}
            todo = []
            for path in _local_checkpoints(self.directory):
                if os.stat(path + META_SUFFIX).st_mtime >= self._started or self.pending(path):
                    continue  # written by this writer: queued by it
                key = self.key(path)
                if key + META_SUFFIX in remote:
                    with open(path + META_SUFFIX, "rb") as f:
                        local_meta = f.read()
                    if await store.get(key + META_SUFFIX) == local_meta:
                        continue
                todo.append((os.stat(path + META_SUFFIX).st_mtime, path))
        except Exception as e:  # the engines' errors too: uploads go on without the scan
            log.error("checking the remote tier at start failed (%s); checkpoints not "
                      "uploaded before the restart stay local", scrub(str(e), self.options))
            return
        for _, path in sorted(todo):  # oldest first in, so newest first out
            log.info("uploading %s: durable locally but not on the remote tier", path)
            self.enqueue(None, path)

    async def _upload(self, store: Store, job: UploadJob) -> str:
        started = time.monotonic()
        deadline = started + self.remote_timeout
        attempt, last = 0, ""
        while True:
            with self._mutex:
                if self._close_by is not None:
                    deadline = min(deadline, max(self._close_by, time.monotonic()))
            try:
                await asyncio.wait_for(self._attempt(store, job), deadline - time.monotonic())
                return store.key_url(job.key)
            except (CorruptSource, FormatError, FileNotFoundError) as e:
                raise _Failed(f"{job.path}: {e}") from None
            except asyncio.TimeoutError:
                raise _Failed(f"{store.key_url(job.key)}: not uploaded within remote_timeout="
                              f"{self.remote_timeout:g} s ({attempt + 1} attempt(s){last}); "
                              "check the endpoint and the network, or raise remote_timeout"
                              ) from None
            except Exception as e:  # the engine's errors: network, auth, server
                why = scrub(f"{type(e).__name__}: {e}", self.options).splitlines()[0]
                last = f", the last: {why}"
                wait = _RETRY_S[min(attempt, len(_RETRY_S) - 1)]
                if time.monotonic() + wait >= deadline:
                    raise _Failed(f"{store.key_url(job.key)}: upload failed after "
                                  f"{attempt + 1} attempt(s) in {time.monotonic() - started:.1f} s:"
                                  f" {why}") from None
                log.warning("uploading %s failed (%s); retrying in %g s", job.key, why, wait)
                attempt += 1
                await asyncio.sleep(wait)

    async def _attempt(self, store: Store, job: UploadJob) -> None:
        with self._files_lock:  # never between a write's renames
            meta = read_meta(job.path)
            with open(job.path + META_SUFFIX, "rb") as f:
                meta_bytes = f.read()
            files = [(job.key, open(job.path, "rb"), meta.size, meta.crc32)]
            try:
                folder = os.path.dirname(job.path)
                for c in companions(job.path, meta):  # the optimizer file, the data file
                    okey = f"{job.key.rpartition('/')[0]}/{c.name}".lstrip("/")
                    files.append((okey, open(os.path.join(folder, c.name), "rb"), c.size,
                                  c.crc32))
            except BaseException:
                for _, f, _, _ in files:
                    f.close()
                raise
        with self._mutex:
            self._forget(job)
        try:
            folder = job.key.rpartition("/")[0]
            for name in self.uncommit:
                await store.delete(f"{folder}/{name}".lstrip("/"))
            await store.delete(job.key + META_SUFFIX)  # uncommit an older copy of this name
            await asyncio.gather(*(store.put(k, f, size=s, crc32=c) for k, f, s, c in files))
            await store.put(job.key + META_SUFFIX, io.BytesIO(meta_bytes))  # last: the commit
        finally:
            for _, f, _, _ in files:
                f.close()

    async def _prune(self, store: Store, key: str) -> None:
        folder, pattern = series_of(key)
        prefix = f"{folder}/" if folder else ""
        objects = await store.list(prefix)
        names = {o.key for o in objects}
        complete = sorted((k[: -len(META_SUFFIX)] for k in names
                           if k.endswith(META_SUFFIX) and k[: -len(META_SUFFIX)] in names
                           and series_of(k[: -len(META_SUFFIX)]) == (folder, pattern)),
                          key=_number)
        assert self.keep_last is not None and self.keep_last >= 1  # the newest always stays
        for old in complete[: -self.keep_last]:
            for key in checkpoint_names(old):  # metadata first: it vouches for the rest
                await store.delete(key)  # the writer's names; absent is fine
            log.info("remote rotation: removed %s", store.key_url(old))


class _Failed(Exception):
    """An upload that failed for good; the message says why."""


def _local_checkpoints(directory: str) -> list[str]:
    """Every checkpoint under ``directory`` whose file and ``.meta`` both exist."""
    out = []
    for d, _, names in os.walk(directory):
        present = set(names)
        for n in names:
            if n.endswith(META_SUFFIX) and not n.endswith(TMP_SUFFIX) \
                    and n[: -len(META_SUFFIX)] in present:
                out.append(os.path.join(d, n[: -len(META_SUFFIX)]))
    return out

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
never between a checkpoint's renames) when its upload starts and held open
until it ends, retries included; from then on deleting their names changes
nothing for it.

Faults. Each request is retried by the engine with jittered backoff; a failed
attempt is retried whole, until ``remote_timeout`` after the upload started;
then the checkpoint is reported failed and the queue goes on. A NotFound from
the store is retried too (a multipart upload aborted under it: the upload
starts again). Not retried, as they never succeed: a local file that does not
match its metadata, a name or value the store refuses. A failure of the
thread itself fails every queued upload with its cause, and the next upload
starts the thread again.

Restart. At start, and retried as an upload is until it succeeds (then again
every ``remote_timeout``), the start-up round of :mod:`snapsvc.remote.upkeep`:
unfinished uploads that dead writers left are aborted, data objects without
``.meta`` removed, and (unless ``scan=False``: a rank of a multi-rank writer,
whose directory also holds the other ranks' files; its ranks agree on what to
upload, see :mod:`snapsvc.distributed.uploads`) every checkpoint complete
locally but not remotely is queued. Uploads go on meanwhile.

Retention (``keep_last``): after each upload, :func:`snapsvc.remote.upkeep.prune`.
"""

from __future__ import annotations

import asyncio
import collections
import io
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, BinaryIO, Callable, TypeVar

from ..files.metafile import META_SUFFIX, checkpoint_names, companions, read_meta, \
    stale_companions
from .store import CorruptSource, Store, open_store, remote_key
from .upkeep import Scope, prune, series_of, start_up
from .url import describe

__all__ = ["BACKLOG", "UploadJob", "Uploader", "series_of", "retrying", "GaveUp"]

log = logging.getLogger("snapsvc.remote")

BACKLOG = 4
_RETRY_S = (1.0, 2.0, 4.0, 8.0)  # between whole attempts, then 8 s each
T = TypeVar("T")


@dataclass
class UploadJob:
    """One checkpoint to upload: ``seq`` is the writer's (None when found at start)."""

    seq: int | None
    path: str  # the local main file
    key: str   # its key under the remote root


@dataclass
class _Opened:
    """A job's files, open from its first attempt to its end: (key, file, size, crc32)."""

    meta: bytes
    files: list[tuple[str, BinaryIO, int, int]] = field(default_factory=list)
    # companion keys an earlier copy of this name may have left, which this one lacks
    stale: list[str] = field(default_factory=list)

    def close(self) -> None:
        for _, f, _, _ in self.files:
            f.close()


Callback = Callable[[UploadJob, "str | None", "str | None", bool], None]


class Uploader:
    """A thread that uploads checkpoints under ``directory`` to ``location``.

    ``on_done(job, url, error, skipped)`` is called from that thread for each
    job: ``url`` on success, else ``error`` (no credentials in it).
    ``files_lock`` is held by the writer around each local write and rotation.
    ``names``: a file-name pattern of the only remote files this writer may
    remove at start (a rank's ``rank3.*``; see :class:`~snapsvc.remote.upkeep.Scope`).
    """

    def __init__(self, location: str, directory: str, *, remote_timeout: float,
                 options: dict[str, Any] | None, keep_last: int | None,
                 on_done: Callback, files_lock: threading.Lock | None = None,
                 backlog: int = BACKLOG, scan: bool = True,
                 uncommit: tuple[str, ...] = (), names: str | None = None) -> None:
        self.location = location
        self.scan = scan  # queue at start what the directory holds and the remote lacks
        # names in a checkpoint's folder that vouch for it too (a multi-rank step's
        # manifest): deleted with its .meta, before any data
        self.uncommit = tuple(uncommit)
        self.names = names
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
        self._active: UploadJob | None = None
        # paths whose upload this writer began, until the start-up round has run
        self._taken: set[str] | None = set()
        self._close_by: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._event: asyncio.Event | None = None
        self._starting = True  # the first start-up round has not ended
        self._created: dict[str, tuple[float, float]] = {}  # for prune: one read per .meta
        self._started = 0.0
        self._thread: threading.Thread | None = None

    # --- the writer's side -------------------------------------------------

    def start(self) -> None:
        self._started = time.time()
        self._start_thread()

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=self._run, name="snapsvc-upload", daemon=True)
        self._thread.start()

    def key(self, path: str) -> str:
        """The remote key of the local file ``path`` (ValueError if outside the
        directory, or a name the remote cannot hold)."""
        return remote_key(self.location, self.directory, os.path.abspath(path))

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
            # a thread that failed starts again with the next upload
            restart = self._thread is not None and not self._thread.is_alive() \
                and self._close_by is None
            if restart:
                self._start_thread()
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
            return not self._queue and self._active is None

    def close(self, timeout: float) -> None:
        """Upload what is queued for up to ``timeout`` s, then give up on the rest
        (each reported failed) and stop the thread."""
        deadline = time.monotonic() + timeout
        with self._mutex:
            self._close_by = deadline
            thread = self._thread
        self._wake()
        if thread is None or not thread.is_alive():
            self._fail_queued("not uploaded: the writer closed before its turn")
            return
        thread.join(max(0.0, deadline - time.monotonic()))
        loop, task = self._loop, self._task
        if thread.is_alive() and loop is not None and task is not None:
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # the loop ended meanwhile
                pass
        thread.join(30.0)
        if thread.is_alive():
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

    def _busy(self) -> set[str]:
        """The keys of this writer's uploads, queued or under way (never removed at start)."""
        with self._mutex:
            jobs = list(self._queue) + ([self._active] if self._active else [])
        return {k for j in jobs for k in checkpoint_names(j.key)}

    def _handled(self, path: str) -> bool:
        """Is ``path`` queued, or was its upload begun, by this writer? (the start-up
        round, running beside the uploads, leaves it alone)"""
        with self._mutex:
            return path in self._unopened or path in (self._taken or ())

    def _fail_queued(self, why: str) -> None:
        """Report every queued job failed with ``why`` (the thread is not running)."""
        with self._mutex:
            left = list(self._queue)
            self._queue.clear()
            for job in left:
                self._forget(job)
        for job in left:
            self._on_done(job, None, why, False)

    # --- the upload thread -------------------------------------------------

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except asyncio.CancelledError:  # close() ran out of time: the rest is reported below
            pass
        except BaseException as e:  # a bug, or the engine panicking: no handle may wait
            why = describe(e, self.options)
            log.error("the upload thread failed (%s); the next upload starts it again", why,
                      exc_info=(type(e), e, e.__traceback__))
            self._fail_queued(f"not uploaded: the upload thread failed: {why}")
            return
        self._fail_queued("not uploaded: the writer closed before its turn "
                          f"(remote_timeout={self.remote_timeout:g} s)")

    async def _main(self) -> None:
        self._event = asyncio.Event()
        self._task = asyncio.current_task()
        self._loop = asyncio.get_running_loop()
        self._wake()  # an enqueue before the loop existed
        store = open_store(self.location, remote_timeout=self.remote_timeout,
                           options=self.options)
        background = asyncio.create_task(self._start_up(store))
        try:
            while True:
                job = await self._next()
                if job is None:
                    return
                await self._one(store, job)
        finally:
            background.cancel()

    async def _one(self, store: Store, job: UploadJob) -> None:
        """Upload ``job`` and report it; then rotate its series."""
        try:
            url, error = await self._upload(store, job), None
        except GaveUp as e:
            url, error = None, str(e)
        except asyncio.CancelledError:  # close() ran out of time during this one
            log.warning("not uploaded: %s; the writer closed before its upload committed "
                        "(remote_timeout=%g s)", job.path, self.remote_timeout)
            self._on_done(job, None, "not uploaded: the writer closed before its upload "
                          f"committed (remote_timeout={self.remote_timeout:g} s)", False)
            raise
        except BaseException as e:  # a bug, an engine panic: this job fails, the queue goes on
            log.exception("uploading %s failed", job.path)
            url, error = None, f"{store.key_url(job.key)}: {describe(e, self.options)}"
        finally:
            with self._mutex:
                self._active = None
        if error is not None:
            log.error("uploading %s failed: %s", job.path, error)
        self._on_done(job, url, error, False)
        if url is not None and self.keep_last is not None:
            try:
                await asyncio.wait_for(prune(store, job.key, self.keep_last, self._created),
                                       self.remote_timeout)
            except Exception as e:  # the engine's errors, a timeout: the next upload retries
                log.warning("remote rotation after %s failed: %s", job.key,
                            describe(e, self.options))

    async def _next(self) -> UploadJob | None:
        """Wait for the newest job; None once closing, nothing is left and the
        first start-up round has ended (it may queue more)."""
        assert self._event is not None
        while True:
            self._event.clear()  # before looking: a later enqueue sets it again
            with self._mutex:
                if self._queue:
                    self._active = self._queue.pop()
                    if self._taken is not None:
                        self._taken.add(self._active.path)
                    return self._active
                if self._close_by is not None and not self._starting:
                    return None
            await self._event.wait()

    async def _start_up(self, store: Store) -> None:
        """The start-up round, retried as an upload is, then every ``remote_timeout``."""
        scope = Scope(self.directory, self.names, self._busy)
        try:
            while True:
                try:
                    todo = await self._retry(lambda: start_up(
                        store, scope, started=self._started, remote_timeout=self.remote_timeout,
                        keep=self.uncommit, scan=self.scan, key_of=self.key,
                        queued=self._handled, keep_last=self.keep_last, created=self._created),
                        "checking the remote tier at start")
                    with self._mutex:
                        self._taken = None
                    break
                except GaveUp as e:
                    log.warning("%s; checkpoints not uploaded before this writer started wait "
                                "for it, tried again in %g s", e, self.remote_timeout)
                self._end_first_round()
                await asyncio.sleep(self.remote_timeout)
            for path in todo:  # oldest first in, so newest first out
                log.info("uploading %s: durable locally but not on the remote tier", path)
                self.enqueue(None, path)
        except Exception:  # a bug: uploads go on without the round
            log.exception("the remote tier's start-up round failed; checkpoints not uploaded "
                          "before this writer started stay local")
        finally:
            self._end_first_round()

    def _end_first_round(self) -> None:
        with self._mutex:
            self._starting = False
        self._wake()

    def _retry(self, attempt: Callable[[], Awaitable[T]], what: str) -> Awaitable[T]:
        return retrying(attempt, what, timeout=self.remote_timeout, options=self.options,
                        close_by=lambda: self._close_by)

    async def _upload(self, store: Store, job: UploadJob) -> str:
        url = store.key_url(job.key)
        opened = _open(job, self._files_lock)
        with self._mutex:  # from here on, the local rotation may take their names
            self._forget(job)
        try:
            await self._retry(lambda: self._attempt(store, job, opened), f"uploading {url}")
            return url
        finally:
            opened.close()

    async def _attempt(self, store: Store, job: UploadJob, opened: _Opened) -> None:
        for _, f, _, _ in opened.files:
            f.seek(0)
        folder = job.key.rpartition("/")[0]
        for name in self.uncommit:
            await store.delete(f"{folder}/{name}".lstrip("/"))
        await store.delete(job.key + META_SUFFIX)  # uncommit an older copy of this name
        for key in opened.stale:  # and drop its companions that this copy lacks, as locally
            await store.delete(key)
        await asyncio.gather(*(store.put(k, f, size=s, crc32=c) for k, f, s, c in opened.files))
        await store.put(job.key + META_SUFFIX, io.BytesIO(opened.meta))  # last: the commit


class GaveUp(Exception):
    """Work that failed for good (:func:`retrying`); the message says why."""


async def retrying(attempt: Callable[[], Awaitable[T]], what: str, *, timeout: float,
                   options: dict[str, Any], close_by: Callable[[], float | None]) -> T:
    """``attempt()``, retried whole with backoff until ``timeout`` from now (sooner
    once ``close_by()``, the writer's closing deadline, is set); :class:`GaveUp`
    saying why it failed."""
    started = time.monotonic()
    deadline = started + timeout
    tries, last = 0, ""
    while True:
        closing = close_by()
        if closing is not None:
            deadline = min(deadline, max(closing, time.monotonic()))
        try:
            return await asyncio.wait_for(attempt(), deadline - time.monotonic())
        except CorruptSource as e:  # never retried: it will not change
            raise GaveUp(f"{what}: {e}") from None
        except (ValueError, TypeError) as e:  # a name or value the store refuses
            raise GaveUp(f"{what}: {describe(e, options)}; not retried") from None
        except asyncio.TimeoutError:
            raise GaveUp(f"{what}: not done within remote_timeout={timeout:g} s "
                          f"({tries + 1} attempt(s){last}); check the endpoint and the "
                          "network, or raise remote_timeout") from None
        except Exception as e:  # the engine's errors: network, auth, server, NotFound
            why = describe(e, options)
            last = f", the last: {why}"
            wait = _RETRY_S[min(tries, len(_RETRY_S) - 1)]
            if time.monotonic() + wait >= deadline:
                raise GaveUp(f"{what}: failed after {tries + 1} attempt(s) in "
                              f"{time.monotonic() - started:.1f} s: {why}") from None
            log.warning("%s failed (%s); retrying in %g s", what, why, wait)
            tries += 1
            await asyncio.sleep(wait)


def _beside(key: str, name: str) -> str:
    """The key of the file ``name`` in the folder of ``key``."""
    return f"{key.rpartition('/')[0]}/{name}".lstrip("/")


def _open(job: UploadJob, files_lock: threading.Lock) -> _Opened:
    """``job``'s files, opened under the writer's lock (never between a write's renames)."""
    opened = _Opened(b"")
    with files_lock:
        try:
            meta = read_meta(job.path)
            with open(job.path + META_SUFFIX, "rb") as f:
                opened.meta = f.read()
            opened.files.append((job.key, open(job.path, "rb"), meta.size, meta.crc32))
            folder = os.path.dirname(job.path)
            beside = companions(job.path, meta)  # the optimizer file, the data file
            for c in beside:
                opened.files.append((_beside(job.key, c.name),
                                     open(os.path.join(folder, c.name), "rb"), c.size, c.crc32))
            opened.stale = [_beside(job.key, os.path.basename(n)) for n in stale_companions(
                job.path, [os.path.join(folder, c.name) for c in beside] + [job.path])]
        except (OSError, ValueError) as e:  # gone, or unreadable metadata: final
            opened.close()
            raise GaveUp(f"{job.path}: {e}") from None
    return opened

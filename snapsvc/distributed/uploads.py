"""The remote tier of a multi-rank writer: this rank's thread that commits each step remotely.

Each rank's sidecar uploads its own files as a single-process writer does
(:class:`snapsvc.remote.upload.Uploader`: the rank file, optimizer file and data file
checked against their ``.meta`` on the way, ``.meta`` last). Then, per step
committed locally, in commit order, on a thread and a gloo group of their own
(so that a slow upload never delays the local commits of later steps)::

    wait for this rank's upload (its WriteHandle.uploaded())
    all_gather (ok | reason)                                  [upload group]
    rank 0: if every rank's upload committed, and the step's remote listing has
            every file the manifest lists with its recorded size:
            put step_N/manifest.msgpack (the local manifest's bytes), last
            then remote_keep_last: the complete steps beyond the newest N in
            write order (each manifest's created time), never this one, lose
            their manifest first, then their other objects
    broadcast (step URL | None, reason) from rank 0            [upload group]
    resolve uploaded() on every rank: the step's URL, or UploadError

Catch-up, first, at the thread's start: the steps an earlier run left
complete locally but not remotely (a crash, an outage, a close past
``remote_timeout``) go through the same exchange, newest first::

    rank 0: the complete local steps (manifest, sizes) that the remote tier
            lacks complete (tier.remote_complete_steps), or holds with other
            files; those remote_keep_last would remove at once are skipped;
            the listing is retried as an upload is, and if it still fails,
            every rank runs the catch-up again after the next step's exchange
    broadcast (steps) from rank 0                             [upload group]
    every rank: its own file of each step, as the manifest lists it, to its
            sidecar's uploader (SnapshotWriter._upload_durable), oldest first
            in, so that the newest goes first out
    then, per step, the exchange above; outcomes are logged (no handle), and
    close() names the steps not uploaded

No rank's training loop waits on any of it: ``submit()`` only queues.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import queue
import threading
from typing import Any, Callable

from ..engine.handles import WriteHandle
from ..errors import UploadError
from ..files.meta import META_SUFFIX
from ..remote.fetch import run_sync
from ..remote.store import Store, open_store
from ..remote.upload import BACKLOG, GaveUp, retrying
from ..remote.url import describe
from .coord import _all_gather_msg, _broadcast_msg, _reason
from .handles import DistributedWriteHandle
from .manifest import MANIFEST_NAME, _complete_local, _missing, read_manifest, step_dir, \
    step_number
from .tier import remote_complete_steps

__all__ = ["Uploads", "upload_wait"]

log = logging.getLogger("snapsvc")


def upload_wait(remote_timeout: float) -> float:
    """How long a rank waits for its own upload: the sidecar's uploader gives each
    ``remote_timeout``, newest first, and skips a checkpoint once ``BACKLOG``
    newer ones are queued, so an upload is decided within this."""
    return remote_timeout * (BACKLOG + 2)


class Uploads:
    """The upload exchanges of one rank (see the module docstring)."""

    def __init__(self, remote: str, directory: str, group: Any, root: int, rank: int,
                 world_size: int, *, remote_timeout: float, remote_options: dict[str, Any],
                 keep_last: int | None, upload: Callable[[str], WriteHandle],
                 group_timeout: float) -> None:
        self.remote = remote
        self.directory = directory
        self.group = group
        self.root = root
        self.rank = rank
        self.world_size = world_size
        self.remote_timeout = remote_timeout
        self.options = remote_options
        self.keep_last = keep_last
        self.wait_s = upload_wait(remote_timeout)
        self.upload = upload   # a file durable already, to this rank's sidecar's uploader
        # the catch-up: set once its files are with the sidecar (close() stops it after);
        # its listing and broadcast are bounded by remote_timeout and the group's timeout
        self.handed = threading.Event()
        self.catch_up_s = remote_timeout + group_timeout
        self.found: list[DistributedWriteHandle] = []   # the catch-up's steps, newest first
        self.catch_up_due = False   # rank 0 could not list the remote tier: again later
        self.queue: "queue.Queue[DistributedWriteHandle | None]" = queue.Queue()
        self.lock = threading.Lock()
        self.unresolved: dict[int, DistributedWriteHandle] = {}
        self.broken: str | None = None
        self.counts = {"uploaded": 0, "upload_failed": 0}
        self.thread = threading.Thread(target=self._run, name="snapsvc-dist-upload",
                                       daemon=True)

    def start(self) -> None:
        self.thread.start()

    def add(self, handle: DistributedWriteHandle) -> None:
        """Queue a step committed locally on every rank (called in commit order)."""
        with self.lock:
            self.unresolved[handle.seq] = handle
        self.queue.put(handle)

    def handed_over(self, timeout: float | None) -> None:
        """Wait until the catch-up's files are with the sidecar (before it is stopped)."""
        if self.thread.ident is not None:
            self.handed.wait(self.catch_up_s if timeout is None else timeout)

    def stop(self, timeout: float | None) -> bool:
        """Finish what is queued (the sidecar has settled its uploads by now);
        True if the thread ended within ``timeout``. Past it, what is left fails.
        Logs the catch-up's steps that were not uploaded."""
        self.queue.put(None)
        if self.thread.ident is None:
            return True
        self.thread.join(timeout)
        ended = not self.thread.is_alive()
        if not ended:
            with self.lock:
                late = list(self.unresolved.values())
                self.unresolved.clear()
            for h in late:
                h.fail_upload(f"not uploaded: the writer was closed before the ranks agreed "
                              f"on the remote copy (close timeout {timeout} s)")
        left = {}
        for h in self.found:
            try:
                h.uploaded(timeout=0)
            except (UploadError, TimeoutError) as e:
                left[h.step] = str(e)
        if left:
            log.error("snapsvc: step(s) %s, complete locally before this writer started, were "
                      "not uploaded; a writer started later on %s with remote= uploads them: %s",
                      sorted(left), self.directory, "; ".join(left.values()))
        return ended

    def _run(self) -> None:
        self._catch_up_round()
        while True:
            h = self.queue.get()
            if h is None:
                return
            again = self.catch_up_due   # every rank knows it: their exchanges pair up
            if again:   # before this step's uploaded() resolves: close() waits for the round
                self.handed.clear()
            self._exchange(h)
            if again:
                self._catch_up_round()

    def _catch_up_round(self) -> None:
        """The catch-up (its files handed to the sidecar, then ``handed`` set), then
        the exchange of each step it found."""
        try:
            found = [] if self.broken is not None else self._catch_up()
        except BaseException as e:  # a bug: the ranks' exchanges may no longer pair up
            log.exception("snapsvc: looking for steps to upload from an earlier run failed")
            self.broken = self.broken or f"rank {self.rank}: {_reason(e)}"
            return
        finally:
            self.handed.set()
        self.found += found
        for h in found:
            self._exchange(h)

    def _exchange(self, h: DistributedWriteHandle) -> None:
        try:
            self._one(h)
        except BaseException as e:  # never let the thread die silently
            log.exception("snapsvc: committing step %d on the remote tier failed", h.step)
            self.broken = self.broken or f"rank {self.rank}: {_reason(e)}"
            self._done(h, None, f"not uploaded: {_reason(e)}")

    # -- the catch-up ----------------------------------------------------------------
    def _catch_up(self) -> list[DistributedWriteHandle]:
        """The steps an earlier run left local-only, each rank's file of each handed to
        its sidecar (see the module docstring); their handles, newest first. When rank 0
        could not list the remote tier, every rank tries again after the next step."""
        steps = self._left_local() if self.rank == 0 else []
        try:
            steps = _broadcast_msg(steps, self.root, self.group)
        except Exception as e:
            self.broken = f"agreeing on the steps an earlier run left local-only failed: " \
                          f"{_reason(e)}"
            log.error("snapsvc: %s; they stay local-only", self.broken)
            return []
        self.catch_up_due = steps is None
        if steps is None:
            return []
        found = [self._hand_over(n) for n in sorted(steps)]  # oldest first in: newest out
        return found[::-1]

    def _hand_over(self, step: int) -> DistributedWriteHandle:
        """This rank's file of ``step`` (as its manifest lists it) to the sidecar's uploader."""
        path = step_dir(self.directory, step)
        # no user holds it: a seq of its own, below the writer's (which start at 1)
        h = DistributedWriteHandle(-1 - step, path, step, self.rank, "", remote=True)
        try:
            h.file = os.path.join(path, read_manifest(path).ranks[self.rank].file)
            h.local = self.upload(h.file)
        except Exception as e:  # the sidecar is gone, or the step since: the others learn why
            h.local = WriteHandle(0, h.file or path, remote=True)
            h.local.fail_upload(f"not handed to the uploader: {_reason(e)}")
        with self.lock:
            self.unresolved[h.seq] = h
        return h

    def _left_local(self) -> list[int] | None:
        """Rank 0: the complete local steps of this world size that the remote tier lacks
        complete, or holds with other files, less those ``remote_keep_last`` would
        remove at once; oldest first. None when the remote tier could not be listed
        (retried as an upload is)."""
        local = {n: m for n, m in _complete_local(self.directory)}
        if not local:
            return []

        async def listing() -> dict[int, Any]:
            return dict(await remote_complete_steps(self._store(), above=min(local) - 1))

        try:
            remote = run_sync(retrying(listing, f"listing {self.remote} at start",
                                       timeout=self.remote_timeout, options=self.options,
                                       close_by=lambda: None))
        except GaveUp as e:
            log.error("snapsvc: %s; steps an earlier run left local-only are looked for "
                      "again after the next step", e)
            return None
        todo = [n for n, m in sorted(local.items())
                if n not in remote or remote[n].ranks != m.ranks]
        other = [n for n in todo if local[n].world_size != self.world_size]
        if other:
            log.warning("snapsvc: not uploading step(s) %s of %s: saved at another world size, "
                        "so some ranks' files have no rank here to upload them", other,
                        self.directory)
            todo = [n for n in todo if n not in other]
        if self.keep_last is not None:
            # write order, as _prune ranks: what each manifest records it was created at
            when = {n: m.created for n, m in remote.items()} | {n: local[n].created for n in todo}
            kept = sorted(when, key=lambda n: (when[n], n))[-self.keep_last:]
            late = [n for n in todo if n not in kept]
            if late:
                log.warning("snapsvc: not uploading step(s) %s of %s: remote_keep_last=%d would "
                            "remove them at once (newer steps %s are, or will be, complete "
                            "remotely)", late, self.directory, self.keep_last, kept)
                todo = [n for n in todo if n in kept]
        if todo:
            log.info("snapsvc: uploading step(s) %s of %s, complete locally but not on the "
                     "remote tier", todo, self.directory)
        return todo

    def _done(self, h: DistributedWriteHandle, url: str | None, why: str | None) -> None:
        with self.lock:
            self.unresolved.pop(h.seq, None)
        self.counts["uploaded" if url is not None else "upload_failed"] += 1
        if url is not None:
            if h.seq < 0:   # the catch-up's: no handle to tell
                log.info("snapsvc: uploaded step %d, left local-only by an earlier run: %s",
                         h.step, url)
            try:
                h._upload.set_result(url)
            except Exception:  # InvalidStateError: a racing close() failed it first
                pass
        else:
            h.fail_upload(why or "not uploaded")

    def _local(self, h: DistributedWriteHandle) -> dict[str, Any]:
        """This rank's upload outcome, as sent to the others."""
        assert h.local is not None
        try:
            h.local.uploaded(timeout=self.wait_s)
        except UploadError as e:
            return {"ok": False, "error": _reason(e).removeprefix("UploadError: ")}
        except TimeoutError:
            return {"ok": False, "error": f"its upload was not decided within {self.wait_s:g} s"}
        except Exception as e:
            return {"ok": False, "error": _reason(e)}
        return {"ok": True, "error": None}

    def _one(self, h: DistributedWriteHandle) -> None:
        step = h.step
        if self.broken is not None:
            self._done(h, None, f"not uploaded: the ranks' upload exchange failed earlier "
                                f"({self.broken})")
            return
        mine = self._local(h)
        try:
            gathered = _all_gather_msg(mine, self.world_size, self.group)
        except Exception as e:
            self.broken = f"exchanging upload results failed: {_reason(e)}"
            self._done(h, None, f"not uploaded (no remote manifest): {self.broken}; a rank "
                                "died or hung")
            return
        failures = {r: g["error"] for r, g in enumerate(gathered) if not g["ok"]}
        decision: list[Any] = [None, None]
        if self.rank == 0:
            if failures:
                decision[1] = "; ".join(f"rank {r}: {why}" for r, why in sorted(failures.items()))
            else:
                try:
                    decision[0] = self._commit(h)
                except Exception as e:
                    decision[1] = f"rank 0: writing the remote manifest: " \
                                  f"{describe(e, self.options)}"
        committed_here = decision[0]
        try:
            decision = _broadcast_msg(decision, self.root, self.group)
        except Exception as e:
            self.broken = f"the remote commit decision did not arrive from rank 0: {_reason(e)}"
            if committed_here is None:
                self._done(h, None, f"not uploaded: {self.broken}; the step may or may not be "
                                    "complete remotely: latest_checkpoint() decides")
                return
            decision = [committed_here, None]
        url, why = decision
        if url is None:
            log.error("step %d not committed on the remote tier: %s", step, why)
            self._done(h, None, f"step {step} not committed on the remote tier (no remote "
                                f"manifest): {why}")
            return
        self._done(h, url, None)
        if self.rank == 0 and self.keep_last is not None:
            try:
                run_sync(asyncio.wait_for(_prune(self._store(), self.keep_last, step),
                                          self.remote_timeout))
            except Exception as e:
                log.warning("remote rotation after step %d failed: %s", step,
                            describe(e, self.options))

    def _store(self) -> Store:
        # opened in this thread, for each use: obstore's clients do not survive a fork()
        return open_store(self.remote, remote_timeout=self.remote_timeout, options=self.options)

    def _commit(self, h: DistributedWriteHandle) -> str:
        """Rank 0: the step's manifest on the remote tier, after checking the listing; its URL."""
        key = os.path.relpath(h.path, self.directory).replace(os.sep, "/")
        m = read_manifest(h.path)
        with open(os.path.join(h.path, MANIFEST_NAME), "rb") as f:
            data = f.read()

        async def commit() -> str:
            store = self._store()
            url = store.key_url(key)
            listed = {o.key[len(key) + 1:]: o.size for o in await store.list(f"{key}/")}
            problems = _missing(m, listed.get, url)
            if problems:
                raise RuntimeError("the remote copy is not what the manifest lists: "
                                   + "; ".join(problems))
            await store.put(f"{key}/{MANIFEST_NAME}", io.BytesIO(data))  # last: the commit
            return url

        return run_sync(asyncio.wait_for(commit(), self.remote_timeout))


async def _prune(store: Store, keep_last: int, committed: int) -> None:
    """``remote_keep_last``, rank 0's: the complete steps beyond the newest ``keep_last`` in
    write order (the ``created`` time each manifest records, not the step number,
    which a run resumed from an earlier step repeats) lose their manifest first,
    then their ``.meta``, then the rest; never the step just ``committed``."""
    assert keep_last >= 1  # the newest always stays
    objects = await store.list()
    ranked = sorted(await remote_complete_steps(store, objects=objects),
                    key=lambda nm: (nm[1].created, nm[0]))
    kept = {n for n, _ in ranked[-keep_last:]} | {committed}
    steps: dict[int, list[str]] = {}
    for o in objects:
        n = step_number(o.key.partition("/")[0])
        if n is not None and n not in kept:
            steps.setdefault(n, []).append(o.key)
    for n, keys in sorted(steps.items()):
        manifest = f"step_{n}/{MANIFEST_NAME}"
        if manifest not in keys:
            continue  # never committed: an upload under way, or not a checkpoint
        await store.delete(manifest)  # first: it vouches for the rest
        rest = sorted((k for k in keys if k != manifest),
                      key=lambda k: not k.endswith(META_SUFFIX))
        for k in rest:
            await store.delete(k)
        log.info("remote rotation: removed %s", store.key_url(f"step_{n}"))

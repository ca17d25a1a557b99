"""SnapsvcTrainer's committer: a checkpoint directory appears whole, or not at all.

The trainer writes HF's small files into a hidden ``.snapsvc-checkpoint-<N>``
directory and submits the state to the sidecar; the committer thread then::

    wait for the sidecar's write (its handle)
    fsync every file in the hidden directory, and the directory
    rename it to checkpoint-<N> (a step saved again replaces its directory)
    fsync the run directory; rotate as save_total_limit says

A failure is kept, named after the checkpoint it lost, and raised by the
trainer at its next save, at close, or when training ends.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import shutil
import threading
import time

from transformers.trainer_utils import rotate_checkpoints

from ...engine.writer import WriteHandle
from ...errors import BrokenWriterError, DistributedCheckpointError, SnapsvcError, \
    WriteFailedError
from ...files.durable import fsync_dir

__all__ = ["STAGING_PREFIX", "Commit", "Committer"]

log = logging.getLogger("snapsvc")

STAGING_PREFIX = ".snapsvc-"   # + "checkpoint-<N>": hidden from HF's "checkpoint-*" globs


@dataclasses.dataclass
class Commit:
    handle: WriteHandle
    staging: str                        # "" on ranks that only wait for the manifest
    final: str
    run_dir: str
    rotate: bool
    save_total_limit: int | None
    best_model_checkpoint: str | None


class Committer:
    """The committer thread and its books (see the module docstring)."""

    def __init__(self) -> None:
        self._queue: "queue.Queue[Commit | None]" = queue.Queue()
        self._pending: dict[str, Commit] = {}   # final dir -> its commit, until done
        self._failed: list[SnapsvcError] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._warned_wait = False

    def start(self) -> bool:
        """Start the thread if it is not running; True if it was started now."""
        if self._thread is not None:
            return False
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="snapsvc-hf-committer")
        self._thread.start()
        return True

    def stop(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=10)
            self._thread = None

    def add(self, item: Commit) -> None:
        with self._cond:
            self._pending[item.final] = item
        self._queue.put(item)

    def pending(self, final: str) -> bool:
        """Whether a commit of the directory ``final`` is still under way."""
        with self._cond:
            return final in self._pending

    def remove_leftovers(self, run_dir: str) -> None:
        """Remove the hidden directories in ``run_dir`` that no pending commit
        owns: a crash left them."""
        try:
            names = os.listdir(run_dir)
        except FileNotFoundError:
            return
        with self._cond:
            owned = {c.staging for c in self._pending.values()}
        for n in names:
            path = os.path.join(run_dir, n)
            if n.startswith(STAGING_PREFIX) and path not in owned and os.path.isdir(path):
                log.info("snapsvc: removing %s, an unfinished checkpoint", path)
                shutil.rmtree(path, ignore_errors=True)

    def count(self) -> int:
        """How many submitted checkpoints are not committed or failed yet."""
        with self._cond:
            return len(self._pending)

    def drain(self, timeout: float) -> None:
        """Wait until every submitted checkpoint is committed or failed."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"checkpoints {sorted(self._pending)} not committed within "
                        f"{timeout:g} s (SnapsvcTrainer.drain_timeout); they stay hidden until "
                        "they are")
                self._cond.wait(left)

    def raise_failed(self) -> None:
        """Raise the first failure not raised yet (the others are logged)."""
        with self._cond:
            failed, self._failed = self._failed, []
        if failed:
            if len(failed) > 1:
                log.error("snapsvc: also lost: %s", "; ".join(str(e) for e in failed[1:]))
            raise failed[0]

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                _commit(item)
                self._note_wait(item)
            except BaseException as e:  # the thread must go on; the trainer raises it
                if item.staging:
                    shutil.rmtree(item.staging, ignore_errors=True)
                err = _named(e, item.final)
                log.error("%s", err)
                with self._cond:
                    self._failed.append(err)
            finally:
                with self._cond:
                    if self._pending.get(item.final) is item:
                        del self._pending[item.final]
                    self._cond.notify_all()

    def _note_wait(self, item: Commit) -> None:
        """Warn once when a save waited for a free slot longer than it copied: the
        sidecar was still writing earlier checkpoints, so the save waited for the disk."""
        r = item.handle.result()
        copy = r.stage_s - r.slot_wait_s
        if self._warned_wait or r.slot_wait_s <= copy:
            return
        self._warned_wait = True
        log.warning(
            "snapsvc: saving %s waited %.2f s for a free slot (its copy took %.2f s): every "
            "slot held an earlier checkpoint the sidecar was still writing (this one was "
            "queued %.2f s, encoded and written in %.2f s, fsynced in %.2f s). Save less "
            "often (save_steps), give the sidecar more CPU (snapsvc_options={'nice': 0}, the "
            "default on CPU runs) or more slots (snapsvc_options={'slots': N}; each holds a "
            "checkpoint in shared memory)", os.path.basename(item.final), r.slot_wait_s, copy,
            r.queue_s, r.encode_s + r.write_s, r.fsync_s)


def _commit(item: Commit) -> None:
    report = item.handle.result()   # resolves: written, failed, or the sidecar died
    if not item.staging:
        return
    if report.skipped:
        log.warning("snapsvc: %s skipped by the writer's policy; not committed", item.final)
        shutil.rmtree(item.staging, ignore_errors=True)
        return
    _fsync_tree(item.staging)
    old = None
    if os.path.isdir(item.final):  # a step saved again replaces its directory
        old = os.path.join(item.run_dir, STAGING_PREFIX + "old-" + os.path.basename(item.final))
        shutil.rmtree(old, ignore_errors=True)
        os.rename(item.final, old)
    os.rename(item.staging, item.final)
    fsync_dir(item.run_dir)
    if os.path.dirname(item.staging) != item.run_dir:
        fsync_dir(os.path.dirname(item.staging))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    if item.rotate:
        rotate_checkpoints(output_dir=item.run_dir, save_total_limit=item.save_total_limit,
                           best_model_checkpoint=item.best_model_checkpoint, use_mtime=True)


def _fsync_tree(directory: str) -> None:
    """fsync every file under ``directory`` and each directory. HF's writers
    (config, generation config, tokenizer, remote code) do not all say what they
    wrote; the sidecar's files are durable already, and fsync of a clean file is cheap."""
    for root, _, names in os.walk(directory, topdown=False):
        for name in names:
            path = os.path.join(root, name)
            if os.path.isfile(path) and not os.path.islink(path):
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        fsync_dir(root)


def _named(err: BaseException, checkpoint: str) -> SnapsvcError:
    """``err`` as a snapsvc error whose message names the checkpoint that was lost."""
    what = f"checkpoint {checkpoint} was not written, so it is not on disk"
    if isinstance(err, BrokenWriterError):
        out: SnapsvcError = BrokenWriterError(f"{what}: {err}")
    elif isinstance(err, DistributedCheckpointError):
        out = DistributedCheckpointError(f"{what}: {err}", step=err.step, failures=err.failures,
                                         timed_out=err.timed_out)
    elif isinstance(err, OSError):
        out = WriteFailedError(err.errno or 0, f"{what}: {err.strerror or err}",
                               err.filename or checkpoint)
    else:
        out = WriteFailedError(0, f"{what}: {type(err).__name__}: {err}", checkpoint)
    out.__cause__ = err
    return out

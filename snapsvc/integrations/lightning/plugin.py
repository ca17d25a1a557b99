"""``SnapsvcCheckpointIO`` itself: save, load, remove, teardown (``snapsvc.integrations.lightning``).

Paths. Lightning's paths resolve against the working directory, as with its
own IO; ``file://`` URLs are local paths. Other URLs (``s3://``, ``gs://``)
are refused with :class:`~snapsvc.errors.PathError` when ``fit`` starts
(a ``ModelCheckpoint`` directory), and at save, load and removal: they
belong to a remote tier (a ``remote=`` option), which this version does not
have, and writing them under a local folder named ``s3:`` would lose them.
A symlink (``ModelCheckpoint(save_last="link")``) is read through to the
checkpoint it points at.

Overlap (``SnapsvcCheckpointIO(overlap=True)``). ``save_checkpoint``
copies the parameters, buffers and everything else at once, and returns
before each optimizer's per-parameter state (Adam's moments: two thirds of
an AdamW checkpoint) is copied; that copy runs on behind the next step.
Each optimizer of the fitting trainer gets ``SnapshotWriter.guard``: its
next ``step`` waits for the copy. Lightning calls ``step`` with a closure
that runs ``training_step`` and the backward (automatic optimization) or
nothing (``self.optimizers().step()``, manual optimization); for torch's own
optimizers the wait comes at the end of that closure, after the forward and
backward, before the optimizer writes its state. An optimizer whose class
has its own ``step`` waits before the step starts. Batches that accumulate
gradients do not step, so the copy runs on through them. Only the
optimizer's step writes its per-parameter state, which is why only that
part waits: parameters change outside a step too (``StochasticWeightAveraging``
and EMA callbacks write them in their hooks), as BatchNorm's buffers do in
every forward. A save outside a running ``fit`` (``trainer.save_checkpoint``
after it) copies everything, and, in every mode, returns once the file is
whole (as stock's does), then stops the sidecar. Loads, removals and ``teardown``
wait for pending copies as for pending writes.

What a checkpoint may hold. Whatever a save would refuse (a value of a type
snapsvc does not store, added in ``on_save_checkpoint`` or held in a
callback's ``state_dict()``) is refused when ``fit`` starts, not at the first
save an epoch in: as the fit loop starts (after the ``on_train_start`` hooks,
before the first training step), the trainer builds the checkpoint its saves
will hold (``dump_checkpoint``: the model's, optimizers', callbacks' and
datamodule's states, and every ``on_save_checkpoint`` hook), and the plugin
walks it as a save would, copying and writing nothing. So each of those hooks
runs once more than with stock, on every rank, and on a strategy that gathers
its states for a checkpoint (FSDP) the trial gathers them too. A value added
only later, by a hook that saves something else at a later step, is refused at
that save.

Readers. A load or removal of a path waits for every write of it still pending
in this process, whichever ``SnapsvcCheckpointIO`` submitted it (a second
Trainer, ``load_from_checkpoint``, the parent of a forked rank): each save is
recorded in a process-wide table of pending writes by path.

Multi-process (DDP): only rank 0 saves. ``load_checkpoint`` takes no collective
(as stock's does not), so a load on rank 0 alone (a ``@rank_zero_only``
callback) returns. The other ranks read what rank 0 wrote once
``trainer.save_checkpoint`` returns on every rank: Lightning puts a barrier
behind each save, and a save outside a running ``fit`` returns once written.
A rank other than 0 reading, inside ``fit``, a checkpoint that rank 0 saved in
that ``fit`` may find it still being written.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import threading
import weakref
from typing import Any, Callable, cast

import torch

from ...engine.plan import request
from ...engine.writer import SnapshotWriter, WriteHandle
from ...errors import EncodeError, FormatError, PathError, UnsupportedStateError
from ...files.checkpoint import checkpoint_version
from ...files.ramtier import held, read_first
from ...state.readback import load
from ...state.resume import checkpoint_files
from ...state.tree import StepState
from .hparams import decode_hparams, encode_hparams

__all__ = ["SnapsvcCheckpointIO", "is_snapsvc_file", "local_path", "read"]

log = logging.getLogger("snapsvc")

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


class SnapsvcCheckpointIO:
    """A Lightning ``CheckpointIO`` plugin that writes through a snapsvc sidecar.

    ``writer_options`` go to :class:`snapsvc.SnapshotWriter` (``overlap=True``: see
    the module docstring; the restart tier's ``persist_every``, ``keep_in_memory``,
    ``linger`` and ``memory_limit``: docs/restart.md); the sidecar starts
    at the first save and stops at ``teardown`` (the end of each ``fit``), or
    right after a save outside a running ``fit``, which returns once written; a
    plugin used without a trainer stops it when garbage-collected, its writes landed.
    ``timeout``: seconds that a load, a removal or the teardown waits for
    pending writes. A failed write raises on the next ``save_checkpoint``,
    load or ``teardown``, once.

    Lightning's checkpoint dict is stored as it is, hyper-parameters as
    :mod:`~snapsvc.integrations.lightning.hparams` lists. Loads never unpickle, so ``weights_only`` has no
    effect and a file Lightning's default IO wrote (a pickle) is refused with
    ``FormatError``; tensors load on the CPU unless ``map_location`` names a
    device.
    """

    def __init__(self, *, timeout: float = 600.0, **writer_options: Any) -> None:
        if "keep_last" in writer_options:
            raise ValueError("SnapsvcCheckpointIO does not take keep_last: retention belongs to "
                             "ModelCheckpoint (save_top_k, save_last), which lists the files it keeps, "
                             "the best one included; a writer pruning beside it deletes them")
        # Lightning records every saved path (best_model_path, top-k): a dropped
        # snapshot or a copy still running after save returns would be a silent loss.
        if writer_options.get("policy", "block") != "block":
            raise ValueError(f"SnapsvcCheckpointIO needs policy='block', got "
                             f"{writer_options['policy']!r}: Lightning expects every save to land")
        SnapshotWriter(**writer_options)  # bad options fail here, not at the first save (starts nothing)
        self.timeout = timeout
        self._options = writer_options
        self._writer: SnapshotWriter | None = None
        self._handles: list[WriteHandle] = []
        # path -> its removal, until its files are gone (see remove_checkpoint)
        self._doomed: dict[str, _Removal] = {}
        self._lock = threading.Lock()   # _doomed: the removals' thread changes it too
        # one thread runs the removals, in turn, started at the first: not a thread
        # per removal, whose start() waits until the new thread is scheduled
        self._removals: queue.SimpleQueue[_Removal | None] = queue.SimpleQueue()
        self._remover: threading.Thread | None = None
        self._trainer: Callable[[], Any] | None = None  # weakref to the fitting trainer (overlap)
        self._guards: list[tuple[torch.optim.Optimizer, Any]] = []  # (optimizer, its step hook)

    @property
    def writer(self) -> SnapshotWriter | None:
        """The running sidecar's client (None before the first save and after teardown)."""
        return self._writer

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike[str],
                        storage_options: Any | None = None) -> None:
        """Stage ``checkpoint`` for ``path`` and return; the sidecar writes it."""
        if storage_options is not None:
            raise TypeError(f"SnapsvcCheckpointIO.save_checkpoint takes no storage_options, got "
                            f"{storage_options!r}; pass writer options to SnapsvcCheckpointIO() instead")
        path = local_path(path)
        self._settle(path)   # a removal of this path behind its old write: done first
        self._raise_failed()
        checkpoint = encode_hparams(checkpoint)
        os.makedirs(os.path.dirname(path), exist_ok=True)  # as Lightning's own IO does: no one else makes it
        if self._writer is None:
            options = self._options
            if options.get("linger") and options.get("directory") is None:
                # a sidecar lingers for, and a restarted run finds it by, a directory:
                # the checkpoints' (paths are absolute, so nothing else changes)
                options = {**options, "directory": os.path.dirname(path)}
            self._writer = SnapshotWriter(**options).start()
            # used without a trainer, nothing calls teardown: dropping the plugin stops its sidecar
            self._release = weakref.finalize(self, _release, self._writer, self._removals, self.timeout)
        fitting = self._trainer is None or self._fitting()  # used alone, with no trainer: asynchronous
        if fitting and self._writer.overlap and self._guard_optimizers():
            checkpoint = _mark_step_state(checkpoint)
        handle = self._writer.submit(checkpoint, path)
        self._handles.append(handle)
        _PENDING.add(handle)
        if not fitting:
            # Outside a running fit (trainer.save_checkpoint after it, a Lightning
            # .temp.ckpt of a forked rank): stock's file is whole when the save returns,
            # and any reader (load_from_checkpoint, another Trainer) may read it now.
            # The sidecar stops too: nothing may save again, so it must not stay running.
            self.teardown()

    def _check_saveable(self, checkpoint: dict[str, Any]) -> None:
        """Raise what saving ``checkpoint`` would raise for its contents
        (``UnsupportedStateError``, ``EncodeError``), saying it was refused at
        ``fit`` start; nothing is copied or written. ``fit`` calls it with a
        trial checkpoint once the loop starts (see the module docstring)."""
        try:
            request(encode_hparams(checkpoint), None, None)
        except (UnsupportedStateError, EncodeError) as e:
            note = ("refused at fit start, before any training step (a trial of the checkpoint "
                    f"each save will hold): {e}")
            raise (UnsupportedStateError(note, path=e.path) if isinstance(e, UnsupportedStateError)
                   else EncodeError(note)) from None

    def load_checkpoint(self, path: str | os.PathLike[str], map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The dict saved at ``path``, once any pending write to it in this process is done."""
        if map_location is not None and not isinstance(map_location, (str, torch.device)):
            raise TypeError(f"SnapsvcCheckpointIO.load_checkpoint: map_location must be None, a str or "
                            f"a torch.device, got {type(map_location).__name__}")
        path = local_path(path)
        self._wait(path)
        self._raise_failed()
        return read(path, map_location)

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Remove every file of the checkpoint at ``path``, on a thread of its own.

        Neither a write to ``path`` still in the sidecar nor the removal itself
        is waited for: ``ModelCheckpoint`` drops a top-k file right after the
        next save, often while it is still being written, and unlinking a large
        file that was written durably can take as long as copying it (a file
        system that discards the freed blocks). The files go once written; from
        now on ``path`` exists for nobody (:meth:`pending` is False; a save or
        load of it, and ``teardown``, first finish the removal, and raise its
        error). A symlink is removed, not what it points at (as Lightning's own
        IO does)."""
        path = local_path(path)
        writes = _PENDING.of(path)
        removal = _Removal(path, writes[-1] if writes else None)
        with self._lock:
            if path in self._doomed:  # removed already, not saved since (a save settles it first)
                return
            self._doomed[path] = removal
            if self._remover is None:   # a daemon: teardown finishes what it has not
                self._remover = threading.Thread(  # holds the plugin weakly: see _release
                    target=_remove_all, args=(self._removals, weakref.WeakMethod(self._bury)),
                    name="snapsvc-remove", daemon=True)
                self._remover.start()
            self._removals.put(removal)

    def _bury(self, removal: _Removal, raise_error: bool = True) -> None:
        """Run ``removal`` (or wait for the thread running it); forget it once its files are gone.
        A failed one stays due, so the next save or load of its path and ``teardown`` raise it."""
        try:
            removal.run(self.timeout)
        except Exception as e:
            if not raise_error:
                log.warning("snapsvc: removing %s failed (raised at its next save or load, or at "
                            "teardown): %s", removal.path, e)
                return
            if removal.finished:  # raised once; a write still pending keeps it due
                self._forget(removal)
            raise
        self._forget(removal)

    def _forget(self, removal: _Removal) -> None:
        with self._lock:
            if self._doomed.get(removal.path) is removal:
                del self._doomed[removal.path]

    def _settle(self, path: str) -> None:
        """Finish a removal of ``path`` now: wait for its write, then remove."""
        removal = self._doomed.get(path)
        if removal is not None:
            self._bury(removal)

    def teardown(self) -> None:
        """Drain pending writes and stop the sidecar; raise the first failed write."""
        writer, self._writer = self._writer, None
        if writer is not None:
            self._release.detach()
        try:
            if writer is not None:
                writer.finish(timeout=self.timeout)  # overlap copies finish first
            for removal in list(self._doomed.values()):  # written now: removed here or by their thread
                self._bury(removal)
        finally:
            with self._lock:   # its thread stops once through what it holds (done by now)
                if self._remover is not None:
                    self._removals.put(None)
                    self._remover = None
            for _, hook in self._guards:
                hook.remove()
            self._guards = []
        self._raise_failed()

    def _fitting(self) -> bool:
        """Whether the trainer this plugin served in ``fit`` is inside a running one."""
        trainer = self._trainer() if self._trainer is not None else None
        state = getattr(trainer, "state", None)
        if state is None:
            return False
        return bool(getattr(state.fn, "value", state.fn) == "fit"   # str enums: their values
                    and getattr(state.status, "value", state.status) == "running")

    def __getstate__(self) -> dict[str, Any]:
        """What a spawned process gets (``ddp_spawn``): the options only, as with
        stock's IO; the sidecar, locks and threads are made anew there."""
        return {"timeout": self.timeout, "options": self._options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        SnapsvcCheckpointIO.__init__(self, timeout=state["timeout"], **state["options"])

    def pending(self, path: str | os.PathLike[str]) -> bool:
        """Whether a write to ``path`` is still in the sidecar."""
        path = local_path(path)
        return path not in self._doomed and any(h.path == path and not h.done()
                                                for h in self._handles)

    def removing(self, path: str | os.PathLike[str]) -> bool:
        """Whether ``path`` was removed while its write is still landing (gone once written)."""
        return local_path(path) in self._doomed

    def _guard_optimizers(self) -> bool:
        """Overlap mode: guard every optimizer of the fitting trainer (once each), so
        that its next step waits for this save's copy. False when there is no such
        trainer (a save outside ``fit``) or an optimizer is not a torch one: then
        the whole checkpoint is copied before ``save_checkpoint`` returns."""
        trainer = self._trainer() if self._trainer is not None else None
        optimizers = list(getattr(trainer, "optimizers", None) or [])
        if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
            return False
        assert self._writer is not None   # save_checkpoint started it before asking
        guarded = {id(o) for o, _ in self._guards}
        for opt in optimizers:
            if id(opt) not in guarded:
                self._guards.append((opt, self._writer.guard(opt)))
        return True

    def _wait(self, path: str) -> None:
        self._settle(path)
        for name in {path, os.path.realpath(path)}:  # a link's target may be the pending one
            for write in _PENDING.of(name):  # this plugin's or another's; its error is its owner's
                try:
                    write.exception(timeout=self.timeout)
                except TimeoutError:
                    raise TimeoutError(f"{name}: its pending write did not finish within "
                                       f"{self.timeout} s (SnapsvcCheckpointIO(timeout=...))") from None

    def _raise_failed(self) -> None:
        """Raise the first failed write (each only once); forget finished ones."""
        done = [h for h in self._handles if h.done()]  # once: a handle may finish meanwhile
        self._handles = [h for h in self._handles if h not in done]
        failed = [h for h in done if h.exception() is not None]
        for h in failed[1:]:
            log.error("snapsvc: checkpoint %s failed too: %s", h.path, h.exception())
        if failed:
            raise cast(BaseException, failed[0].exception())   # failed: not None


class _Pending:
    """The writes still pending in this process, by path, of every plugin (weakly held)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_path: dict[str, weakref.WeakSet[WriteHandle]] = {}

    def forget_all(self) -> None:
        """In a forked child: the parent's writes resolve in the parent only (and land
        there), so waiting on them here would never end; the lock may be held by a
        thread the child does not have."""
        self._lock = threading.Lock()
        self._by_path = {}

    def add(self, handle: WriteHandle) -> None:
        with self._lock:
            self._by_path.setdefault(handle.path, weakref.WeakSet()).add(handle)
        handle.add_done_callback(self._discard)  # outside the lock: a done one calls it here

    def _discard(self, handle: WriteHandle) -> None:
        with self._lock:
            writes = self._by_path.get(handle.path)
            if writes is not None:
                writes.discard(handle)
                if not writes:
                    del self._by_path[handle.path]

    def of(self, path: str) -> list[WriteHandle]:
        """The writes to ``path`` not done yet, oldest first."""
        with self._lock:
            writes = list(self._by_path.get(path, ()))
        return sorted((h for h in writes if not h.done()), key=lambda h: h.seq)


_PENDING = _Pending()
os.register_at_fork(after_in_child=_PENDING.forget_all)


def _release(writer: SnapshotWriter, removals: "queue.SimpleQueue[_Removal | None]",
             timeout: float) -> None:
    """A plugin dropped before ``teardown``: its writes land, its sidecar stops, and its
    removals' thread ends after the removals it holds."""
    removals.put(None)
    try:
        writer.finish(timeout=timeout)
    except Exception as e:  # noqa: BLE001 - a finalizer has no caller to raise to
        log.error("snapsvc: stopping the sidecar of a dropped SnapsvcCheckpointIO failed: %s", e)


def _remove_all(removals: "queue.SimpleQueue[_Removal | None]", bury: Callable[[], Any]) -> None:
    """The removals' thread: each removal in turn, until teardown's None (or the plugin's end)."""
    while (removal := removals.get()) is not None:
        run = bury()
        if run is not None:
            run(removal, False)
            del run   # not held while waiting: the plugin may go
        else:  # the plugin was dropped: its removals still happen
            try:
                removal.run(600.0)
            except Exception as e:  # noqa: BLE001 - no caller is left to raise to
                log.warning("snapsvc: removing %s failed: %s", removal.path, e)


def _remove_files(path: str) -> None:
    for name in checkpoint_files(path):  # metadata first
        try:
            os.remove(name)
        except FileNotFoundError:
            pass


class _Removal:
    """Removing the files of the checkpoint at ``path`` once ``write`` (its write still
    in the sidecar, or None) is done, by whichever thread comes first; the others wait."""

    def __init__(self, path: str, write: WriteHandle | None) -> None:
        self.path = path
        self.write = write
        self._claim = threading.Lock()   # taken once, never released: by the remover
        self._finished = threading.Event()
        self._error: BaseException | None = None

    @property
    def finished(self) -> bool:
        """Whether the files were removed, or their removal failed."""
        return self._finished.is_set()

    def run(self, timeout: float) -> None:
        """Remove the files, or wait up to ``timeout`` s for the thread removing them;
        raise the removal's error (a failed write is raised by the plugin, not here)."""
        if self.write is not None:
            self.write.exception(timeout=timeout)
        if self._claim.acquire(blocking=False):
            try:
                _remove_files(self.path)
            except BaseException as e:
                self._error = e
            finally:
                self._finished.set()
        elif not self._finished.wait(timeout):
            raise TimeoutError(f"{self.path}: its removal did not finish within {timeout} s "
                               "(SnapsvcCheckpointIO(timeout=...))")
        if self._error is not None:
            raise self._error


def _mark_step_state(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint`` (a copy of Lightning's) with each optimizer's per-parameter state
    marked as written only by its step, the part overlap mode copies behind the next
    step. The parameters, buffers and the rest are copied before the save returns:
    they change outside a step too (BatchNorm in a forward, weight averaging and EMA
    callbacks in their hooks, a scheduler's tensor ``lr`` in ``param_groups``)."""
    states = checkpoint.get("optimizer_states")
    if isinstance(states, list):
        checkpoint["optimizer_states"] = [
            {**s, "state": StepState(s["state"])} if type(s) is dict and "state" in s else s
            for s in states]  # a dict, as state_dict() gives it: stored as the same type
    return checkpoint


def is_snapsvc_file(path: Any) -> bool:
    """Whether ``path`` is a local ``.fdl`` file (its magic and version read), or one
    the sidecar holds in RAM."""
    if not isinstance(path, (str, os.PathLike)):
        return False
    try:
        local = local_path(path)
        checkpoint_version(held(local) or local)
    except (OSError, FormatError, PathError):
        return False
    return True


# -- paths ------------------------------------------------------------------------------------

def local_path(path: str | os.PathLike[str]) -> str:
    """The absolute local path Lightning means; a URL other than ``file://`` is refused."""
    text = os.fspath(path)
    url = _URL.match(text)
    if url and url.group(1).lower() == "file":
        text = text[url.end():]
    elif url:
        raise PathError(f"{text}: SnapsvcCheckpointIO writes to the local file system, and "
                        f"{url.group(1)}:// is not one. URLs go to snapsvc's remote tier through its "
                        "remote= option, which this version does not have: give ModelCheckpoint a local "
                        "dirpath (Lightning's default IO writes URLs through fsspec)")
    return os.path.abspath(text)


def read(path: str, device: str | torch.device | None) -> dict[str, Any]:
    """The checkpoint at ``path`` (a link read through), hyper-parameters decoded, on ``device``;
    from the sidecar's RAM copy when it holds one (a memory-only save: ``persist_every``)."""
    state = decode_hparams(read_first(load)(os.path.realpath(path)))
    if device is None:
        return state
    from lightning_utilities.core.apply_func import apply_to_collection
    return cast(dict[str, Any], apply_to_collection(state, torch.Tensor, lambda t: t.to(device)))

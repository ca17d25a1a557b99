"""Asynchronous checkpoints for the Hugging Face ``transformers`` Trainer.

:class:`SnapsvcTrainer` is a drop-in ``transformers.Trainer`` (written against
5.24) whose ``_save_checkpoint`` stages the model, optimizer, scheduler,
gradient scaler, RNG states (torch, cuda, python, numpy) and trainer state in
one :meth:`SnapshotWriter.submit` and returns; the writer sidecar writes them.

Layout. A committed ``checkpoint-<step>/`` holds::

    snapsvc_state.fdl        the tensors of the model, optimizer and scaler: flodl's format
    snapsvc_state.fdl.data   the torch RNG states (uint8), in its framing (docs/state.md)
    snapsvc_state.fdl.meta   the state tree and non-tensor leaves (msgpack)
    trainer_state.json       HF's own file, which train() and HF tools read
    config.json              the model's config, when it has one

One state file plus HF's JSON files, not HF's layout, because the sidecar
writes ``.fdl`` files and never pickles: ``optimizer.pt``, ``scheduler.pt``
and ``rng_state.pth`` are pickles, so HF's layout would mean writing them in
the training process, which is the stall this class removes. The cost: a
stock ``Trainer`` cannot resume from these directories (``SnapsvcTrainer``
resumes from both kinds; once this module is imported, the stock one's error
says so instead of only "Can't find a valid checkpoint"), and ``from_pretrained`` needs the weights exported
(``snapsvc.load(path)["model"]``). Python's and numpy's RNG states become
state-API values (tuples, ints, bytes) and are rebuilt on load.

Completeness. transformers 5.24 has no incomplete-checkpoint marker:
``get_last_checkpoint`` takes the highest ``checkpoint-<N>`` directory and
``rotate_checkpoints`` globs ``checkpoint-*``. So a checkpoint is written into
a hidden ``.snapsvc-checkpoint-<N>`` directory, which neither matches, and a
committer thread renames it to ``checkpoint-<N>`` only after the sidecar
reported the state file and its metadata durable and the JSON files and the
directory were fsynced; then it fsyncs the run directory. A directory still
being written, or left by a crash, is never under a name HF (or
``resume_from_checkpoint=True``) picks; leftovers are removed at the next
save. Because no write ever targets a ``checkpoint-*`` directory, rotation
(HF's own ``rotate_checkpoints``, run by the committer right after each
commit with the arguments the stock Trainer would pass) can neither delete a
pending write nor keep a half-written one, so per-file waits and removal
(``SnapshotWriter.wait_path``, ``snapsvc.checkpoint_files``) are not needed.
``load_best_model_at_end`` and the end-of-training pruning run after the
pending commits (``_finalize_training`` drains first).

``snapsvc_options={"overlap": True}``: ``_save_checkpoint`` returns before
the parameters and optimizer state are copied; the trainer guards its
optimizer so that the next step waits for the copy.

Backpressure. A save needs a free slot; while every slot holds a checkpoint
the sidecar is still writing, it waits (policy "block": as with the stock
Trainer, no checkpoint is dropped). The first save that waits longer than it
copies logs a warning with the write's figures and the knobs (``save_steps``,
``nice``, ``slots``). On a CPU run the sidecar runs at training's priority
(the writer's default ``nice``: see :class:`~snapsvc.SnapshotWriter`).

Callbacks. ``on_save`` runs right after a save returns, and callbacks read
``checkpoint-<N>`` there (transformers' ``WandbCallback``, ``MLflowCallback``,
``ClearMLCallback``, ``NeptuneCallback`` and ``FlyteCallback`` upload it). When
a callback overrides ``on_save``, the save waits until its directory is
committed, so the callback finds it complete, as with the stock Trainer: such
runs stall for the write; the default callbacks do not override it. Under
torchrun the main process renames the directory, so only its callbacks are
sure to see it (the integrations above upload from the main process only).

Errors. A failed write (disk error, dead sidecar) removes its hidden
directory and raises at the next save, or when training ends, as
:class:`WriteFailedError`, :class:`BrokenWriterError` or (several
processes) :class:`DistributedCheckpointError`, naming the checkpoint.
``save_model``, the end of training and :meth:`close` wait for pending
commits (at most :attr:`SnapsvcTrainer.drain_timeout` seconds).

Several processes (torchrun, DDP). Each rank submits its part through its
own sidecar with :class:`snapsvc.DistributedSnapshotWriter`: rank 0 (HF's
main process) the model, optimizer, scheduler, scaler, trainer state and its
RNG states, every other rank its RNG states, into
``<output_dir>/.snapsvc-ranks/step_<N>/rank<r>.fdl``. That writer commits
the step with its manifest once every rank's file is durable; then the main
process writes HF's JSON files there, fsyncs them and renames the directory
to ``checkpoint-<N>`` (same filesystem). On resume every rank loads rank 0's
file and its own RNG states, as the stock Trainer loads ``model.safetensors``
and ``rng_state_<r>.pth``. ``output_dir`` must be shared by the ranks.

FSDP2 (accelerate's ``fsdp_version=2``). Parameters and optimizer state are
DTensors on every rank, so every rank submits the whole state (model,
optimizer, scheduler, scaler, trainer state, and every rank's RNG states,
gathered into one list) with one structure; each rank stages its own shards
(``DistributedSnapshotWriter.submit(state, step)``), into the same
``.snapsvc-ranks/step_<N>`` directory, committed and renamed as above. A
resume restores model, optimizer and scheduler in one
:func:`snapsvc.restore_distributed` (resharded to this run's placements) and
each rank's RNG states from that list: bit-exact at the same world size.
accelerate 1.15 runs FSDP only on GPUs and other accelerators (on CPU it
drops the plugin and the Trainer runs DDP); tests/test_hf_fsdp.py lifts that
check to run this path on CPU with gloo.

Not covered, each falling back to the stock (synchronous) save with a
warning that says why: DeepSpeed, FSDP1, XLA, SageMaker MP, ``push_to_hub``,
and runs of several processes that are not torch.distributed.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import logging
import os
import random
import shutil
import weakref
from typing import Any

import numpy as np
import torch
from transformers import Trainer
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_callback import ExportableState, TrainerCallback
from transformers.trainer_pt_utils import set_rng_state_for_device
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy
from transformers.training_args import ParallelMode
from transformers.utils import is_sagemaker_mp_enabled, is_torch_xla_available

from ..distributed import MANIFEST_NAME, DistributedSnapshotWriter, read_manifest, \
    restore_distributed
from ..engine.writer import SnapshotWriter, WriteHandle
from ..state.readback import load
from .hf_commit import STAGING_PREFIX, Commit, Committer
from .wraps import wrap

__all__ = ["SnapsvcTrainer", "STATE_FILE", "STAGING_PREFIX"]

log = logging.getLogger("snapsvc")

STATE_FILE = "snapsvc_state.fdl"
_CONFIG_FILE = "config.json"
_live: "weakref.WeakSet[SnapsvcTrainer]" = weakref.WeakSet()


# -- RNG states as state-API values -------------------------------------------------
def _rng_state(distributed: bool) -> dict[str, Any]:
    """torch, cuda, python and numpy RNG states; numpy's key array becomes bytes."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (str(kind), np.asarray(keys, dtype="<u4").tobytes(), int(pos),
                  int(has_gauss), float(cached)),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():  # the shape the stock Trainer saves
        state["cuda"] = (torch.cuda.random.get_rng_state_all() if distributed
                         else torch.cuda.random.get_rng_state())
    return state


def _set_rng_state(state: dict[str, Any], distributed: bool) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.frombuffer(keys, dtype="<u4").copy(), pos, has_gauss, cached))
    torch.random.set_rng_state(state["cpu"])
    if torch.cuda.is_available() and "cuda" in state:
        set_rng_state_for_device("CUDA", torch.cuda, state, distributed)


class SnapsvcTrainer(Trainer):
    """``transformers.Trainer`` whose checkpoints are written by a snapsvc sidecar.

    Takes the Trainer's arguments plus ``snapsvc_options``, keyword arguments
    for the :class:`SnapshotWriter` (``slots``, ``policy``, ``nice``,
    ``fault_hook``, ...); on a CPU run the sidecar runs at training's priority
    (the writer's default ``nice``). The writer
    (:attr:`snapsvc_writer`) starts at the first save and lives until
    :meth:`close` or interpreter exit; with
    several processes it is a :class:`DistributedSnapshotWriter` (its
    ``writer`` is this rank's SnapshotWriter), given the same options.
    """

    #: seconds save_model / the end of training / close() wait for pending commits
    drain_timeout: float = 1800.0

    def __init__(self, *args: Any, snapsvc_options: dict[str, Any] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.snapsvc_options = dict(snapsvc_options or {})
        if "directory" in self.snapsvc_options or "keep_last" in self.snapsvc_options:
            raise ValueError("snapsvc_options must not set 'directory' or 'keep_last': paths "
                             "come from args.output_dir and rotation from save_total_limit")
        self.snapsvc_writer: SnapshotWriter | DistributedSnapshotWriter | None = None
        self._snapsvc_committer = Committer()
        self._snapsvc_loaded: tuple[str, dict[str, Any]] | None = None
        self._snapsvc_warned = False
        self._snapsvc_guard: Any = None        # the step hook of overlap mode, and its optimizer
        self._snapsvc_guarded: Any = None

    # -- lifecycle ------------------------------------------------------------------
    def _snapsvc_fallback_reason(self) -> str | None:
        """Why this run uses the stock synchronous save, or None."""
        if self.is_fsdp_enabled and not self._snapsvc_fsdp2:
            return ("FSDP1: accelerate saves its flat-parameter shards itself (save_fsdp_model, "
                    "save_fsdp_optimizer) and snapsvc takes DTensor state only; set "
                    "fsdp_config={'version': 2} (FSDP2), whose checkpoints SnapsvcTrainer "
                    "writes through snapsvc.DistributedSnapshotWriter")
        if self.is_deepspeed_enabled:
            return ("DeepSpeed: its engine saves its own ZeRO partitions (save_checkpoint), "
                    "which snapsvc does not write")
        if is_torch_xla_available() or is_sagemaker_mp_enabled():
            return "XLA and SageMaker MP save through their own APIs"
        if self.args.push_to_hub:
            return "push_to_hub uploads the files of the stock layout"
        if self.args.world_size > 1 and self.args.parallel_mode != ParallelMode.DISTRIBUTED:
            return "only torch.distributed runs of several processes are supported"
        return None

    @property
    def _snapsvc_fsdp2(self) -> bool:
        """accelerate's FSDP2: parameters and optimizer state are DTensors on every rank."""
        return self.is_fsdp_enabled and getattr(self.accelerator.state.fsdp_plugin,
                                                "fsdp_version", 1) == 2

    @property
    def _snapsvc_distributed(self) -> bool:
        return self.args.world_size > 1 or self._snapsvc_fsdp2

    def _snapsvc_start(self) -> SnapshotWriter | DistributedSnapshotWriter:
        if self.snapsvc_writer is None and not self._snapsvc_distributed:
            self.snapsvc_writer = SnapshotWriter(**self.snapsvc_options).start()
        elif self.snapsvc_writer is None:
            # Every rank saves the same steps, so every rank is here. Leftovers of
            # a crashed run are removed before any rank writes.
            root = os.path.join(self.args.output_dir, STAGING_PREFIX + "ranks")
            if self.args.should_save:
                shutil.rmtree(root, ignore_errors=True)
            torch.distributed.barrier()
            self.snapsvc_writer = DistributedSnapshotWriter(root, **self.snapsvc_options).start()
        local = getattr(self.snapsvc_writer, "writer", self.snapsvc_writer)
        # overlap=True: the parameter copy runs on while training goes on; the
        # optimizer's next step waits for it. Accelerate wraps the optimizer, and
        # step hooks fire on the torch optimizer inside.
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        if local.overlap and self._snapsvc_guarded is not inner:
            if self._snapsvc_guard is not None:
                self._snapsvc_guard.remove()
            self._snapsvc_guard = local.guard(inner)
            self._snapsvc_guarded = inner
        if self._snapsvc_committer.start():
            _live.add(self)
        return self.snapsvc_writer

    def close(self, timeout: float | None = None) -> None:
        """Wait for pending commits, then stop the sidecar (a later save starts a new one)."""
        try:
            self._snapsvc_drain(self.drain_timeout if timeout is None else timeout)
        finally:
            self._snapsvc_committer.stop()
            if self._snapsvc_guard is not None:
                self._snapsvc_guard.remove()
                self._snapsvc_guard = self._snapsvc_guarded = None
            if self.snapsvc_writer is not None:
                self.snapsvc_writer.close()
                self.snapsvc_writer = None
            _live.discard(self)
        self._snapsvc_raise_failed()

    # -- saving ---------------------------------------------------------------------
    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        self._snapsvc_raise_failed()
        reason = self._snapsvc_fallback_reason()
        if reason is not None:
            if not self._snapsvc_warned:
                log.warning("SnapsvcTrainer: synchronous stock checkpoints: %s", reason)
                self._snapsvc_warned = True
            self._snapsvc_drain(self.drain_timeout)
            return super()._save_checkpoint(model, trial)
        writer = self._snapsvc_start()
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        final = os.path.join(run_dir, name)
        staging = os.path.join(run_dir, STAGING_PREFIX + name)
        if self._snapsvc_committer.pending(final):  # the same step saved twice: its first write must land first
            self._snapsvc_drain(self.drain_timeout)
            self._snapsvc_raise_failed()
        self._snapsvc_note_best(run_dir, final)
        self._snapsvc_export_callback_states()
        distributed = self.args.parallel_mode == ParallelMode.DISTRIBUTED
        if self._snapsvc_fsdp2:
            state = self._snapsvc_sharded_state(distributed)
        else:
            # As the stock Trainer: the main process saves model, optimizer, scheduler,
            # scaler and trainer state; every rank its RNG states.
            state = self._snapsvc_state(self.args.should_save, _rng_state(distributed))
        files: list[str] = []
        handle: WriteHandle | None = None
        try:
            if isinstance(writer, DistributedSnapshotWriter):
                # rank<r>.fdl in <output_dir>/.snapsvc-ranks/step_<N>, committed by a
                # manifest once every rank's file is durable; renamed by the main process
                handle = writer.submit(state, self.state.global_step)
                staging = handle.path
            else:
                self._snapsvc_remove_leftovers(run_dir)
                os.makedirs(staging)
                handle = writer.submit(state, os.path.join(staging, STATE_FILE))
            if self.args.should_save:
                files = self._snapsvc_write_json(staging)
            else:
                staging = ""   # another rank commits it; this one waits for the manifest
        except BaseException:
            if not isinstance(writer, DistributedSnapshotWriter):  # no commit will come
                if handle is not None:  # the sidecar writes into it: let it finish first
                    writer.wait_path(handle.path, timeout=self.drain_timeout)
                shutil.rmtree(staging, ignore_errors=True)
            raise
        item = Commit(handle, staging, final, run_dir, files, self.args.should_save,
                       self.args.save_total_limit, self.state.best_model_checkpoint)
        self._snapsvc_committer.add(item)
        if self._snapsvc_on_save_reads():
            # on_save comes right after this returns, and callbacks that upload the
            # checkpoint (WandbCallback, MLflowCallback, ...) read checkpoint-<N> there
            self._snapsvc_drain(self.drain_timeout)
            self._snapsvc_raise_failed()

    def _snapsvc_state(self, whole: bool, rng: Any) -> dict[str, Any]:
        """What a rank submits: with ``whole``, model, optimizer, scheduler, scaler and
        trainer state (the model alone with save_only_model); ``rng`` unless this is a
        main process under save_only_model."""
        state: dict[str, Any] = {}
        if whole:
            state["model"] = self.model
            if not self.args.save_only_model:
                state["optimizer"] = self.optimizer
                state["scheduler"] = self.lr_scheduler
                scaler = getattr(self.accelerator, "scaler", None)
                if scaler is not None:
                    state["scaler"] = scaler
            state["trainer_state"] = json.dumps(dataclasses.asdict(self.state), sort_keys=True)
        if not self.args.save_only_model or not whole:
            state["rng"] = rng
        return state

    def _snapsvc_sharded_state(self, distributed: bool) -> dict[str, Any]:
        """FSDP2: every rank submits the whole state, one structure (each rank stages its
        shards; plain values are rank 0's). The RNG states differ per rank, so they are
        gathered into one list of every rank's, which each rank indexes at resume."""
        if self.args.save_only_model:
            return self._snapsvc_state(True, None)   # no RNG states: nothing to gather
        rng: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(rng, _rng_state(distributed))
        return self._snapsvc_state(True, rng)

    def _snapsvc_on_save_reads(self) -> bool:
        """Whether a callback overrides ``on_save`` (none of the default ones does)."""
        return any(type(cb).on_save is not TrainerCallback.on_save
                   for cb in self.callback_handler.callbacks)

    def _snapsvc_write_json(self, directory: str) -> list[str]:
        """HF's own files, by HF's own writers, into the hidden directory (the committer
        fsyncs them); their names."""
        self.state.save_to_json(os.path.join(directory, TRAINER_STATE_NAME))
        config = getattr(self.model, "config", None)
        if not hasattr(config, "to_json_file"):
            return [TRAINER_STATE_NAME]
        config.to_json_file(os.path.join(directory, _CONFIG_FILE), use_diff=True)
        return [TRAINER_STATE_NAME, _CONFIG_FILE]

    def _snapsvc_note_best(self, run_dir: str, final: str) -> None:
        """Set ``state.best_model_checkpoint`` as the stock Trainer does, counting
        checkpoints still being written (this one included) as existing."""
        if (self.args.save_strategy not in (SaveStrategy.STEPS, SaveStrategy.EPOCH,
                                            SaveStrategy.BEST)
                or not self.state.best_global_step):
            return
        best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
        if best == final or self._snapsvc_committer.pending(best) or os.path.exists(best):
            self.state.best_model_checkpoint = best

    def _snapsvc_export_callback_states(self) -> None:
        """Record the state of every ExportableState callback (and of control) in
        ``state.stateful_callbacks``, as the stock Trainer does before saving."""
        for cb in [*self.callback_handler.callbacks, self.control]:
            if not isinstance(cb, ExportableState):
                continue
            key = type(cb).__name__
            if isinstance(self.state.stateful_callbacks[key], list):
                self.state.stateful_callbacks[key].append(cb.state())
            else:
                self.state.stateful_callbacks[key] = cb.state()

    def _snapsvc_remove_leftovers(self, run_dir: str) -> None:
        """Remove hidden directories no pending commit owns (a crash left them)."""
        try:
            names = os.listdir(run_dir)
        except FileNotFoundError:
            return
        owned = self._snapsvc_committer.staging_dirs()
        for n in names:
            path = os.path.join(run_dir, n)
            if n.startswith(STAGING_PREFIX) and path not in owned and os.path.isdir(path):
                log.info("snapsvc: removing %s, an unfinished checkpoint", path)
                shutil.rmtree(path, ignore_errors=True)

    def _snapsvc_drain(self, timeout: float) -> None:
        """Wait until every submitted checkpoint is committed or failed."""
        self._snapsvc_committer.drain(timeout)

    def _snapsvc_raise_failed(self) -> None:
        self._snapsvc_committer.raise_failed()

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Wait for pending checkpoints (raising a failed one), then save as the Trainer does."""
        self._snapsvc_drain(self.drain_timeout)
        self._snapsvc_raise_failed()
        super().save_model(output_dir, _internal_call)

    def _finalize_training(self, trial: Any, num_train_samples: Any, start_time: float) -> Any:
        # Before the stock finalizer: it loads the best model, sorts and prunes
        # checkpoints and calls on_train_end, all of which need them committed.
        self._snapsvc_drain(self.drain_timeout)
        self._snapsvc_raise_failed()   # every rank's handle failed alike: all raise
        if self._snapsvc_distributed and self.snapsvc_writer is not None:
            torch.distributed.barrier()   # the main process has renamed the last one
        return super()._finalize_training(trial, num_train_samples, start_time)

    # -- loading --------------------------------------------------------------------
    def _snapsvc_file(self, checkpoint: str, key: str) -> str:
        """The file holding ``key``: the state file, or in a multi-rank checkpoint the main
        process's (rank 0) and for RNG states this rank's."""
        if os.path.isfile(os.path.join(checkpoint, STATE_FILE)):
            return os.path.join(checkpoint, STATE_FILE)
        rank = self.args.process_index if key == "rng" else 0
        return os.path.join(checkpoint, f"rank{rank}.fdl")

    def _snapsvc_take(self, checkpoint: str, key: str, fresh: bool = False) -> Any:
        """``key`` of ``checkpoint`` (None if absent), handed out once: a file is read at
        the start of a resume (``fresh``) and kept until the RNG state is taken."""
        path = self._snapsvc_file(checkpoint, key)
        if not os.path.isfile(path):
            return None    # a rank of a run with more processes than the saving one
        if fresh or self._snapsvc_loaded is None or self._snapsvc_loaded[0] != path:
            self._snapsvc_loaded = (path, load(path))
        return self._snapsvc_loaded[1].pop(key, None)

    @staticmethod
    def _snapsvc_ours(checkpoint: str | None) -> bool:
        return checkpoint is not None and any(
            os.path.isfile(os.path.join(checkpoint, n)) for n in (STATE_FILE, MANIFEST_NAME))

    @staticmethod
    def _snapsvc_sharded(checkpoint: str) -> bool:
        """Whether ``checkpoint`` is an FSDP2 one: every rank's shards of one whole state."""
        return os.path.isfile(os.path.join(checkpoint, MANIFEST_NAME)) and \
            (read_manifest(checkpoint).sharded or {}).get("state") is not None

    def _snapsvc_restore(self, checkpoint: str, model: torch.nn.Module) -> None:
        """An FSDP2 checkpoint into ``model`` and, once they exist, the optimizer,
        scheduler and scaler (resharded to this run's placements, at any world size);
        keeps the saved RNG states for :meth:`_load_rng_state`."""
        targets: dict[str, Any] = {"model": model}
        if self.optimizer is not None and self.lr_scheduler is not None:
            targets.update(optimizer=self.optimizer, scheduler=self.lr_scheduler)
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                targets["scaler"] = scaler
        report = restore_distributed(checkpoint, targets)
        if report.missing:   # as the stock Trainer, which warns of missing keys
            log.warning("snapsvc: %s lacks %s; they keep their values", checkpoint,
                        report.missing)
        if "optimizer" in targets:
            self._snapsvc_loaded = (checkpoint, {"rng": report.state.get("rng")})

    def _load_from_checkpoint(self, resume_from_checkpoint: str,
                              model: torch.nn.Module | None = None) -> None:
        if not self._snapsvc_ours(resume_from_checkpoint):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        model = self.model if model is None else model
        log.info("snapsvc: loading the model from %s", resume_from_checkpoint)
        if self._snapsvc_sharded(resume_from_checkpoint):
            return self._snapsvc_restore(resume_from_checkpoint, model)
        self._issue_warnings_after_load(
            model.load_state_dict(self._snapsvc_take(resume_from_checkpoint, "model", fresh=True),
                                  False))

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if not self._snapsvc_ours(best):
            return super()._load_best_model()
        log.info("snapsvc: loading the best model from %s (score %s)", best, self.state.best_metric)
        if self._snapsvc_sharded(best):
            restore_distributed(best, {"model": self.model})
            return
        weights = self._snapsvc_take(best, "model", fresh=True)
        self._issue_warnings_after_load(self.model.load_state_dict(weights, False))
        self._snapsvc_loaded = None

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not self._snapsvc_ours(checkpoint):
            return super()._load_optimizer_and_scheduler(checkpoint)
        if self._snapsvc_sharded(checkpoint):
            if self._snapsvc_loaded is None or self._snapsvc_loaded[0] != checkpoint:
                self._snapsvc_restore(checkpoint, self.model)   # the model is its names' source
            return
        optimizer = self._snapsvc_take(checkpoint, "optimizer")
        scheduler = self._snapsvc_take(checkpoint, "scheduler")
        if optimizer is not None and scheduler is not None:  # absent: save_only_model
            self.optimizer.load_state_dict(optimizer)
            self.lr_scheduler.load_state_dict(scheduler)

    def _load_scaler(self, checkpoint: str | None) -> None:
        if not self._snapsvc_ours(checkpoint):
            return super()._load_scaler(checkpoint)
        if self._snapsvc_sharded(checkpoint):
            return   # restored with the optimizer
        scaler = self._snapsvc_take(checkpoint, "scaler")
        if scaler is not None and getattr(self.accelerator, "scaler", None) is not None:
            self.accelerator.scaler.load_state_dict(scaler)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if not self._snapsvc_ours(checkpoint):
            return super()._load_rng_state(checkpoint)
        if self._snapsvc_sharded(checkpoint):
            every = (self._snapsvc_loaded or ("", {}))[1].get("rng") or []
            rank = self.args.process_index   # every rank's, gathered at the save
            rng = every[rank] if rank < len(every) else None
        else:
            rng = self._snapsvc_take(checkpoint, "rng")
        self._snapsvc_loaded = None   # the last piece a resume needs
        if rng is None:
            log.info("snapsvc: %s holds no RNG state for this rank (save_only_model, or a "
                     "rank the saving run did not have); resuming is not bit-exact", checkpoint)
            return
        _set_rng_state(rng, self.args.parallel_mode == ParallelMode.DISTRIBUTED)


def _stock_load(original: Any) -> Any:
    """The stock ``Trainer._load_from_checkpoint``, naming the fix for a snapsvc checkpoint."""
    @functools.wraps(original)
    def _load_from_checkpoint(self: Trainer, resume_from_checkpoint: str,
                              model: torch.nn.Module | None = None) -> None:
        if not isinstance(self, SnapsvcTrainer) and SnapsvcTrainer._snapsvc_ours(
                resume_from_checkpoint):
            # the stock Trainer would say only "Can't find a valid checkpoint"
            state = os.path.join(resume_from_checkpoint, STATE_FILE)
            if not os.path.isfile(state):
                state = os.path.join(resume_from_checkpoint, "rank0.fdl")
            raise ValueError(
                f"Can't find a valid checkpoint at {resume_from_checkpoint}: it is a snapsvc "
                f"checkpoint ({STATE_FILE} or {MANIFEST_NAME}, no model.safetensors), which "
                "the stock transformers.Trainer cannot read. Resume it with "
                "snapsvc.transformers.SnapsvcTrainer, a drop-in Trainer, or read it with "
                f"snapsvc.load({state!r})")
        return original(self, resume_from_checkpoint, model)
    return _load_from_checkpoint


# Imported in a script that uses the stock Trainer too, the stock one names the fix.
wrap(Trainer, "_load_from_checkpoint", _stock_load)


@atexit.register
def _drain_at_exit() -> None:
    """Interpreter exit without close(): commit what the sidecar makes durable, bounded.

    Registered after the client's own exit handler, so it runs first, while
    the sidecar still writes.
    """
    for trainer in list(_live):
        try:
            trainer._snapsvc_drain(trainer.drain_timeout)
        except Exception:
            log.exception("snapsvc: committing checkpoints at exit failed")

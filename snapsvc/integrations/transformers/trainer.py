"""SnapsvcTrainer: a drop-in ``transformers.Trainer`` whose saves go through a snapsvc
sidecar, one ``submit()`` per checkpoint (see :mod:`snapsvc.integrations.transformers`)."""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import logging
import os
import shutil
import weakref
from typing import Any, Callable, cast

import torch
from transformers import PreTrainedModel, Trainer
from transformers.dynamic_module_utils import custom_object_save
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_callback import ExportableState, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy
from transformers.training_args import ParallelMode
from transformers.utils import is_sagemaker_mp_enabled, is_torch_xla_available

from ...distributed import MANIFEST_NAME, DistributedSnapshotWriter
from ...engine.writer import SnapshotWriter, WriteHandle
from ..wraps import wrap
from .commit import STAGING_PREFIX, Commit, Committer
from .resume import STATE_FILE, SnapsvcResume, rng_state

__all__ = ["SnapsvcTrainer", "STATE_FILE"]

log = logging.getLogger("snapsvc")

_CONFIG_FILE = "config.json"
_live: "weakref.WeakSet[SnapsvcTrainer]" = weakref.WeakSet()


class SnapsvcTrainer(SnapsvcResume, Trainer):
    """``transformers.Trainer`` whose checkpoints are written by a snapsvc sidecar.

    Takes the Trainer's arguments plus ``snapsvc_options``, keyword arguments
    for the :class:`SnapshotWriter` (``slots``, ``policy``, ``nice``,
    ``fault_hook``, the restart tier's ``linger``, ``keep_in_memory``, ``memory_limit``
    and ``persist_every``: see :func:`_persist_every`, docs/restart.md).
    On a CPU run the sidecar runs at training's priority
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
        self._snapsvc_every = _persist_every(self.snapsvc_options)
        self._snapsvc_saves = 0
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
            # a sidecar lingers for, and is found by, a directory
            linger: dict[str, Any] = {"directory": self.args.output_dir} \
                if self.snapsvc_options.get("linger") else {}
            self.snapsvc_writer = SnapshotWriter(**self.snapsvc_options, **linger).start()
        elif self.snapsvc_writer is None:
            # Every rank saves the same steps, so every rank is here. Leftovers of
            # a crashed run are removed before any rank writes.
            assert self.args.output_dir is not None   # TrainingArguments defaults it
            root = os.path.join(self.args.output_dir, STAGING_PREFIX + "ranks")
            if self.args.should_save:
                shutil.rmtree(root, ignore_errors=True)
            torch.distributed.barrier()
            self.snapsvc_writer = DistributedSnapshotWriter(root, **self.snapsvc_options).start()
        # a DistributedSnapshotWriter's this-rank SnapshotWriter is its .writer
        local = cast(SnapshotWriter, getattr(self.snapsvc_writer, "writer", self.snapsvc_writer))
        # overlap=True: the parameter copy runs on while training goes on; the
        # optimizer's next step waits for it. Accelerate wraps the optimizer, and
        # step hooks fire on the torch optimizer inside.
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        if local.overlap and self._snapsvc_guarded is not inner:
            assert inner is not None   # a save comes from the training loop, after the optimizer
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
            state = self._snapsvc_state(self.args.should_save, rng_state(distributed))
        handle: WriteHandle | None = None
        try:
            if isinstance(writer, DistributedSnapshotWriter):
                # rank<r>.fdl in <output_dir>/.snapsvc-ranks/step_<N>, committed by a
                # manifest once every rank's file is durable; renamed by the main process
                handle = writer.submit(state, self.state.global_step)
                staging = handle.path
            else:
                self._snapsvc_committer.remove_leftovers(run_dir)
                os.makedirs(staging)
                self._snapsvc_saves += 1   # memory-only: held in RAM under its final name
                persist = not self._snapsvc_every or self._snapsvc_saves % self._snapsvc_every == 0
                handle = writer.submit(state, os.path.join(staging if persist else final,
                                                           STATE_FILE), persist=persist)
            if self.args.should_save:
                self._snapsvc_write_hf_files(staging)
            else:
                staging = ""   # another rank commits it; this one waits for the manifest
        except BaseException:
            if not isinstance(writer, DistributedSnapshotWriter):  # no commit will come
                if handle is not None:  # the sidecar writes into it: let it finish first
                    writer.wait_path(handle.path, timeout=self.drain_timeout)
                shutil.rmtree(staging, ignore_errors=True)
            raise
        item = Commit(handle, staging, final, run_dir, self.args.should_save,
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
        torch.distributed.all_gather_object(rng, rng_state(distributed))
        return self._snapsvc_state(True, rng)

    def _snapsvc_on_save_reads(self) -> bool:
        """Whether a callback overrides ``on_save`` (none of the default ones does)."""
        return any(type(cb).on_save is not TrainerCallback.on_save
                   for cb in self.callback_handler.callbacks)

    def _snapsvc_write_hf_files(self, directory: str) -> None:
        """HF's own files, by HF's own writers, into the hidden directory (the committer
        fsyncs them): trainer_state.json, and what the stock Trainer's ``save_model``
        writes beside the weights: the model's config (with ``architectures`` and
        ``dtype``, as ``save_pretrained`` sets them), its generation config, the code of a
        remote-code model, and the tokenizer or processor."""
        self.state.save_to_json(os.path.join(directory, TRAINER_STATE_NAME))
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        if isinstance(model, PreTrainedModel):
            model.config.dtype = str(model.dtype).removeprefix("torch.")
            model.config.architectures = [type(model).__name__.removeprefix("FSDP")]
            if model.is_remote_code():
                # the stub says dict, but PreTrainedModel.save_pretrained passes its config too
                custom_object_save(model, directory, config=model.config)  # type: ignore[arg-type]
            model.config.save_pretrained(directory)
            if model.can_generate():
                model.generation_config.save_pretrained(directory)
        elif hasattr(getattr(model, "config", None), "to_json_file"):
            model.config.to_json_file(os.path.join(directory, _CONFIG_FILE), use_diff=True)
        processor = self.processing_class   # else the collator's tokenizer, as stock
        if processor is None:
            processor = getattr(self.data_collator, "tokenizer", None)
        if processor is not None:
            processor.save_pretrained(directory)

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
            # annotated as a list of callbacks; TrainerState.__post_init__ makes it a dict
            states = cast(dict[str, Any], self.state.stateful_callbacks)
            if isinstance(states[key], list):
                states[key].append(cb.state())
            else:
                states[key] = cb.state()

    def _snapsvc_drain(self, timeout: float) -> None:
        """Wait until every submitted checkpoint is committed or failed."""
        self._snapsvc_committer.drain(timeout)

    def _snapsvc_raise_failed(self) -> None:
        self._snapsvc_committer.raise_failed()

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """As the Trainer's. When it raises (an error, a callback's, Ctrl-C), the
        checkpoints already submitted are committed before the exception goes on, as
        the stock Trainer's are on disk by then: a resume, ``get_last_checkpoint`` or
        ``evaluate`` right after finds them."""
        try:
            return super().train(*args, **kwargs)
        except BaseException as e:
            self._snapsvc_settle(e)
            raise

    def _snapsvc_settle(self, cause: BaseException) -> None:
        """Commit what was submitted before ``cause`` stopped training. A write that
        failed stays to be raised at the next save or close; ``cause`` goes on."""
        n = self._snapsvc_committer.count()
        if not n:
            return
        log.warning("snapsvc: training stopped (%s); committing the %d checkpoint(s) already "
                    "submitted first (Ctrl-C abandons them)", type(cause).__name__, n)
        try:
            self._snapsvc_drain(self.drain_timeout)
        except (TimeoutError, KeyboardInterrupt) as e:
            log.error("snapsvc: %d checkpoint(s) not committed (%s %s); each stays hidden "
                      "until it is", self._snapsvc_committer.count(), type(e).__name__, e)

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


def _persist_every(options: dict[str, Any]) -> int | None:
    """``persist_every=K`` taken out of the writer's options: the K-th, 2K-th, ... save of
    the trainer is written to disk, the others are memory-only (their ``checkpoint-<N>/``
    holds HF's files, its state file is the sidecar's RAM copy, resumable while a sidecar
    holds it; multi-process runs persist every save). Counted here, per save: each
    ``checkpoint-<N>/`` would be a series of its own to the writer's count."""
    every: int | None = options.pop("persist_every", None)
    if every is not None and (type(every) is not int or every < 1):
        raise ValueError(f"persist_every must be an int >= 1 or None, got {every!r}")
    return every


def _stock_load(original: Callable[..., None]) -> Callable[..., None]:
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

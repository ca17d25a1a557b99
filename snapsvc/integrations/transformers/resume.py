"""SnapsvcTrainer's resumes: its checkpoints read back into the model, optimizer,
scheduler, scaler and RNG states (see :mod:`snapsvc.integrations.transformers`).

The loading half lives in a mixin of its own, :class:`SnapsvcResume`, placed
before ``transformers.Trainer`` in :class:`~snapsvc.transformers.SnapsvcTrainer`'s
bases: each of its methods reads a snapsvc checkpoint and hands any other to the
stock ``Trainer`` (``super()``).
"""

from __future__ import annotations

import logging
import os
import random
from typing import TYPE_CHECKING, Any, TypeGuard

import numpy as np
import torch
from transformers.trainer_pt_utils import set_rng_state_for_device
from transformers.training_args import ParallelMode

from ...distributed import MANIFEST_NAME, read_manifest, restore_distributed
from ...files.ramtier import held, read_first
from ...state.readback import load as _load

# a memory-only checkpoint's state file lives in the sidecar's RAM (persist_every)
load = read_first(_load)


def _present(path: str) -> bool:
    """Whether the state file ``path`` is on disk, or held in the sidecar's RAM."""
    return os.path.isfile(path) or held(path) is not None

__all__ = ["STATE_FILE", "SnapsvcResume", "rng_state", "set_rng_state"]

log = logging.getLogger("snapsvc")

if TYPE_CHECKING:   # the mixin's methods use the Trainer attributes it is mixed with
    from transformers import Trainer as _TrainerBase
else:
    _TrainerBase = object

STATE_FILE = "snapsvc_state.fdl"


# -- RNG states as state-API values -------------------------------------------------
def rng_state(distributed: bool) -> dict[str, Any]:
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


def set_rng_state(state: dict[str, Any], distributed: bool) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.frombuffer(keys, dtype="<u4").copy(), pos, has_gauss, cached))
    torch.random.set_rng_state(state["cpu"])
    if torch.cuda.is_available() and "cuda" in state:
        set_rng_state_for_device("CUDA", torch.cuda, state, distributed)


class SnapsvcResume(_TrainerBase):
    """The loading half of :class:`~snapsvc.transformers.SnapsvcTrainer` (a mixin
    before ``transformers.Trainer``; ``_snapsvc_loaded`` is set by the trainer)."""

    _snapsvc_loaded: tuple[str, dict[str, Any]] | None

    def _snapsvc_file(self, checkpoint: str, key: str) -> str:
        """The file holding ``key``: the state file, or in a multi-rank checkpoint the main
        process's (rank 0) and for RNG states this rank's."""
        if _present(os.path.join(checkpoint, STATE_FILE)):
            return os.path.join(checkpoint, STATE_FILE)
        rank = self.args.process_index if key == "rng" else 0
        return os.path.join(checkpoint, f"rank{rank}.fdl")

    def _snapsvc_take(self, checkpoint: str, key: str, fresh: bool = False) -> Any:
        """``key`` of ``checkpoint`` (None if absent), handed out once: a file is read at
        the start of a resume (``fresh``) and kept until the RNG state is taken."""
        path = self._snapsvc_file(checkpoint, key)
        if not _present(path):
            return None    # a rank of a run with more processes than the saving one
        if fresh or self._snapsvc_loaded is None or self._snapsvc_loaded[0] != path:
            self._snapsvc_loaded = (path, load(path))
        return self._snapsvc_loaded[1].pop(key, None)

    @staticmethod
    def _snapsvc_ours(checkpoint: str | None) -> TypeGuard[str]:
        return checkpoint is not None and (
            _present(os.path.join(checkpoint, STATE_FILE))
            or os.path.isfile(os.path.join(checkpoint, MANIFEST_NAME)))

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
        assert model is not None   # train() builds the model (or model_init's) before resuming
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
        assert self.model is not None   # set since train() began
        if self._snapsvc_sharded(best):
            restore_distributed(best, {"model": self.model})
            return
        weights = self._snapsvc_take(best, "model", fresh=True)
        self._issue_warnings_after_load(self.model.load_state_dict(weights, False))
        self._snapsvc_loaded = None

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not self._snapsvc_ours(checkpoint):
            return super()._load_optimizer_and_scheduler(checkpoint)
        assert self.model is not None   # set since train() began
        if self._snapsvc_sharded(checkpoint):
            if self._snapsvc_loaded is None or self._snapsvc_loaded[0] != checkpoint:
                self._snapsvc_restore(checkpoint, self.model)   # the model is its names' source
            return
        optimizer = self._snapsvc_take(checkpoint, "optimizer")
        scheduler = self._snapsvc_take(checkpoint, "scheduler")
        if optimizer is not None and scheduler is not None:  # absent: save_only_model
            # train() creates both before resuming them, as the stock method assumes
            assert self.optimizer is not None and self.lr_scheduler is not None
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
        set_rng_state(rng, self.args.parallel_mode == ParallelMode.DISTRIBUTED)

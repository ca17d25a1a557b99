"""The Lightning functions wrapped at import, so stock behaviour holds with the plugin.

Each wrapper changes nothing unless the trainer's ``CheckpointIO`` is a
``SnapsvcCheckpointIO`` (see :mod:`snapsvc.integrations.lightning`).
"""

from __future__ import annotations

import functools
import importlib
import weakref
from typing import Any, Callable

import torch

from ..wraps import wrap
from .hparams import HPARAM_KEYS, check_hparams
from .plugin import SnapsvcCheckpointIO, is_snapsvc_file, local_path, read

__all__ = ["register"]

_BASES = ("lightning_fabric.plugins.io.checkpoint_io", "lightning.fabric.plugins.io.checkpoint_io")
_FLAVOURS = ("pytorch_lightning", "lightning.pytorch")


def plugin_of(trainer: Any) -> SnapsvcCheckpointIO | None:
    """The trainer's ``SnapsvcCheckpointIO``, also inside a wrapper such as ``AsyncCheckpointIO``."""
    io = getattr(trainer.strategy, "_checkpoint_io", None)
    while io is not None and not isinstance(io, SnapsvcCheckpointIO):
        io = getattr(io, "_checkpoint_io", None)
    return io


def _file_exists(original: Callable[..., bool]) -> Callable[..., bool]:
    @functools.wraps(original)
    def file_exists(self: Any, filepath: Any, trainer: Any) -> bool:
        io = plugin_of(trainer)
        if io is None:
            return original(self, filepath, trainer)
        # Asked before the file system, so a write landing in between is seen by one or the
        # other; reduced across ranks as Lightning reduces its own answer (rank 0 saves).
        # A removed path whose write is still landing exists for no one, as with stock.
        reduce = trainer.strategy.reduce_boolean_decision
        pending = reduce(trainer.is_global_zero and io.pending(filepath), all=False)
        removed = reduce(trainer.is_global_zero and io.removing(filepath), all=False)
        return pending or (not removed and original(self, filepath, trainer))
    return file_exists


def _fit(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def fit(self: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        io = plugin_of(self)
        if io is not None:
            io._trainer = weakref.ref(self)  # overlap mode guards its optimizers at each save
            for callback in self.checkpoint_callbacks:  # a URL fails now, not at the first save
                local_path(getattr(callback, "dirpath", None) or self.default_root_dir)
            for obj in (model, *args, *kwargs.values()):  # the model and a datamodule, however passed
                key = getattr(type(obj), "CHECKPOINT_HYPER_PARAMS_KEY", None)
                if key in HPARAM_KEYS and getattr(obj, "hparams", None):
                    check_hparams(key, obj.hparams)
        return original(self, model, *args, **kwargs)
    return fit


def _on_run_start(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def on_run_start(self: Any) -> None:
        original(self)   # on_train_start hooks first: they may set what a save holds
        io = plugin_of(self.trainer)
        if io is not None:   # every rank: a refusal on rank 0 alone would leave the others waiting
            io._check_saveable(self.trainer._checkpoint_connector.dump_checkpoint(weights_only=False))
    return on_run_start


def _pl_load(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def pl_load(path_or_url: Any, map_location: Any = None, weights_only: Any = None) -> Any:
        if not is_snapsvc_file(path_or_url):
            return original(path_or_url, map_location=map_location, weights_only=weights_only)
        if callable(map_location):  # torch's form: where a CPU storage goes (None: stays) is where all go
            moved = map_location(torch.UntypedStorage(0), "cpu")
            map_location = None if moved is None else moved.device
        elif isinstance(map_location, dict):
            map_location = map_location.get("cpu")
        return read(local_path(path_or_url), map_location)
    return pl_load


def register() -> None:
    """Make the class a ``CheckpointIO`` for every Lightning flavour installed, and wrap
    the Lightning functions :mod:`snapsvc.integrations.lightning` lists."""
    found = False
    for name in _BASES:
        try:
            base = importlib.import_module(name).CheckpointIO
        except ImportError:
            continue
        base.register(SnapsvcCheckpointIO)
        found = True
    if not found:
        raise ImportError("snapsvc.lightning needs Lightning (pytorch_lightning or lightning): "
                          "pip install 'snapsvc[lightning]'")
    for flavour in _FLAVOURS:
        try:
            checkpoint = importlib.import_module(f"{flavour}.callbacks.model_checkpoint")
            trainer = importlib.import_module(f"{flavour}.trainer.trainer")
            saving = importlib.import_module(f"{flavour}.core.saving")
            fit_loop = importlib.import_module(f"{flavour}.loops.fit_loop")
        except ImportError:
            continue
        wrap(checkpoint.ModelCheckpoint, "file_exists", _file_exists)
        wrap(trainer.Trainer, "fit", _fit)
        wrap(fit_loop._FitLoop, "on_run_start", _on_run_start)
        wrap(saving, "pl_load", _pl_load)

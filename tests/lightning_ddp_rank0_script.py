"""Two-rank Lightning DDP on CPU: ``@rank_zero_only`` loads of the best checkpoint, at train end and after fit.

:func:`main` runs in lightning_ddp_script.py's launch. With IO=snapsvc each write is held
1 s in rank 0's sidecar, so the load finds it pending. Rank 0 writes ``rank0.json`` and
``after_fit.json`` in DIRECTORY: the weight sums of the model and of the checkpoint it loaded.
"""

from __future__ import annotations

import functools
import json
import os
import time

import torch

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_only

from test_lightning_stock import Lit, data


class LoadBest(pl.Callback):
    def __init__(self, directory: str) -> None:
        self.directory = directory

    @rank_zero_only
    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        state = trainer.strategy.load_checkpoint(trainer.checkpoint_callback.best_model_path)
        got = {"model": float(module.net.weight.sum()),
               "loaded": float(state["state_dict"]["net.weight"].sum())}
        with open(os.path.join(self.directory, "rank0.json"), "w") as f:
            json.dump(got, f)


def main(io: str, directory: str) -> None:
    plugins = []
    if io == "snapsvc":
        import hooks
        from snapsvc.lightning import SnapsvcCheckpointIO
        plugins = [SnapsvcCheckpointIO(fault_hook=functools.partial(hooks.sleep, 1.0))]
    torch.manual_seed(0)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", plugins=plugins, max_epochs=1,
                         limit_train_batches=2, limit_val_batches=0, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=directory,
                         callbacks=[pl.callbacks.ModelCheckpoint(dirpath=directory), LoadBest(directory)])
    model = Lit()
    trainer.fit(model, data(4))
    after_fit(trainer, model, directory)
    # rank 1 waits for rank 0's result, as a job does that lets rank 0 evaluate and report:
    # a collective inside rank 0's load would wait for rank 1 here, which never comes
    deadline = time.monotonic() + 30
    while not os.path.exists(os.path.join(directory, "after_fit.json")):
        if time.monotonic() > deadline:
            raise SystemExit(f"rank {trainer.global_rank}: rank 0's load after fit never returned")
        time.sleep(0.1)
    trainer.validate(model, data(2), verbose=False)  # both ranks go on together


@rank_zero_only
def after_fit(trainer: pl.Trainer, model: pl.LightningModule, directory: str) -> None:
    state = trainer.strategy.load_checkpoint(trainer.checkpoint_callback.best_model_path)
    with open(os.path.join(directory, "after_fit.json"), "w") as f:
        json.dump({"model": float(model.net.weight.sum()),
                   "loaded": float(state["state_dict"]["net.weight"].sum())}, f)


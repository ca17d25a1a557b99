"""A Lightning or Hugging Face run through snapsvc's plugin with the restart tier
(``persist_every``, ``linger``), for tests/test_restart_plugins.py.

``python restart_plugins_script.py {lightning,hf} kill DIR``: trains, saving each
epoch (Lightning) or every 3 steps (HF), and SIGKILLs itself once the newest save,
a memory-only one, is held by the sidecar. ``... {lightning,hf} resume DIR CKPT OUT``:
resumes from CKPT to the end, saves the final weights to OUT (torch.save) and prints
one JSON line: the pid of the lingering sidecar it attached to (or null).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

OPTIONS = {"persist_every": 3, "linger": 60.0}   # saves 1, 2 in RAM only, 3 on disk


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def lightning(mode: str, dirpath: str, ckpt: str | None = None, out: str | None = None) -> None:
    import lightning.pytorch as pl
    from lightning_script import data, make_module

    from snapsvc.lightning import SnapsvcCheckpointIO

    io = SnapsvcCheckpointIO(**OPTIONS)
    attached: list[Any] = []

    class Kill(pl.Callback):
        def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
            if mode == "kill" and trainer.current_epoch == 2:   # epochs 0, 1 saved, RAM only
                for handle in list(io._handles):
                    handle.result(60)
                _die()

        def on_train_end(self, trainer: Any, module: Any) -> None:
            report = io.writer.attached if io.writer is not None else None
            attached.append(None if report is None else report.pid)

    torch.manual_seed(0)
    model = make_module(pl)()
    ckpt_cb = pl.callbacks.ModelCheckpoint(dirpath=dirpath, every_n_epochs=1, save_top_k=-1)
    trainer = pl.Trainer(max_epochs=3, accelerator="cpu", devices=1, plugins=[io],
                         callbacks=[ckpt_cb, Kill()], logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(model, data(), ckpt_path=ckpt)
    torch.save(model.state_dict(), out)
    print(json.dumps({"attached": attached[0], "global_step": trainer.global_step}))


def hf(mode: str, out_dir: str, ckpt: str | None = None, out: str | None = None) -> None:
    from hf_script import make_trainer, weights
    from transformers import TrainerCallback

    holder: list[Any] = []

    class Kill(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 6:   # checkpoints 3 and 6 saved, RAM only
                holder[0]._snapsvc_drain(60)
                _die()

    trainer = make_trainer("snapsvc", out_dir, callbacks=[Kill()] if mode == "kill" else None,
                           snapsvc_options=dict(OPTIONS))
    holder.append(trainer)
    trainer.train(resume_from_checkpoint=ckpt)
    report = trainer.snapsvc_writer.attached if trainer.snapsvc_writer is not None else None
    trainer.close()
    torch.save(weights(trainer.model), out)
    print(json.dumps({"attached": None if report is None else report.pid,
                      "global_step": trainer.state.global_step}))


if __name__ == "__main__":
    kind, mode, *rest = sys.argv[1:]
    {"lightning": lightning, "hf": hf}[kind](mode, *rest)

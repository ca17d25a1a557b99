"""A small deterministic Lightning fit, for tests/test_lightning.py and benchmarks.

Importable (``fit``), and runnable in a fresh process to resume:

    python lightning_script.py FLAVOUR IO DIRPATH MAX_EPOCHS CKPT_PATH OUT [FLAVOUR IO ...]

FLAVOUR is ``pytorch_lightning`` or ``lightning.pytorch``; IO is ``snapsvc``
or ``default``. Writes the final model state to OUT (torch.save) and prints
one JSON line: the global step and how many batches this call trained. Each
further group of six arguments is another run, in turn, in the same process.
"""

from __future__ import annotations

import importlib
import json
import sys
from typing import Any

import torch
from torch import nn

BATCHES = 6  # per epoch


def make_module(pl: Any) -> Any:
    """A LightningModule class for this flavour: BatchNorm, AdamW, StepLR."""

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 1))

        def training_step(self, batch: Any, _idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]

    return Lit


def data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16 * BATCHES, 8, generator=g)
    ds = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
    return torch.utils.data.DataLoader(ds, batch_size=16, shuffle=False, num_workers=0)


def fit(flavour: str, io: str, dirpath: str, max_epochs: int, ckpt_path: str | None = None,
        checkpoint: dict[str, Any] | None = None, **io_options: Any) -> tuple[Any, Any, int]:
    """Train; return (trainer, module, batches trained by this call).

    ``checkpoint``: ModelCheckpoint options (default: one file per epoch, all kept).
    """
    pl = importlib.import_module(flavour)
    if io == "snapsvc":
        from snapsvc.lightning import SnapsvcCheckpointIO
        plugins = [SnapsvcCheckpointIO(**io_options)]
    else:
        plugins = []
    torch.manual_seed(0)
    model = make_module(pl)()
    batches = []

    class Count(pl.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            batches.append(1)

    ckpt = pl.callbacks.ModelCheckpoint(dirpath=dirpath, **(checkpoint or {"every_n_epochs": 1, "save_top_k": -1}))
    trainer = pl.Trainer(max_epochs=max_epochs, accelerator="cpu", devices=1, plugins=plugins,
                         callbacks=[ckpt, Count()], logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(model, data(), ckpt_path=ckpt_path)
    return trainer, model, len(batches)


if __name__ == "__main__":
    for i in range(1, len(sys.argv), 6):
        flavour, io, dirpath, epochs, ckpt_path, out = sys.argv[i:i + 6]
        trainer, model, batches = fit(flavour, io, dirpath, int(epochs), ckpt_path or None)
        torch.save(model.state_dict(), out)
        print(json.dumps({"global_step": trainer.global_step, "batches": batches}), flush=True)

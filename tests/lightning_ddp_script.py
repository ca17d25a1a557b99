"""Two-rank Lightning DDP on CPU, each IO in turn in one launch (a later Trainer reuses the
launched ranks and their process group), so the stock control and the plugin, and both
scenarios, cost one launch:

    python lightning_ddp_script.py DIR IO [IO ...]     (IO: snapsvc or default)

First, for each IO, fit, trainer.save_checkpoint(p), trainer.validate(ckpt_path=p): with
IO=snapsvc the write of ``p`` is held 2 s in rank 0's sidecar, so a rank that reads before
it lands fails. Each rank writes ``DIR/validate/IO/rank<N>.json``: the sums of the weights
it saved and validated. Then, for each IO, lightning_ddp_rank0_script's run in
``DIR/rank0/IO``. Lightning's launcher re-runs this script for rank 1.
"""

from __future__ import annotations

import functools
import json
import os
import sys

import torch

import lightning.pytorch as pl

from test_lightning_stock import Lit, data


def main(io: str, directory: str) -> None:
    plugins = []
    if io == "snapsvc":
        import hooks
        from snapsvc.lightning import SnapsvcCheckpointIO
        plugins = [SnapsvcCheckpointIO(fault_hook=functools.partial(hooks.sleep, 2.0))]
    torch.manual_seed(0)
    model = Lit()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", plugins=plugins, max_epochs=1,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False)
    trainer.fit(model, data())
    saved = sum(float(p.detach().sum()) for p in model.parameters())
    path = os.path.join(directory, "manual.ckpt")
    trainer.save_checkpoint(path)
    with torch.no_grad():  # a rank that did not load the checkpoint keeps these
        for p in model.parameters():
            p.zero_()
    trainer.validate(model, data(), ckpt_path=path, verbose=False)
    loaded = sum(float(p.detach().sum()) for p in model.parameters())
    with open(os.path.join(directory, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump({"saved": saved, "validated": loaded}, f)


if __name__ == "__main__":
    import lightning_ddp_rank0_script
    top, ios = sys.argv[1], sys.argv[2:]
    for io in ios:
        main(io, os.path.join(top, "validate", io))
    for io in ios:
        lightning_ddp_rank0_script.main(io, os.path.join(top, "rank0", io))

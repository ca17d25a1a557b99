"""A small training run that can stop and resume, for tests/test_resume.py.

    python tests/resume_script.py MODE[,MODE...] OPTIMIZER DIRECTORY [OPTIMIZER DIRECTORY ...]

MODE ``full`` trains 20 steps; ``first`` trains 10 and checkpoints through the
sidecar (model, optimizer, extra: step and both RNG states); ``resume`` starts
from a differently initialised model, restores that checkpoint and trains
steps 11-20. Each run starts from its own seeds, so several (``full,first``: the
control and the run to resume, for each optimizer) share one process. Each prints
one JSON line: its mode, optimizer and losses (float.hex, so the comparison is
bit-exact) and writes its final state to DIRECTORY/MODE.fdl.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch import nn

import snapsvc


def make(optimizer: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2),
                          nn.Linear(32, 1))
    if optimizer == "adam":
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def train(model, opt, gen, steps) -> list[str]:
    losses = []
    for _ in steps:
        x = torch.randn(16, 8, generator=gen)
        y = x.sum(dim=1, keepdim=True)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item().hex())
    return losses


def run(mode: str, optimizer: str, directory: str) -> list[str]:
    """One MODE run in DIRECTORY: its losses."""
    gen = torch.Generator().manual_seed(123)
    ckpt = os.path.join(directory, "step10.fdl")
    if mode == "resume":
        model, opt = make(optimizer, seed=99)  # deliberately different weights
        report = snapsvc.restore(ckpt, model, opt, strict=True)
        gen.set_state(torch.tensor(list(report.extra["gen"]), dtype=torch.uint8))
        torch.set_rng_state(torch.tensor(list(report.extra["rng"]), dtype=torch.uint8))
        losses = train(model, opt, gen, range(report.extra["step"], 20))
    else:
        model, opt = make(optimizer, seed=0)
        losses = train(model, opt, gen, range(20 if mode == "full" else 10))
        if mode == "first":
            with snapsvc.SnapshotWriter(directory) as w:
                extra = {"step": 10, "gen": bytes(gen.get_state().tolist()),
                         "rng": bytes(torch.get_rng_state().tolist())}
                w.submit(model, ckpt, optimizer=opt, extra=extra, epoch=1).result(timeout=60)
    snapsvc.save_checkpoint(os.path.join(directory, f"{mode}.fdl"), model)
    return losses


def main() -> None:
    modes, rest = sys.argv[1].split(","), sys.argv[2:]
    torch.set_num_threads(1)
    for optimizer, directory in zip(rest[::2], rest[1::2]):
        for mode in modes:
            losses = run(mode, optimizer, directory)
            print(json.dumps({"mode": mode, "optimizer": optimizer, "losses": losses}), flush=True)


if __name__ == "__main__":
    main()

"""A failed commit leaves the previous checkpoint of that path whole (issue 20, section 2).

A checkpoint is up to three files renamed into place one by one (model,
optimizer file, metadata), then their directory is fsynced. A fault at any
of these steps, or at the fsync of any temp file before them, must fail the
handle and leave the checkpoint that was there before exactly as it was:
same bytes, ``verify`` passes, ``restore`` brings it back.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import snapsvc
import commit_hooks

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("no_leaks")]

STEPS = ["fsync:model", "fsync:optim", "fsync:meta",
         "rename:model", "rename:optim", "rename:meta", "fsync:dir"]


def files_of(directory) -> dict[str, bytes]:
    return {n: (directory / n).read_bytes() for n in sorted(os.listdir(directory))
            if n != commit_hooks.FLAG}


def train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 8)).square().sum().backward()
    opt.step()
    opt.zero_grad()


def test_a_fault_at_any_commit_step_keeps_the_previous_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    opt = torch.optim.Adam(model.parameters())
    d = tmp_path / "ckpt"
    d.mkdir()
    target, flag = d / "model.fdl", d / commit_hooks.FLAG
    broken = []
    with snapsvc.SnapshotWriter(fault_hook=commit_hooks.fail_at) as w:
        train(model, opt)
        w.submit(model, target, optimizer=opt, epoch=1).result(timeout=60)
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        before = files_of(d)
        for step in STEPS:
            train(model, opt)
            flag.write_text(step)
            with pytest.raises(snapsvc.WriteFailedError) as ei:
                w.submit(model, target, optimizer=opt, epoch=2).result(timeout=60)
            flag.unlink()
            assert ei.value.filename == str(target), (step, ei.value)
            report = snapsvc.verify(target)
            if files_of(d) != before or not report.ok:
                broken.append(f"{step}: {sorted(files_of(d))} {report.problems}")
                continue
            fresh = nn.Linear(8, 8)
            got = snapsvc.restore(target, fresh, torch.optim.Adam(fresh.parameters()))
            assert got.epoch == 1, step
            assert all(torch.equal(fresh.state_dict()[k], v) for k, v in saved.items()), step
        # the writer keeps serving the same path
        w.submit(model, target, optimizer=opt, epoch=3).result(timeout=60)
    assert not broken, "the previous checkpoint did not survive: " + "; ".join(broken)
    assert snapsvc.verify(target).ok and snapsvc.restore(target, model, opt).epoch == 3


def test_a_fault_in_the_first_commit_of_a_path_leaves_no_checkpoint(tmp_path):
    """No previous checkpoint: nothing may be left under a final name."""
    model = nn.Linear(8, 8)
    opt = torch.optim.Adam(model.parameters())
    d = tmp_path / "ckpt"
    d.mkdir()
    flag = d / commit_hooks.FLAG
    left = {}
    with snapsvc.SnapshotWriter(fault_hook=commit_hooks.fail_at) as w:
        for i, step in enumerate(STEPS):
            flag.write_text(step)
            with pytest.raises(snapsvc.WriteFailedError):
                w.submit(model, d / f"m{i}.fdl", optimizer=opt).result(timeout=60)
            flag.unlink()
            if os.listdir(d):
                left[step] = sorted(os.listdir(d))
    assert not left, f"files left by a failed first commit: {left}"


def test_a_failed_overwrite_without_an_optimizer_keeps_the_previous_optimizer_file(tmp_path):
    """Issue 30 item 8: the old .optim.fdl goes with the commit, so it comes back with it."""
    model = nn.Linear(8, 8)
    opt = torch.optim.Adam(model.parameters())
    d = tmp_path / "ckpt"
    d.mkdir()
    target, flag = d / "model.fdl", d / commit_hooks.FLAG
    with snapsvc.SnapshotWriter(fault_hook=commit_hooks.fail_at) as w:
        train(model, opt)
        w.submit(model, target, optimizer=opt).result(timeout=60)
        before = files_of(d)
        for step in ("rename:meta", "fsync:dir"):
            flag.write_text(step)
            with pytest.raises(snapsvc.WriteFailedError):
                w.submit(model, target).result(timeout=60)
            flag.unlink()
            assert files_of(d) == before, step
            assert snapsvc.verify(target).ok, step
        w.submit(model, target).result(timeout=60)
    assert sorted(os.listdir(d)) == ["model.fdl", "model.fdl.meta"]

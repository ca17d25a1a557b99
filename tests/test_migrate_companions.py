"""``migrate_checkpoint`` migrates a checkpoint whole (issue 30, "migrate_checkpoint companions").

A ``submit(model, path, optimizer=)`` checkpoint of a renamed model is
migrated with its optimizer file (state keyed by parameter name), data file
(a bool buffer) and extra states, then restored into the new model and a
fresh optimizer bit-exactly, and ``snapsvc verify`` passes on it. What
cannot be migrated is refused with a clear error.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from bitwise import assert_bit_identical as same
import snapsvc
from snapsvc.cli import main

pytestmark = pytest.mark.timeout(120)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.k = 0

    def get_extra_state(self):
        return {"k": self.k}

    def set_extra_state(self, state) -> None:
        self.k = state["k"]


class Old(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = Block()
        self.head = nn.Linear(4, 2)
        self.register_buffer("mask", torch.tensor([True, False, True]))  # in the data file

    def forward(self, x):
        return self.head(self.encoder.lin(x))


class New(nn.Module):  # the same model, renamed
    def __init__(self) -> None:
        super().__init__()
        self.enc = Block()
        self.out = nn.Linear(4, 2)
        self.register_buffer("mask", torch.zeros(3, dtype=torch.bool))


RENAMED = {"enc.lin.weight": "encoder.lin.weight", "enc.lin.bias": "encoder.lin.bias",
           "out.weight": "head.weight", "out.bias": "head.bias", "mask": "mask"}


@pytest.fixture
def old_ckpt(tmp_path):
    torch.manual_seed(0)
    model = Old()
    model.mask[1] = True
    model.encoder.k = 7
    opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    for _ in range(2):
        opt.zero_grad()
        model(torch.rand(5, 3)).square().mean().backward()
        opt.step()
    with snapsvc.SnapshotWriter(tmp_path) as w:
        path = w.submit(model, "old.fdl", optimizer=opt, epoch=3).result(timeout=60).path
    return path, model, opt


def test_a_model_and_optimizer_checkpoint_migrates_whole(old_ckpt, tmp_path, capsys):
    path, old, old_opt = old_ckpt
    dst = tmp_path / "new.fdl"
    report = snapsvc.migrate_checkpoint(path, dst, New())
    assert report.is_complete(), str(report)
    assert ("encoder._extra_state", "enc._extra_state") in report.remapped

    torch.manual_seed(5)
    new = New()
    opt = torch.optim.Adam(new.parameters(), lr=0.5)  # fresh: hyperparameters come back too
    restored = snapsvc.restore(dst, new, opt, strict=True)
    assert restored.epoch == 3
    old_sd = old.state_dict()
    for name, was in RENAMED.items():
        same(new.state_dict()[name], old_sd[was], name)
    assert new.enc.k == 7
    same(opt.state_dict()["state"], old_opt.state_dict()["state"])
    # hyperparameters equal, tuples as tuples (as torch.load gives them), migrated or not
    assert old_opt.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    assert type(opt.param_groups[0]["betas"]) is tuple

    assert main(["verify", str(dst)]) == 0, capsys.readouterr()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("new")) == [
        "new.fdl", "new.fdl.data", "new.fdl.meta", "new.optim.fdl"]


def test_what_cannot_be_migrated_is_refused(old_ckpt, tmp_path):
    path, _, _ = old_ckpt
    with pytest.raises(TypeError, match="optimizer file.*give migrate a path"):
        snapsvc.migrate_checkpoint(path, io.BytesIO(), New())
    with snapsvc.SnapshotWriter(tmp_path) as w:
        nested = w.submit({"model": Old(), "step": 1}, "nested.fdl").result(timeout=60).path
    with pytest.raises(snapsvc.FormatError, match="nested-state checkpoint"):
        snapsvc.migrate_checkpoint(nested, tmp_path / "n2.fdl", New())
    assert not (tmp_path / "n2.fdl").exists()

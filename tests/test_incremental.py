"""Incremental staging: only changed tensors are copied, every file is still complete."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import snapsvc
from snapsvc.files.checkpoint import model_tensors

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("no_leaks")]


class Tuned(nn.Module):
    """A frozen backbone (most bytes) and a small trainable head."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
        self.head = nn.Linear(64, 2)
        self.backbone.requires_grad_(False)


def state_of(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model_tensors(m)}


def assert_file_is(path, want: dict[str, torch.Tensor]) -> None:
    got = snapsvc.read_checkpoint(path).entries
    assert list(got) == list(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_only_changed_tensors_are_copied_and_files_stay_complete(tmp_path):
    torch.manual_seed(0)
    m = Tuned()
    opt = torch.optim.SGD(m.head.parameters(), lr=0.1)
    head_bytes = sum(p.numel() * 4 for p in m.head.parameters())
    with snapsvc.SnapshotWriter(tmp_path, incremental=True, slots=2) as w:
        expected, copied = [], []
        for i in range(6):
            m.head(torch.randn(4, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
            before = w.stats()["staged_bytes"]
            expected.append(state_of(m))
            w.submit(m, f"s{i}.fdl").result(timeout=60)
            copied.append(w.stats()["staged_bytes"] - before)
        full = sum(t.numel() * 4 for t in expected[0].values())
        assert copied[0] == full  # a slot's first fill is whole
        # then only the head (a second slot, when one is used, starts whole too)
        assert all(c in (head_bytes, full) for c in copied[1:]), (copied, head_bytes)
        assert sum(c == head_bytes for c in copied[1:]) >= 4, copied
    for i, want in enumerate(expected):
        assert_file_is(tmp_path / f"s{i}.fdl", want)


def test_no_grad_inplace_change_of_a_frozen_tensor_is_picked_up(tmp_path):
    m = Tuned()
    with snapsvc.SnapshotWriter(tmp_path, incremental=True, slots=1) as w:
        w.submit(m, "a.fdl").result(timeout=60)
        with torch.no_grad():
            m.backbone[3].weight.add_(1)  # bumps _version
        want = state_of(m)
        w.submit(m, "b.fdl").result(timeout=60)
    assert_file_is(tmp_path / "b.fdl", want)


def test_a_replaced_tensor_is_copied(tmp_path):
    m = Tuned()
    with snapsvc.SnapshotWriter(tmp_path, incremental=True, slots=1) as w:
        w.submit(m, "a.fdl").result(timeout=60)
        m.backbone[0].weight = nn.Parameter(torch.ones(64, 64), requires_grad=False)
        want = state_of(m)
        w.submit(m, "b.fdl").result(timeout=60)
    assert_file_is(tmp_path / "b.fdl", want)


def test_writes_through_data_are_missed_and_the_check_mode_catches_them(tmp_path, caplog):
    m = Tuned()
    with snapsvc.SnapshotWriter(tmp_path, incremental=True, slots=1) as w:
        w.submit(m, "a.fdl").result(timeout=60)
        stale = state_of(m)
        m.backbone[2].bias.data.add_(1)  # no _version bump: documented as missed
        w.submit(m, "b.fdl").result(timeout=60)
    assert_file_is(tmp_path / "b.fdl", stale)
    m = Tuned()
    with snapsvc.SnapshotWriter(tmp_path, incremental="check", slots=1) as w:
        w.submit(m, "c.fdl").result(timeout=60)
        m.backbone[2].bias.data.add_(1)
        want = state_of(m)
        with caplog.at_level(logging.WARNING, logger="snapsvc"):
            w.submit(m, "d.fdl").result(timeout=60)
    assert "'backbone.2.bias' (a frozen parameter) changed without a _version bump" in caplog.text
    assert_file_is(tmp_path / "d.fdl", want)


def test_incremental_option_is_checked():
    with pytest.raises(ValueError, match="incremental"):
        snapsvc.SnapshotWriter(incremental="yes")

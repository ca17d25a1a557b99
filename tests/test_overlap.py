"""Overlap mode: submit() returns before the copy is done; guard() keeps it consistent.

Each test runs on CPU here and on CUDA where a GPU is present (marked gpu).
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from torch import nn

import snapsvc
from snapsvc.engine import copier
from snapsvc.files.checkpoint import model_tensors

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("no_leaks")]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def make(device: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    # ~32 MiB of parameters, so a copy takes long enough to race the next step
    model = nn.Sequential(nn.Linear(1024, 4096), nn.BatchNorm1d(4096), nn.ReLU(),
                          nn.Linear(4096, 1024)).to(device)
    return model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def forward_backward(model: nn.Module, opt: torch.optim.Optimizer, device: str) -> None:
    x = torch.randn(8, 1024, device=device)
    loss = model(x).square().mean()  # forward updates the BatchNorm buffers
    opt.zero_grad()
    loss.backward()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlap"])
def test_snapshots_never_mix_two_steps(tmp_path, device, overlap):
    model, opt = make(device)
    expected = []
    with snapsvc.SnapshotWriter(tmp_path, slots=2, overlap=overlap) as w:
        w.guard(opt)
        handles = []
        for i in range(30):
            forward_backward(model, opt, device)
            expected.append({n: t.detach().cpu().clone() for n, t in model_tensors(model)})
            handles.append(w.submit(model, f"s{i}.fdl"))
            opt.step()  # at once, while an overlapped copy may still be reading
            forward_backward(model, opt, device)  # and buffers change in the next forward
        reports = [h.result(timeout=120) for h in handles]
        # the copies (on the copier thread, too) were not recorded by autograd
        assert not any(v.requires_grad for slot in w._pools
                       for v in slot.views)
    for i, state in enumerate(expected):
        got = snapsvc.read_checkpoint(tmp_path / f"s{i}.fdl").entries
        assert list(got) == list(state)
        torn = [n for n in state if not torch.equal(got[n], state[n])]
        assert not torn, f"snapshot {i} mixes steps in {torn}"
    assert all(not r.skipped for r in reports)


def test_overlap_returns_before_the_copy_and_wait_staged(tmp_path):
    model, opt = make("cpu")
    with snapsvc.SnapshotWriter(tmp_path, overlap=True) as w:
        w.guard(opt)
        h = w.submit(model, "a.fdl")
        w.wait_staged(timeout=60)
        assert not any(s.copying for s in w._pools)
        assert h.result(timeout=60).stage_s >= 0


def test_overlap_without_guard_warns(tmp_path, caplog):
    model, _ = make("cpu")
    with caplog.at_level(logging.WARNING, logger="snapsvc"):
        with snapsvc.SnapshotWriter(tmp_path, overlap=True) as w:
            w.submit(model, "a.fdl").result(timeout=60)
    assert any("guard" in r.message for r in caplog.records)


@pytest.mark.gpu
def test_cuda_model_roundtrip_blocking(tmp_path):
    model, _ = make("cuda")
    with snapsvc.SnapshotWriter(tmp_path) as w:
        w.submit(model, "g.fdl").result(timeout=60)
        assert all(s.pinned for s in w._pools)
    fresh, _ = make("cuda")
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    snapsvc.load_checkpoint(tmp_path / "g.fdl", fresh)
    for (n, a), (_, b) in zip(model_tensors(model), model_tensors(fresh)):
        assert b.is_cuda and torch.equal(a, b), n


def test_a_schedulers_step_after_submit_never_reaches_the_file(tmp_path, monkeypatch):
    """Overlap copies an optimizer's per-parameter state behind the next step, but its
    param_groups at submit: a scheduler's step in between writes a tensor lr in place."""
    gate = threading.Event()   # the late copy runs only once the scheduler has stepped
    later = copier.Copier.later
    monkeypatch.setattr(copier.Copier, "later", lambda self, fn, *args: later(
        self, lambda *a: (gate.wait(60), fn(*a)), *args))
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.1))
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    moment = opt.state[model.weight]["exp_avg"].clone()
    with snapsvc.SnapshotWriter(tmp_path, overlap=True) as w:
        w.guard(opt)
        h = w.submit({"model": model, "opt": opt}, "a.fdl")
        sched.step()   # lr 0.1 -> 0.05, in place
        assert float(opt.param_groups[0]["lr"]) == pytest.approx(0.05)
        gate.set()
        h.result(timeout=60)
    saved = snapsvc.load(tmp_path / "a.fdl")["opt"]
    assert float(saved["param_groups"][0]["lr"]) == pytest.approx(0.1)
    assert torch.equal(saved["state"][0]["exp_avg"], moment)

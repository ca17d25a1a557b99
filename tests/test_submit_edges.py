"""Smaller submit edges (issue 20, section 7).

* Files get the umask of the moment they are written, not of the sidecar's start.
* Everything refused at submit is a ``SnapsvcError`` (also the built-in type
  older code caught), and a refused submit is not counted as submitted.
* The longest name a submit derives (``.optim.fdl`` with an optimizer) is
  checked at submit.
* ``keep_last`` keeps rotating the series after a sidecar restart.
* ``incremental="check"`` does not take an unchanged NaN for a missed write.
* ``load`` gives an ``nn.Parameter`` back as a plain tensor, by design.
"""

from __future__ import annotations

import logging
import os
import signal
import stat
import time

import pytest
import torch
from torch import nn

import snapsvc
from snapsvc.errors import EncodeError, PathError, SnapsvcError

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leaks")]


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.timeout(300)  # the first test of the file also starts the warm-up sidecar
def test_umask_of_the_moment_of_the_write(tmp_path):
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.randn(2, 3)).sum().backward()
    opt.step()
    old = os.umask(0o022)
    try:
        with snapsvc.SnapshotWriter(tmp_path) as w:
            w.submit(m, "a.fdl").result(timeout=60)  # the sidecar starts under 022
            os.umask(0o077)
            w.submit(m, "b.fdl", optimizer=opt).result(timeout=60)
            w.submit({"model": m}, "c.fdl").result(timeout=60)
            os.umask(0o027)
            w.submit(m, "d.fdl").result(timeout=60)
    finally:
        os.umask(old)
    want = {"a.fdl": 0o644, "a.fdl.meta": 0o644, "b.fdl": 0o600, "b.fdl.meta": 0o600,
            "b.optim.fdl": 0o600, "c.fdl": 0o600, "c.fdl.meta": 0o600, "d.fdl": 0o640,
            "d.fdl.meta": 0o640}
    assert {n: oct(mode(tmp_path / n)) for n in want} == {n: oct(v) for n, v in want.items()}


def other_model_optimizer(m):
    return torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)


def lbfgs(m):
    opt = torch.optim.LBFGS(m.parameters())
    x = torch.randn(4, 3)

    def closure():
        opt.zero_grad()
        loss = m(x).square().mean()
        loss.backward()
        return loss
    opt.step(closure)
    return opt


def tensor_lr(m):
    return torch.optim.Adam(m.parameters(), lr=torch.tensor(0.01))


REFUSED = {
    "nested-tensor": (lambda m: ({"x": torch.nested.nested_tensor([torch.zeros(2),
                                                                   torch.zeros(3)])}, {}),
                      TypeError),
    "adam-tensor-lr": (lambda m: (m, {"optimizer": tensor_lr(m)}), TypeError),
    "lbfgs-model-mode": (lambda m: (m, {"optimizer": lbfgs(m)}), TypeError),
    "other-models-optimizer": (lambda m: (m, {"optimizer": other_model_optimizer(m)}), ValueError),
    "metrics-list": (lambda m: (m, {"metrics": {"loss": [1.0]}}), TypeError),
    "metrics-str": (lambda m: (m, {"metrics": {"loss": "low"}}), ValueError),
    "metrics-not-a-map": (lambda m: (m, {"metrics": [("loss", 1.0)]}), TypeError),
}


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_refused_at_submit_is_a_snapsvc_error_and_not_counted(tmp_path, case):
    make, builtin = REFUSED[case]
    m = model()
    with snapsvc.SnapshotWriter(tmp_path) as w:
        w.submit(m, "ok.fdl").result(timeout=60)
        obj, kwargs = make(m)
        with pytest.raises(SnapsvcError) as info:
            w.submit(obj, "bad.fdl", **kwargs)
        assert isinstance(info.value, builtin), type(info.value).__mro__  # old catches still work
        stats = w.stats()
    assert stats["submitted"] == 1 and stats["written"] == 1, stats
    assert not (tmp_path / "bad.fdl").exists()


def test_submit_after_close_is_a_snapsvc_error(tmp_path):
    w = snapsvc.SnapshotWriter(tmp_path)
    w.submit(model(), "a.fdl").result(timeout=60)
    w.close()
    with pytest.raises(SnapsvcError) as info:
        w.submit(model(), "b.fdl")
    assert isinstance(info.value, RuntimeError)
    assert w.stats()["submitted"] == 1


def test_metadata_over_the_limit_is_not_counted(tmp_path):
    with snapsvc.SnapshotWriter(tmp_path) as w:
        with pytest.raises(EncodeError, match="metadata"):
            w.submit({"model": model(), "blob": b"\0" * (64 << 20)}, "big.fdl")
        assert w.stats()["submitted"] == 0


def test_a_long_name_with_an_optimizer_is_a_path_error_at_submit(tmp_path):
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    name = "a" * 246 + ".fdl"  # 250 bytes: .fdl.meta is 255, .optim.fdl 256
    with snapsvc.SnapshotWriter(tmp_path) as w:
        with pytest.raises(PathError, match="optim"):
            w.submit(m, name, optimizer=opt)
        w.submit(m, name).result(timeout=60)  # without an optimizer it fits
        assert w.stats()["failed"] == 0
    assert sorted(os.listdir(tmp_path)) == [name, name + ".meta"]


def wait_dead(pid: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"sidecar {pid} still alive")


@pytest.mark.timeout(180)
def test_keep_last_remembers_its_series_across_a_restart(tmp_path):
    m = model()
    with snapsvc.SnapshotWriter(tmp_path, keep_last=2) as w:
        w.submit(m, "step1.fdl").result(timeout=60)
        w.submit(m, "step2.fdl").result(timeout=60)
        pid = w.pid
        os.kill(pid, signal.SIGKILL)
        wait_dead(pid)
        deadline = time.monotonic() + 30
        while True:  # the next submit restarts it (or fails once, if it sees the death first)
            try:
                w.submit(m, "step3.fdl").result(timeout=60)
                break
            except snapsvc.errors.BrokenWriterError:
                assert time.monotonic() < deadline
        assert w.pid != pid
        w.submit(m, "step4.fdl").result(timeout=60)
    names = sorted(n for n in os.listdir(tmp_path) if n.endswith(".fdl"))
    assert names == ["step3.fdl", "step4.fdl"]


def test_incremental_check_does_not_warn_for_an_unchanged_nan(tmp_path, caplog):
    m = model()
    m[1].running_mean.fill_(float("nan"))  # never changes again
    with snapsvc.SnapshotWriter(tmp_path, incremental="check") as w:
        with caplog.at_level(logging.WARNING, logger="snapsvc"):
            for i in range(3):
                w.submit(m, f"s{i}.fdl").result(timeout=60)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    got = snapsvc.read_checkpoint(tmp_path / "s2.fdl").entries["1.running_mean"]
    assert torch.isnan(got).all()


def test_load_gives_parameters_back_as_plain_tensors(tmp_path):
    """Deliberate, and documented in load()'s docstring: the file keeps data, not autograd."""
    p = nn.Parameter(torch.ones(2))
    with snapsvc.SnapshotWriter(tmp_path) as w:
        w.submit({"p": p, "model": nn.Linear(2, 2)}, "p.fdl").result(timeout=60)
    loaded = snapsvc.load(tmp_path / "p.fdl")
    assert type(loaded["p"]) is torch.Tensor and not loaded["p"].requires_grad
    assert type(loaded["model"]["weight"]) is torch.Tensor
    assert "nn.Parameter" in snapsvc.load.__doc__

"""Resume: model, optimizer and extra through the sidecar, bit-identical training."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import snapsvc
from snapsvc.state.resume import optim_path

HERE = os.path.dirname(os.path.abspath(__file__))


def run(mode: str, optimizer: str, directory) -> list[str]:
    out = subprocess.run([sys.executable, os.path.join(HERE, "resume_script.py"), mode, optimizer,
                          str(directory)], capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])["losses"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_resume_in_a_fresh_process_is_bit_identical(tmp_path, optimizer):
    full = run("full", optimizer, tmp_path)
    first = run("first", optimizer, tmp_path)
    resumed = run("resume", optimizer, tmp_path)
    assert first + resumed == full
    a = snapsvc.read_checkpoint(tmp_path / "full.fdl").entries
    b = snapsvc.read_checkpoint(tmp_path / "resume.fdl").entries
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    # flodl-facing file holds the model only; the optimizer lives beside it
    assert snapsvc.verify(tmp_path / "step10.fdl").ok
    assert all(":" not in k for k in snapsvc.checkpoint_keys(tmp_path / "step10.fdl"))
    assert snapsvc.checkpoint_keys(optim_path(tmp_path / "step10.fdl"))


def test_optim_path_names():
    assert optim_path("a/b.fdl") == "a/b.optim.fdl"
    assert optim_path("a/b.fdl.gz") == "a/b.optim.fdl.gz"
    assert optim_path("a/b.ckpt") == "a/b.ckpt.optim"


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("no_leaks")
def test_restore_checks_before_changing_anything(tmp_path, net):
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    net(torch.randn(4, 3)).sum().backward()
    opt.step()
    with snapsvc.SnapshotWriter(tmp_path, keep_last=1) as w:
        w.submit(net, "r1.fdl", optimizer=opt, extra={"step": 3}).result(timeout=60)
        w.submit(net, "r2.fdl", optimizer=opt).result(timeout=60)
    # keep_last removed the older checkpoint with its optimizer file and metadata
    assert sorted(os.listdir(tmp_path)) == ["r2.fdl", "r2.fdl.meta", "r2.optim.fdl"]
    other = nn.Linear(3, 4)
    sgd = torch.optim.SGD(other.parameters(), lr=0.1)
    before = other.weight.detach().clone()
    with pytest.raises(ValueError, match="Adam"):
        snapsvc.restore(tmp_path / "r2.fdl", other, sgd)
    assert torch.equal(other.weight, before)
    # a corrupt optimizer file is caught by verify
    data = bytearray((tmp_path / "r2.optim.fdl").read_bytes())
    data[-1] ^= 0xFF
    (tmp_path / "r2.optim.fdl").write_bytes(data)
    report = snapsvc.verify(tmp_path / "r2.fdl")
    assert not report.ok and any("r2.optim.fdl" in p for p in report.problems)


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("no_leaks")
def test_extra_must_be_msgpackable(tmp_path, net):
    with snapsvc.SnapshotWriter(tmp_path) as w:
        with pytest.raises(TypeError, match=r"extra\['bad'\]: a value of type object is not storable"):
            w.submit(net, "x.fdl", extra={"bad": object()})
        assert w.is_idle()

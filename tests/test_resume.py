"""Resume: model, optimizer and extra through the sidecar, bit-identical training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import snapsvc
from snapsvc.state.resume import optim_path

HERE = os.path.dirname(os.path.abspath(__file__))


OPTIMIZERS = ["adam", "sgd"]


def run(modes: str, *optimizer_and_directory) -> dict[tuple[str, str], list[str]]:
    """resume_script.py's runs in one new process: their losses by (mode, optimizer)."""
    out = subprocess.run([sys.executable, os.path.join(HERE, "resume_script.py"), modes,
                          *map(str, optimizer_and_directory)],
                         capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.strip().splitlines() if line.startswith("{")]
    return {(r["mode"], r["optimizer"]): r["losses"] for r in lines}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, tuple[str, list[str], list[str]]]:
    """For each optimizer: its directory, the 20-step control's losses and those of the
    first 10 steps (checkpointed at step 10), from one process: only the resume needs
    a process of its own."""
    dirs = {o: str(tmp_path_factory.mktemp(f"resume-{o}")) for o in OPTIMIZERS}
    losses = run("full,first", *(a for o in OPTIMIZERS for a in (o, dirs[o])))
    return {o: (dirs[o], losses["full", o], losses["first", o]) for o in OPTIMIZERS}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_resume_in_a_fresh_process_is_bit_identical(trained, optimizer):
    directory, full, first = trained[optimizer]
    tmp_path = Path(directory)
    resumed = run("resume", optimizer, tmp_path)["resume", optimizer]
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


# msgpack has no tuple: hyperparameters the optimizer holds as tuples (Adam's betas, Rprop's
# etas and step sizes) must come back as tuples, as torch.save + torch.load give them
_TUPLED = {"Adam": {"betas": (0.8, 0.9)}, "AdamW": {"betas": (0.7, 0.95)},
           "NAdam": {"betas": (0.85, 0.99)}, "RAdam": {"betas": (0.8, 0.98)},
           "Adamax": {"betas": (0.75, 0.9)},
           "Rprop": {"etas": (0.4, 1.3), "step_sizes": (1e-5, 20.0)}}


def _trained(name: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = nn.Linear(4, 3)
    opt = getattr(torch.optim, name)(m.parameters(), lr=1e-2, **_TUPLED[name])
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    return m, opt


def _control(opt: torch.optim.Optimizer, fresh: torch.optim.Optimizer) -> list[dict]:
    import io
    f = io.BytesIO()
    torch.save(opt.state_dict(), f)
    fresh.load_state_dict(torch.load(io.BytesIO(f.getvalue()), weights_only=True))
    return fresh.state_dict()["param_groups"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(_TUPLED))
def test_tuple_hyperparameters_come_back_as_tuples_as_with_torch_load(tmp_path, name):
    m, opt = _trained(name)
    with snapsvc.SnapshotWriter(tmp_path) as w:
        w.submit(m, "flat.fdl", optimizer=opt).result(30)
        w.submit({"model": m, "opt": opt}, "state.fdl").result(30)
    control = _control(opt, getattr(torch.optim, name)(_trained(name)[0].parameters()))
    for how in ("flat", "state"):
        m2 = nn.Linear(4, 3)
        opt2 = getattr(torch.optim, name)(m2.parameters())   # the default hyperparameters
        if how == "flat":
            snapsvc.restore(tmp_path / "flat.fdl", m2, opt2)
        else:
            snapsvc.restore(tmp_path / "state.fdl", {"model": m2, "opt": opt2})
        groups = opt2.state_dict()["param_groups"]
        assert groups == control, how
        for k in _TUPLED[name]:
            assert type(groups[0][k]) is type(control[0][k]) is tuple, (how, k)


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("world1")
def test_distributed_restores_give_tuples_back_and_take_plain_state_mappings(tmp_path):
    """Through DistributedSnapshotWriter: a sharded model with its optimizer (the
    manifest's optimizer groups), and a state mapping without DTensors (each rank's
    own file, which restore_distributed used to refuse as 'not a state mapping')."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (1,))

    def sharded(name: str) -> tuple[nn.Module, torch.optim.Optimizer]:
        m, _ = _trained(name)
        fully_shard(m, mesh=mesh)
        opt = getattr(torch.optim, name)(m.parameters(), lr=1e-2, **_TUPLED[name])
        m(torch.randn(2, 4)).sum().backward()
        opt.step()
        return m, opt

    m, opt = sharded("AdamW")
    plain, popt = _trained("Rprop")
    with snapsvc.DistributedSnapshotWriter(tmp_path / "sharded") as w:
        w.submit(m, 1, optimizer=opt).result(60)
    with snapsvc.DistributedSnapshotWriter(tmp_path / "plain") as w:
        w.submit({"model": plain, "opt": popt, "pos": (3, "x")}, 1).result(60)
    m2 = nn.Linear(4, 3)
    fully_shard(m2, mesh=mesh)
    opt2 = torch.optim.AdamW(m2.parameters())
    snapsvc.restore_distributed(snapsvc.latest_checkpoint(tmp_path / "sharded"), m2, opt2)
    assert opt2.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    assert type(opt2.param_groups[0]["betas"]) is tuple
    p2 = nn.Linear(4, 3)
    state = {"model": p2, "opt": torch.optim.Rprop(p2.parameters()), "pos": None}
    report = snapsvc.restore_distributed(snapsvc.latest_checkpoint(tmp_path / "plain"), state)
    assert report.state["pos"] == (3, "x")
    assert state["opt"].state_dict()["param_groups"] == popt.state_dict()["param_groups"]
    assert all(torch.equal(a, b) for a, b in zip(p2.parameters(), plain.parameters()))

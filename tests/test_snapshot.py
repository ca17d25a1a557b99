"""Python ports of the seven tests of flodl's graph/snapshot.rs (shared/seed)."""

from __future__ import annotations

import io
import os
import pickle
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

import snapsvc


def build_test_graph() -> nn.Module:
    # flodl: FlowBuilder::from(Linear(2, 3)).tag("encoder")
    return nn.ModuleDict({"encoder": nn.Linear(2, 3)})


def test_snapshot_captures_params_on_cpu():
    snap = snapsvc.snapshot_cpu(build_test_graph())
    assert snap.params, "should have params"
    for name, t in snap.params.items():
        assert t.device.type == "cpu", f"param {name} should be on CPU"
        assert not t.requires_grad and t.grad_fn is None, f"param {name} should be detached"
        assert t.is_shared(), f"param {name} should be in shared memory"


def test_snapshot_captures_correct_names():
    snap = snapsvc.snapshot_cpu(build_test_graph())
    assert any("encoder" in n for n in snap.params), f"names should include the prefix: {list(snap.params)}"
    assert list(snap.params) == ["encoder.weight", "encoder.bias"]


def test_snapshot_captures_metrics_and_epoch():
    snap = snapsvc.snapshot_cpu(build_test_graph(), metrics={"loss": 0.3}, epoch=2)
    assert snap.epoch == 2
    assert "loss" in snap.metrics and abs(snap.metrics["loss"] - 0.3) < 1e-6


def _receive(q, out):
    snap = q.get(timeout=60)
    out.put((sorted(snap.params), snap.params["encoder.weight"].sum().item(), snap.epoch,
             snap.params["encoder.weight"].is_shared()))


@pytest.mark.timeout(120)
def test_snapshot_is_send():
    """flodl asserts Send; here: it pickles, and crosses a torch.multiprocessing queue."""
    g = build_test_graph()
    snap = snapsvc.snapshot_cpu(g, epoch=3)
    back = pickle.loads(pickle.dumps(snap))
    assert torch.equal(back.params["encoder.weight"], g.encoder.weight.detach())
    ctx = mp.get_context("spawn")
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_receive, args=(q, out))
    p.start()
    try:
        q.put(snap)
        names, total, epoch, shared = out.get(timeout=90)
    finally:
        p.join(30)
    assert names == ["encoder.bias", "encoder.weight"] and epoch == 3 and shared
    assert total == pytest.approx(g.encoder.weight.sum().item())


def test_snapshot_save_roundtrip():
    g = build_test_graph()
    snap = snapsvc.snapshot_cpu(g)
    buf = io.BytesIO()
    snap.save(buf)
    buf.seek(0)
    report = snapsvc.load_checkpoint(buf, g)
    assert len(report.loaded) == len(snap.params) + len(snap.buffers)
    assert not report.missing and not report.skipped
    assert buf.getvalue()[8:40] == bytes(32)  # flodl writes a zero hash for snapshots


def test_snapshot_save_file_gz(tmp_path):
    g = build_test_graph()
    snap = snapsvc.snapshot_cpu(g)
    path = tmp_path / "test_snapshot.fdl.gz"
    snap.save_file(path)
    assert os.path.getsize(path) > 0
    fresh = build_test_graph()
    report = snapsvc.load_checkpoint(path, fresh)
    assert len(report.loaded) == len(snap.params)
    assert torch.equal(fresh.encoder.weight, g.encoder.weight)
    back = snapsvc.load_snapshot(path)
    assert list(back.params) == list(snap.params) and back.buffers == {}


def test_snapshot_in_cpu_worker():
    g = build_test_graph()
    g.encoder(torch.randn(1, 2))  # a forward pass, so params have seen use
    snap = snapsvc.snapshot_cpu(g)

    def work() -> bool:
        assert snap.params
        return all(t.device.type == "cpu" for t in snap.params.values())

    with ThreadPoolExecutor(1) as worker:
        assert worker.submit(work).result(timeout=30)


def test_snapshot_buffers_and_metadata_roundtrip(tmp_path, net):
    snap = snapsvc.snapshot_cpu(net, metrics={"loss": 0.25, "acc": 1}, epoch=7)
    assert list(snap.buffers) == ["norm.running_mean", "norm.running_var",
                                  "norm.num_batches_tracked"]  # persistent only
    snap.save_file(tmp_path / "s.fdl")
    back = snapsvc.load_snapshot(tmp_path / "s.fdl")
    assert back.epoch == 7 and back.metrics == {"loss": 0.25, "acc": 1.0}
    for a, b in ((back.params, snap.params), (back.buffers, snap.buffers)):
        assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_load_snapshot_without_metadata_is_unfinished(tmp_path, net):
    snapsvc.save_checkpoint(tmp_path / "bare.fdl", net)
    with pytest.raises(snapsvc.FormatError, match="unfinished write"):
        snapsvc.load_snapshot(tmp_path / "bare.fdl")

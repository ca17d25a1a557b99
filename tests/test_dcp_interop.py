"""A DCP-native checkpoint beside snapsvc's (issue 33): whatever SnapsvcStorageWriter does in
the same root or in another folder, the stock checkpoint's files stay as they were and DCP's
own reader still loads it; snapsvc's reader refuses it with a FormatError, changing nothing."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import snapsvc
from snapsvc.dcp import SnapsvcStorageReader, SnapsvcStorageWriter


def _files(root) -> dict[str, tuple[str, int]]:
    """Every file under ``root``: its SHA-256 and modification time."""
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = (hashlib.sha256(f.read()).hexdigest(),
                                                 os.stat(p).st_mtime_ns)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["same root", "another folder"])
def test_a_dcp_native_checkpoint_is_untouched_and_loads_with_dcp(world1, tmp_path, where):
    state = {"model": {"w": torch.randn(6, 4), "b": torch.arange(3.0)},
             "optim": {"param_groups": [{"lr": 0.1, "params": [0, 1]}]}}
    native = tmp_path / "ckpt" / "step_1"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(native))
    saved = state["model"]["w"].clone()
    before = _files(native)
    root = tmp_path / ("ckpt" if where == "same root" else "snap")
    w = SnapsvcStorageWriter(root / "step_2", coord_timeout=60)
    try:
        dcp.save(state, storage_writer=w)
        for step in (3, 4):
            with torch.no_grad():
                state["model"]["w"].add_(1.0)
            dcp.async_save(state, storage_writer=w,
                           checkpoint_id=root / f"step_{step}").result(timeout=60)
    finally:
        w.close()
    assert _files(native) == before
    assert snapsvc.latest_checkpoint(root).endswith("step_4")
    got = {"model": {"w": torch.zeros(6, 4), "b": torch.zeros(3)},
           "optim": {"param_groups": [{"lr": 0.0, "params": []}]}}
    dcp.load(got, storage_reader=dcp.FileSystemReader(native))
    assert torch.equal(got["model"]["w"], saved)
    assert torch.equal(got["model"]["b"], state["model"]["b"])
    # snapsvc's reader: a clear FormatError (no manifest), the state unchanged
    mine = {"model": {"w": torch.full((6, 4), 5.0), "b": torch.zeros(3)}}
    with pytest.raises(CheckpointException) as info:
        dcp.load(mine, storage_reader=SnapsvcStorageReader(native))
    assert isinstance(info.value.failures[0][0], snapsvc.FormatError), info.value.failures
    assert torch.equal(mine["model"]["w"], torch.full((6, 4), 5.0))
    assert _files(native) == before

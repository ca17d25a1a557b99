"""A sharded multi-rank submit with tensors of dtypes ``.fdl`` has no tag for
(issue 30, "also close these"): a bool mask, uint8 RNG state and an int8
buffer go to each rank's data file, as a single-rank submit's do, and the
manifest records that file's size and CRC-32, which verify and restore check.

One spawned gloo world of 2 ranks on the CPU (tests/dist_world.py); the
checks on the files run in this process.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import snapsvc
from dist_world import run_world
from snapsvc.distributed import read_manifest
from snapsvc.distributed.verify import verify_step

pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 needs torch.distributed")
pytestmark = [pytest.mark.timeout(150)]


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    m.register_buffer("mask", torch.rand(5) > 0.5)
    m.register_buffer("codes", torch.randint(-100, 100, (3, 4), dtype=torch.int8))
    return m


def full(model: nn.Module) -> dict:
    from torch.distributed.tensor import DTensor
    return {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
            for n, t in model.state_dict().items()}


def scenario(rank: int, world: int, tmp: str) -> dict:
    from torch.distributed.fsdp import fully_shard
    model = make_model(0)
    fully_shard(model[0])
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    torch.manual_seed(5)
    rng = torch.get_rng_state()
    d = os.path.join(tmp, "ckpt")
    with snapsvc.DistributedSnapshotWriter(d, coord_timeout=60) as w:
        w.submit(model, 1, optimizer=opt).result(timeout=60)
        w.submit({"model": model, "opt": opt, "rng": rng}, 2).result(timeout=60)
        w.submit(make_model(rank), 3).result(timeout=60)   # not sharded: each rank's own file
    saved = full(model)
    out: dict = {}
    fresh = make_model(1)
    fully_shard(fresh[0])
    fully_shard(fresh)
    snapsvc.restore_distributed(os.path.join(d, "step_1"), fresh)
    out["model_form"] = sorted(n for n, t in full(fresh).items() if not torch.equal(t, saved[n]))
    again = make_model(2)
    fully_shard(again[0])
    fully_shard(again)
    state = {"model": again, "opt": torch.optim.Adam(again.parameters(), lr=0.01),
             "rng": torch.zeros_like(rng)}
    snapsvc.restore_distributed(os.path.join(d, "step_2"), state)
    out["state_form"] = sorted(n for n, t in full(again).items() if not torch.equal(t, saved[n]))
    out["rng"] = torch.equal(state["rng"], rng)
    # what the optimizer holds is aligned for its dtype, as a copy would be (a block read
    # whole from a file whose entry headers are not padded is not always)
    local = [getattr(t, "_local_tensor", t) for s in state["opt"].state.values()
             for t in s.values() if isinstance(t, torch.Tensor)]
    out["misaligned"] = [t.data_ptr() % t.element_size() for t in local
                         if t.data_ptr() % t.element_size()]
    if rank == 0:
        torch.save(saved, os.path.join(tmp, "saved.pt"))
    return out


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist_datafile")
    codes, results = run_world(tmp, 2, scenario)
    assert codes == [0, 0], results
    return tmp, results


def test_sharded_dtypes_go_to_the_data_file_and_restore(world2):
    tmp, results = world2
    for r in results:
        assert r == {"model_form": [], "state_form": [], "rng": True, "misaligned": []}, r
    for step in (1, 2, 3):
        m = read_manifest(tmp / "ckpt" / f"step_{step}")
        rank0 = m.ranks[0]
        data = tmp / "ckpt" / f"step_{step}" / "rank0.fdl.data"
        assert rank0.data == {"file": "rank0.fdl.data", "size": data.stat().st_size,
                              "crc32": snapsvc.verify(tmp / "ckpt" / f"step_{step}" /
                                                      "rank0.fdl").meta.data["crc32"]}
        meta = snapsvc.verify(tmp / "ckpt" / f"step_{step}" / "rank0.fdl").meta
        assert "InlineTensor" not in repr(meta.state), "a tensor stayed in the metadata"
        if step < 3:
            assert {e["name"] for e in rank0.entries if e.get("file") == "rank0.fdl.data"} \
                >= {"mask", "codes"} | ({"rng"} if step == 2 else set())
        else:
            assert m.ranks[1].data is not None and m.ranks[1].data["file"] == "rank1.fdl.data"
        assert verify_step(tmp / "ckpt" / f"step_{step}").ok
    # a plain model (world 1, this process) restores the sharded checkpoint too
    plain = make_model(3)
    snapsvc.restore_distributed(tmp / "ckpt" / "step_1", plain)
    saved = torch.load(tmp / "saved.pt")
    assert all(torch.equal(t, saved[n]) for n, t in plain.state_dict().items())


def test_consolidate_writes_the_data_file_too(world2, tmp_path):
    tmp, _ = world2
    dst = tmp_path / "full.fdl"
    snapsvc.distributed.consolidate(tmp / "ckpt" / "step_1", dst)
    assert snapsvc.verify(dst).ok and (tmp_path / "full.fdl.data").exists()
    plain = make_model(5)
    snapsvc.restore(dst, plain)
    saved = torch.load(tmp / "saved.pt")
    assert all(torch.equal(t, saved[n]) for n, t in plain.state_dict().items())


def test_a_flipped_byte_in_a_data_file_is_caught_by_the_manifest_crc(world2, tmp_path):
    import shutil
    src, _ = world2
    step = tmp_path / "step_1"
    shutil.copytree(src / "ckpt" / "step_1", step)
    data = step / "rank0.fdl.data"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0x01       # the last tensor byte: the file keeps its size and structure
    data.write_bytes(bytes(raw))
    report = verify_step(step)
    assert not report.ok and "rank0.fdl.data" in str(report), str(report)
    plain = make_model(4)
    before = {n: t.clone() for n, t in plain.state_dict().items()}
    with pytest.raises(snapsvc.FormatError, match=r"rank0\.fdl\.data.*CRC-32|CRC-32.*rank0\.fdl\.data"):
        snapsvc.restore_distributed(step, plain)
    assert all(torch.equal(t, before[n]) for n, t in plain.state_dict().items())


def test_verify_compares_each_data_file_with_the_manifest(world2, tmp_path):
    """A data file whose metadata was rewritten with it (it changed after the commit)
    differs from the manifest's record: verify_step names it."""
    import shutil
    from snapsvc.distributed.manifest import _write_manifest
    src, _ = world2
    step = tmp_path / "step_3"
    shutil.copytree(src / "ckpt" / "step_3", step)
    m = read_manifest(step)
    m.ranks[1].data["crc32"] ^= 1
    _write_manifest(str(step), m)
    report = verify_step(step)
    assert not report.ok
    assert "rank1.fdl.data" in str(report) and "the manifest" in str(report), str(report)

"""Sharded models (FSDP2 ``fully_shard``, DTensor) through DistributedSnapshotWriter.

Two spawned gloo worlds on the CPU (tests/dist_world.py), each reused for
several checks, plus checks in this process:

- world 2 (``scenario_save``): Linear(8,16)-ReLU-Linear(16,4), each layer
  ``fully_shard``-ed, Adam; 3 steps, save (snapsvc, and DCP as the control),
  2 more steps (the uninterrupted run); restore into a differently
  initialised model, 2 steps again: bit-identical. A tensor-parallel style
  model (``Shard(1)`` on a 2-D mesh, a ``Replicate()`` bias) is saved too.
- world 3 (``scenario_reshard``): the world-2 checkpoints restored into 3
  ranks (16 rows over 3: uneven, padded shards), snapsvc and DCP; a copy
  with one rank file corrupted, which only the ranks needing that file see;
  a rank SIGKILLed during a save.
- world 1 (this process, no process group): a plain model restored from the
  sharded checkpoint; ``consolidate`` and ``snapsvc consolidate``.

Reference values travel as ``torch.save`` files of full (unsharded) tensors,
written by rank 0 of the world-2 run.
"""

from __future__ import annotations

import os
import shutil
import signal

import pytest
import torch
import torch.distributed as dist
from torch import nn

import snapsvc
from dist_world import run_world, write_result
from snapsvc.distributed import MANIFEST_NAME, SHARDS_KEY
from snapsvc.files.meta import read_meta

pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 needs torch.distributed")
pytestmark = [pytest.mark.timeout(150)]

RESULT_S = 60.0


# -- inside the ranks ---------------------------------------------------------------
def make_plain(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def make_fsdp(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard
    model = make_plain(seed)  # the same seed on every rank: one global model
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int) -> None:
    for step in steps:
        torch.manual_seed(1000 * step + rank)
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def full(t: torch.Tensor) -> torch.Tensor:
    """The global tensor (a collective for a DTensor: every rank calls it in the same order)."""
    from torch.distributed.tensor import DTensor
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def full_state(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> dict:
    """Parameters and, with ``opt``, Adam's exp_avg, exp_avg_sq and step, unsharded."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = full(p)
        if opt is not None:
            for key in sorted(opt.state[p]):
                out[f"{name}:{key}"] = full(opt.state[p][key])
    return out


def local_state(model: nn.Module) -> dict:
    """This rank's pieces of the parameters (no collective)."""
    return {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
            for n, p in model.named_parameters()}


def diff(a: dict, b: dict) -> list[str]:
    """Names whose tensors are not bit-equal (or missing on one side)."""
    return sorted(k for k in a.keys() | b.keys()
                  if k not in a or k not in b or a[k].dtype != b[k].dtype
                  or not torch.equal(a[k], b[k]))


def make_tp(mesh_shape: tuple[int, ...], seed: int = 5) -> nn.Module:
    """Tensor-parallel style: the weight split by columns (Shard(1)) on the last mesh
    dimension, the bias replicated."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    torch.manual_seed(seed)
    lin = nn.Linear(6, 5)
    mesh = init_device_mesh("cpu", mesh_shape)
    flat = init_device_mesh("cpu", (dist.get_world_size(),))
    lin.weight = nn.Parameter(distribute_tensor(
        lin.weight.detach(), mesh, [Replicate()] * (len(mesh_shape) - 1) + [Shard(1)]))
    lin.bias = nn.Parameter(distribute_tensor(lin.bias.detach(), flat, [Replicate()]))
    return lin


def make_partial() -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial
    m = nn.Module()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    m.p = nn.Parameter(DTensor.from_local(torch.ones(3), mesh, [Partial()]))
    return m


def dcp_save(model: nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def dcp_load(model: nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def outcome(handle) -> dict:
    try:
        r = handle.result(timeout=RESULT_S)
    except snapsvc.DistributedCheckpointError as e:
        return {"ok": False, "error": str(e), "timed_out": e.timed_out}
    return {"ok": True, "path": r.path}


def scenario_save(rank: int, world: int, tmp: str) -> dict:
    d = os.path.join(tmp, "ckpt")
    out: dict = {}
    model, opt = make_fsdp(0)
    train(model, opt, range(1, 4), rank)
    saved = full_state(model, opt)
    with snapsvc.DistributedSnapshotWriter(d, coord_timeout=60) as w:
        out["save"] = outcome(w.submit(model, 3, optimizer=opt, metrics={"loss": 1.5},
                                       epoch=3, extra={"rank": rank}))
        tp = make_tp((1, world))
        out["save_tp"] = outcome(w.submit(tp, 4))
        try:   # refused on every rank: its step directory must not stay behind, empty
            w.submit(model, 5, extra=object())
        except TypeError as e:
            out["refused"] = str(e)
        try:   # a pending reduction is no value to save
            w.submit(make_partial(), 6)
        except ValueError as e:
            out["partial"] = str(e)
    dcp_save(model, opt, os.path.join(tmp, "dcp"))
    train(model, opt, range(4, 6), rank)   # the uninterrupted run
    after = full_state(model, opt)
    tp_full = full_state(tp)   # collectives: on every rank
    if rank == 0:
        torch.save({"saved": saved, "after": after, "tp": tp_full}, os.path.join(tmp, "ref.pt"))

    fresh, fresh_opt = make_fsdp(1)   # another initialisation, no optimizer state yet
    report = snapsvc.restore_distributed(os.path.join(d, "step_3"), fresh, fresh_opt)
    out["report"] = {"epoch": report.epoch, "metrics": report.metrics, "extra": report.extra,
                     "loaded": report.loaded, "missing": report.missing}
    out["restored_diff"] = diff(full_state(fresh, fresh_opt), saved)
    train(fresh, fresh_opt, range(4, 6), rank)
    out["resumed_diff"] = diff(full_state(fresh, fresh_opt), after)

    control, control_opt = make_fsdp(2)
    dcp_load(control, control_opt, os.path.join(tmp, "dcp"))
    out["dcp_diff"] = diff(full_state(control, control_opt), saved)
    return out


def scenario_reshard(rank: int, world: int, tmp: str, src: str, corrupt: str) -> dict:
    out: dict = {}
    ref = torch.load(os.path.join(src, "ref.pt"))
    model, opt = make_fsdp(3)
    snapsvc.restore_distributed(os.path.join(src, "ckpt", "step_3"), model, opt)
    out["restored_diff"] = diff(full_state(model, opt), ref["saved"])

    control, control_opt = make_fsdp(4)
    dcp_load(control, control_opt, os.path.join(src, "dcp"))
    out["dcp_diff"] = diff(full_state(control, control_opt), ref["saved"])

    tp = make_tp((world,), seed=6)   # saved as 3 + 3 columns, restored as 2 + 2 + 2
    snapsvc.restore_distributed(os.path.join(src, "ckpt", "step_4"), tp)
    out["tp_diff"] = diff(full_state(tp), ref["tp"])

    victim, victim_opt = make_fsdp(7)   # from the copy whose rank1.fdl has a flipped byte
    try:
        snapsvc.restore_distributed(corrupt, victim, victim_opt)
        out["corrupt"] = "restored"
    except snapsvc.FormatError as e:
        out["corrupt"] = f"{type(e).__name__}: {e}"
    out["corrupt_untouched"] = (not diff(local_state(victim), local_state(make_fsdp(7)[0]))
                                and not victim_opt.state)

    with snapsvc.DistributedSnapshotWriter(os.path.join(tmp, "ckpt"), coord_timeout=30) as w:
        h = w.submit(model, 10, optimizer=opt)
        if rank == world - 1:   # dies with its piece staged, before the exchange
            write_result(tmp, rank, out)
            os.kill(os.getpid(), signal.SIGKILL)
        out["killed_save"] = outcome(h)
    return out


# -- in the test process ----------------------------------------------------------
@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp2")
    codes, results = run_world(tmp, 2, scenario_save)
    assert codes == [0, 0]
    return tmp, results, torch.load(tmp / "ref.pt")


def test_save_restore_resume_at_world_size_2(world2):
    tmp, results, _ = world2
    for rank, res in enumerate(results):
        assert res["save"]["ok"] and res["save_tp"]["ok"], res
        assert res["refused"].startswith("extra: a value of type object is not storable")
        assert "'p': placement Partial(sum) cannot be checkpointed" in res["partial"]
        assert res["dcp_diff"] == []          # the control: DCP round-trips this model
        assert res["restored_diff"] == [], res["restored_diff"]   # params, exp_avg(_sq), step
        assert res["resumed_diff"] == [], res["resumed_diff"]     # 2 more steps, bit-identical
        assert res["report"]["epoch"] == 3 and res["report"]["extra"] == {"rank": rank}
        assert res["report"]["metrics"] == {"loss": 1.5} and res["report"]["missing"] == []
        assert res["report"]["loaded"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert not (tmp / "ckpt" / "step_5").exists() and not (tmp / "ckpt" / "step_6").exists()
    assert snapsvc.latest_checkpoint(tmp / "ckpt") == str(tmp / "ckpt" / "step_4")


def test_manifest_records_each_piece_once(world2):
    tmp, _, ref = world2
    step = tmp / "ckpt" / "step_3"
    m = snapsvc.read_manifest(step)
    assert m.sharded["params"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert m.sharded["optimizer"]["class"] == "Adam"
    pieces = {(rf.rank, e["name"]): e for rf in m.ranks for e in rf.entries}
    w0, w1 = pieces[0, "0.weight"], pieces[1, "0.weight"]
    for e in (w0, w1):
        assert e["shape"] == [16, 8] and e["dtype"] == "float32" and e["mesh"] == [2]
        assert e["placements"] == ["S0"] and e["lengths"] == [8, 8] and e["kind"] == "param"
    assert (w0["offsets"], w1["offsets"]) == ([0, 0], [8, 0])
    assert pieces[1, "0.weight:exp_avg"]["offsets"] == [8, 0]
    # Adam's step counters are plain tensors on every rank: written by rank 0 only.
    assert (0, "0.weight:step") in pieces and (1, "0.weight:step") not in pieces
    # The offsets and CRCs point at the right bytes of the rank files.
    data = (step / "rank1.fdl").read_bytes()
    rows = torch.frombuffer(bytearray(data[w1["data"]:w1["end"]]), dtype=torch.float32)
    assert torch.equal(rows.view(8, 8), ref["saved"]["0.weight"][8:])
    meta = read_meta(step / "rank1.fdl")   # the rank's .meta has them too
    assert [r["name"] for r in meta.extra[SHARDS_KEY]] == [e["name"] for e in m.ranks[1].entries]
    tp = snapsvc.read_manifest(tmp / "ckpt" / "step_4")
    tp_pieces = {(rf.rank, e["name"]): e for rf in tp.ranks for e in rf.entries}
    assert tp_pieces[1, "weight"]["placements"] == ["R", "S1"]
    assert tp_pieces[1, "weight"]["mesh"] == [1, 2] and tp_pieces[1, "weight"]["offsets"] == [0, 3]
    assert (0, "bias") in tp_pieces and (1, "bias") not in tp_pieces   # Replicate(): once


def test_reshard_to_world_size_3_corruption_and_rank_killed(world2, tmp_path):
    src, _, _ = world2
    corrupt = tmp_path / "corrupt"
    shutil.copytree(src / "ckpt" / "step_3", corrupt)
    entry = next(e for e in snapsvc.read_manifest(corrupt).ranks[1].entries
                 if e["name"] == "0.weight")
    with open(corrupt / "rank1.fdl", "r+b") as f:   # rows 8..15: ranks 1 and 2 need them
        f.seek(entry["data"] + 4)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    codes, results = run_world(tmp_path, 3, scenario_reshard, src=str(src),
                               corrupt=str(corrupt))
    assert codes == [0, 0, -signal.SIGKILL]
    for rank, res in enumerate(results):
        assert res["restored_diff"] == [], (rank, res["restored_diff"])
        assert res["dcp_diff"] == [], (rank, res["dcp_diff"])
        assert res["tp_diff"] == [], (rank, res["tp_diff"])
    # Rank 0's rows (0..5) lie in rank0.fdl only: it never reads the damaged file.
    assert results[0]["corrupt"] == "restored"
    for res in results[1:]:
        assert res["corrupt_untouched"]   # checked before anything changed
        assert res["corrupt"].startswith("FormatError") and "CRC-32" in res["corrupt"]
        assert "rank1.fdl" in res["corrupt"] and "'0.weight'" in res["corrupt"]
    for res in results[:2]:
        assert not res["killed_save"]["ok"] and res["killed_save"]["timed_out"]
    assert not (tmp_path / "ckpt" / "step_10" / MANIFEST_NAME).exists()
    assert snapsvc.latest_checkpoint(tmp_path / "ckpt") is None


def test_plain_model_at_world_size_1(world2):
    tmp, _, ref = world2
    model = make_plain(9)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    report = snapsvc.restore_distributed(tmp / "ckpt" / "step_3", model, opt)
    assert report.extra == {"rank": 0} and report.missing == []
    assert diff(full_state(model, opt), ref["saved"]) == []
    tp = nn.Linear(6, 5)
    snapsvc.restore_distributed(tmp / "ckpt" / "step_4", tp)
    assert diff(full_state(tp), ref["tp"]) == []
    with pytest.raises(snapsvc.ShapeMismatchError, match="0.weight"):
        snapsvc.restore_distributed(tmp / "ckpt" / "step_3",
                                    nn.Sequential(nn.Linear(8, 15), nn.ReLU(), nn.Linear(15, 4)))
    with pytest.raises(snapsvc.StrictLoadError):
        snapsvc.restore_distributed(tmp / "ckpt" / "step_3", nn.Sequential(nn.Linear(8, 16)),
                                    strict=True)


def test_consolidate_and_cli(world2, tmp_path):
    from snapsvc.cli import main
    tmp, _, ref = world2
    dst = tmp_path / "full.fdl"
    assert snapsvc.distributed.consolidate(tmp / "ckpt" / "step_3", dst) == str(dst)
    assert snapsvc.verify(dst).ok, str(snapsvc.verify(dst))
    ckpt = snapsvc.read_checkpoint(dst)
    assert list(ckpt.entries) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert all(torch.equal(t, ref["saved"][n]) for n, t in ckpt.entries.items())
    model = make_plain(9)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    report = snapsvc.restore(dst, model, opt)   # a plain model and optimizer take it
    assert report.epoch == 3 and report.extra == {"rank": 0}
    assert diff(full_state(model, opt), ref["saved"]) == []
    assert snapsvc.structural_hash(model) == ckpt.structural_hash
    out = tmp_path / "cli.fdl"
    assert main(["consolidate", str(tmp / "ckpt" / "step_3"), str(out)]) == 0
    assert out.read_bytes() == dst.read_bytes()
    assert main(["consolidate", str(tmp_path / "nowhere"), str(tmp_path / "x.fdl")]) == 1
    assert not (tmp_path / "x.fdl").exists()


def test_damaged_manifest_or_file_is_refused_before_loading(world2, tmp_path):
    import msgpack
    src, _, _ = world2
    step = tmp_path / "step_3"
    shutil.copytree(src / "ckpt" / "step_3", step)
    raw = msgpack.unpackb((step / MANIFEST_NAME).read_bytes())
    raw["ranks"][1]["entries"] = [e for e in raw["ranks"][1]["entries"] if e["name"] != "0.bias"]
    (step / MANIFEST_NAME).write_bytes(msgpack.packb(raw))
    model = make_plain(9)
    before = local_state(model)
    with pytest.raises(snapsvc.FormatError, match="cover 8 of the 16 elements") as ei:
        snapsvc.restore_distributed(step, model)
    assert ei.value.entry == "0.bias"
    raw["ranks"][1]["entries"][0]["offsets"] = [12, 0]   # 8 rows from row 12 of 16
    (step / MANIFEST_NAME).write_bytes(msgpack.packb(raw))
    with pytest.raises(snapsvc.FormatError, match="does not fit"):
        snapsvc.restore_distributed(step, model)
    shutil.copy(src / "ckpt" / "step_3" / MANIFEST_NAME, step / MANIFEST_NAME)
    with open(step / "rank1.fdl", "r+b") as f:
        f.truncate(os.path.getsize(step / "rank1.fdl") - 1)
    with pytest.raises(snapsvc.FormatError, match="bytes, the manifest says"):
        snapsvc.restore_distributed(step, model)
    assert diff(local_state(model), before) == []
    with pytest.raises(ValueError, match="not saved from a sharded model"):
        _consolidate_plain(tmp_path)


def _consolidate_plain(tmp_path) -> None:
    """consolidate() of a checkpoint of plain tensors (a manifest without ``sharded``)."""
    from snapsvc.distributed.manifest import Manifest, RankFile, _write_manifest
    step = tmp_path / "plain" / "step_1"
    step.mkdir(parents=True)
    snapsvc.save_checkpoint(step / "rank0.fdl", make_plain(0))
    _write_manifest(str(step), Manifest(step=1, world_size=1,
                                        ranks=[RankFile(0, "rank0.fdl", 0, 0)]))
    snapsvc.distributed.consolidate(step, tmp_path / "plain.fdl")

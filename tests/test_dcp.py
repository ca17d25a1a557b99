"""snapsvc as a DCP backend (issue 33): dcp.save/dcp.load through SnapsvcStorageWriter/Reader,
with DCP's FileSystemWriter/Reader as the control in the same world."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import snapsvc
from snapsvc.dcp import SnapsvcStorageReader, SnapsvcStorageWriter
from dist_world import run_world

pytestmark = [pytest.mark.timeout(150)]
pytest_plugins = ["remote_fixtures"]  # s3

FULL_W = torch.arange(64, dtype=torch.float32).reshape(8, 8) / 7.0


def make_state(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    return {"w": distribute_tensor(FULL_W.clone(), mesh, [Shard(0)]),
            "b": torch.arange(5, dtype=torch.bfloat16),
            "meta": {"epoch": 3, "name": "run"}}


def zeroed(sd: dict) -> dict:
    out = {}
    for k, v in sd.items():
        if k == "p":
            continue
        if isinstance(v, torch.Tensor):
            z = v.detach().clone()
            (z.to_local() if hasattr(z, "to_local") else z).zero_()
            out[k] = z
        else:
            out[k] = {"epoch": 0, "name": ""}
    if "p" in sd:
        out["p"] = torch.zeros(4)
    return out


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def scenario_round_trip(rank: int, world: int, tmp: str) -> dict:
    sd = make_state(rank, world)
    p = torch.nn.Parameter(torch.arange(4, dtype=torch.float32))
    opt = torch.optim.SGD([p], lr=1.0)
    sd["p"] = p
    w = SnapsvcStorageWriter(os.path.join(tmp, "snap", "step_1"), coord_timeout=30)
    out = {}
    try:
        dcp.save(sd, storage_writer=w)
        pid = w._writer.writer.pid
        # a second save through the same writer: the sidecar is kept
        with torch.no_grad():
            local(sd["w"]).add_(1.0)
        dcp.save(sd, checkpoint_id=os.path.join(tmp, "snap", "step_2"), storage_writer=w)
        staged = {"w": local(sd["w"]).clone(), "p": p.detach().clone()}   # step_2's values
        # dcp.async_save with the writer as its stager, THREAD then PROCESS: the training
        # step right after async_save returns (an optimizer step, a DTensor update) never
        # reaches the file
        for step, mode in ((3, AsyncCheckpointerType.THREAD), (4, AsyncCheckpointerType.PROCESS)):
            fut = dcp.async_save(sd, checkpoint_id=os.path.join(tmp, "snap", f"step_{step}"),
                                 storage_writer=w, async_checkpointer_type=mode)
            p.grad = torch.ones(4)
            opt.step()
            with torch.no_grad():
                local(sd["w"]).add_(100.0)
            fut.result(timeout=90)
            with torch.no_grad():   # back to the staged values for the next save
                local(sd["w"]).copy_(staged["w"])
                p.copy_(staged["p"])
        out["same_sidecar"] = pid is not None and w._writer.writer.pid == pid
        out["held_after"] = len(w._held)
        # what PROCESS mode pickles: tickets and DCP's write items, no tensor bytes
        big = {"x": torch.zeros(1 << 16)}
        out["pickled_small"] = len(pickle.dumps(w.stage(big))) < 2048
    finally:
        w.close()
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(os.path.join(tmp, "fs")))
    for step in (3, 4):
        got = zeroed(sd)
        dcp.load(got, storage_reader=SnapsvcStorageReader(
            os.path.join(tmp, "snap", f"step_{step}")))
        out[f"async{step}"] = (torch.equal(local(got["w"]), staged["w"])
                               and torch.equal(got["p"], staged["p"]))
    got_snap, got_fs = zeroed(sd), zeroed(sd)
    dcp.load(got_snap, storage_reader=SnapsvcStorageReader(os.path.join(tmp, "snap", "step_2")))
    dcp.load(got_fs, storage_reader=dcp.FileSystemReader(os.path.join(tmp, "fs")))
    for name, got in (("snap", got_snap), ("fs", got_fs)):
        out[name] = (torch.equal(local(got["w"]), local(sd["w"])) and torch.equal(got["p"], p)
                     and torch.equal(got["b"], sd["b"]) and got["meta"] == sd["meta"])
    return out


def scenario_killed(rank: int, world: int, tmp: str) -> dict:
    sd = make_state(rank, world)

    class Dying(SnapsvcStorageWriter):
        def write_data(self, plan, planner):
            if rank == 1 and self.path.endswith("step_2"):
                os.kill(os.getpid(), signal.SIGKILL)
            return super().write_data(plan, planner)

    w = Dying(os.path.join(tmp, "snap", "step_1"), coord_timeout=20)
    try:
        dcp.save(sd, storage_writer=w)
        with torch.no_grad():
            local(sd["w"]).add_(1.0)
        dcp.async_save(sd, storage_writer=w, checkpoint_id=os.path.join(tmp, "snap", "step_2")
                       ).result(timeout=60)
        return {"saved": True}
    except BaseException as e:
        return {"saved": False, "error": type(e).__name__}
    finally:
        try:
            w.close()
        except BaseException:
            pass


def scenario_load_latest(rank: int, world: int, tmp: str, root: str) -> dict:
    """Each rank of another world size loads ``latest_checkpoint(root)`` through
    SnapsvcStorageReader into its own shards (DCP's planner reshards)."""
    sd = zeroed(make_state(rank, world))
    path = snapsvc.latest_checkpoint(root)
    dcp.load(sd, storage_reader=SnapsvcStorageReader(path))
    want = make_state(rank, world)
    return {"path": path, "same": torch.equal(local(sd["w"]), local(want["w"]))
            and torch.equal(sd["b"], want["b"]) and sd["meta"] == want["meta"]}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dcp")
    codes, results = run_world(tmp, 2, scenario_round_trip)
    return tmp, codes, results


@pytest.mark.timeout(150)
def test_round_trip_bit_exact_beside_filesystem_writer(saved):
    tmp, codes, results = saved
    assert codes == [0, 0], results
    for res in results:
        assert res == {"same_sidecar": True, "held_after": 0, "pickled_small": True, "async3": True, "async4": True,
                       "snap": True, "fs": True}, res
    step = tmp / "snap" / "step_2"
    assert {".metadata", "manifest.msgpack", "rank0.fdl", "rank0.fdl.meta", "rank1.fdl",
            "rank1.fdl.meta"} <= set(os.listdir(step))
    assert snapsvc.read_manifest(str(step)).world_size == 2
    assert snapsvc.verify(str(step / "rank0.fdl")).ok


@pytest.mark.timeout(150)
def test_reshard_2_to_1(saved):
    tmp, _, _ = saved
    sd = {"w": torch.zeros(8, 8), "b": torch.zeros(5, dtype=torch.bfloat16),
          "meta": {"epoch": 0, "name": ""}, "p": torch.zeros(4)}
    dcp.load(sd, storage_reader=SnapsvcStorageReader(tmp / "snap" / "step_1"), no_dist=True)
    assert torch.equal(sd["w"], FULL_W)
    assert torch.equal(sd["b"], torch.arange(5, dtype=torch.bfloat16))
    assert sd["meta"] == {"epoch": 3, "name": "run"}


@pytest.mark.timeout(150)
def test_flipped_byte_is_format_error_state_unchanged(saved, tmp_path):
    tmp, _, _ = saved
    step = tmp_path / "step_1"
    shutil.copytree(tmp / "snap" / "step_1", step)
    data = bytearray((step / "rank1.fdl").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (step / "rank1.fdl").write_bytes(bytes(data))
    sd = {"w": torch.full((8, 8), 7.0), "b": torch.zeros(5, dtype=torch.bfloat16),
          "meta": {"epoch": 0, "name": ""}}
    before = {k: (v.clone() if isinstance(v, torch.Tensor) else dict(v)) for k, v in sd.items()}
    # DCP wraps every rank's error in its CheckpointException; the rank's error is a FormatError
    with pytest.raises(CheckpointException) as info:
        dcp.load(sd, storage_reader=SnapsvcStorageReader(step), no_dist=True)
    failure = info.value.failures[0][0]
    assert isinstance(failure, snapsvc.FormatError) and "rank1.fdl" in str(failure), failure
    assert torch.equal(sd["w"], before["w"]) and torch.equal(sd["b"], before["b"])
    assert sd["meta"] == before["meta"]


@pytest.mark.timeout(150)
def test_default_reader_names_snapsvc_reader(saved):
    tmp, _, _ = saved
    sd = {"w": torch.zeros(8, 8)}
    with pytest.raises(CheckpointException, match="SnapsvcStorageReader"):
        dcp.load(sd, storage_reader=dcp.FileSystemReader(tmp / "snap" / "step_1"), no_dist=True)


@pytest.mark.timeout(240)
def test_rank_killed_mid_save_writes_no_metadata_and_the_previous_step_loads(tmp_path):
    codes, results = run_world(tmp_path, 2, scenario_killed, run_s=90)
    assert codes[1] == -signal.SIGKILL
    assert results[0]["saved"] is False, results[0]
    snap = tmp_path / "snap"
    assert not (snap / "step_2" / ".metadata").exists()
    assert not (snap / "step_2" / "manifest.msgpack").exists()
    assert snapsvc.latest_checkpoint(snap) == str(snap / "step_1")
    sd = {"w": torch.zeros(8, 8)}
    dcp.load(sd, storage_reader=SnapsvcStorageReader(snapsvc.latest_checkpoint(snap)),
             no_dist=True)
    assert torch.equal(sd["w"], FULL_W)
    # resharded to world 3 (uneven shards of 3, 3, 2 rows): each rank finds the same
    # previous step and loads its own shard of it
    (tmp_path / "world3").mkdir()   # a rendezvous file of its own
    codes, results = run_world(tmp_path / "world3", 3, scenario_load_latest, run_s=90,
                               root=str(snap))
    assert codes == [0, 0, 0], results
    assert results == [{"path": str(snap / "step_1"), "same": True}] * 3, results


def _truncate(step):
    f = step / "rank1.fdl"
    f.write_bytes(f.read_bytes()[:-9])


def _flip_metadata(step):
    f = step / "rank0.fdl.meta"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10
    f.write_bytes(bytes(data))


DAMAGE = {
    "truncated rank file": _truncate,
    "flipped rank metadata": _flip_metadata,
    "missing rank file": lambda step: os.remove(step / "rank1.fdl"),
    "missing rank metadata": lambda step: os.remove(step / "rank0.fdl.meta"),
    "missing manifest": lambda step: os.remove(step / "manifest.msgpack"),
    "another step's .metadata": lambda step: shutil.copy(step.parent.parent / "snap" / "step_2"
                                                         / ".metadata", step / ".metadata"),
}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_step_is_format_error_and_nothing_changes(saved, tmp_path, damage):
    tmp, _, _ = saved
    step = tmp_path / "snap" / "step_1"
    shutil.copytree(tmp / "snap", tmp_path / "snap")
    DAMAGE[damage](step)
    sd = {"w": torch.full((8, 8), 7.0), "b": torch.ones(5, dtype=torch.bfloat16),
          "meta": {"epoch": 0, "name": ""}}
    with pytest.raises(CheckpointException) as info:
        dcp.load(sd, storage_reader=SnapsvcStorageReader(step), no_dist=True)
    failure = info.value.failures[0][0]
    assert isinstance(failure, snapsvc.FormatError), repr(failure)
    assert torch.equal(sd["w"], torch.full((8, 8), 7.0))
    assert torch.equal(sd["b"], torch.ones(5, dtype=torch.bfloat16))
    assert sd["meta"] == {"epoch": 0, "name": ""}


@pytest.mark.timeout(150)
def test_reads_only_the_pieces_asked_for_each_crc_checked(saved, tmp_path):
    """A byte flipped inside rank 0's piece of "w": loading "b" alone reads only b's byte
    range (it loads); loading "w" reads the damaged piece: FormatError, nothing changed."""
    tmp, _, _ = saved
    step = tmp_path / "step_1"
    shutil.copytree(tmp / "snap" / "step_1", step)
    piece = next(e for e in snapsvc.read_manifest(str(step)).ranks[0].entries
                 if e["name"] == "w")
    data = bytearray((step / "rank0.fdl").read_bytes())
    data[(piece["data"] + piece["end"]) // 2] ^= 0x01
    (step / "rank0.fdl").write_bytes(bytes(data))
    only_b = {"b": torch.zeros(5, dtype=torch.bfloat16)}
    dcp.load(only_b, storage_reader=SnapsvcStorageReader(step), no_dist=True)
    assert torch.equal(only_b["b"], torch.arange(5, dtype=torch.bfloat16))
    sd = {"w": torch.full((8, 8), 7.0), "b": torch.zeros(5, dtype=torch.bfloat16)}
    with pytest.raises(CheckpointException) as info:
        dcp.load(sd, storage_reader=SnapsvcStorageReader(step), no_dist=True)
    failure = info.value.failures[0][0]
    assert isinstance(failure, snapsvc.FormatError) and "CRC-32" in str(failure), failure
    assert torch.equal(sd["w"], torch.full((8, 8), 7.0))
    assert torch.equal(sd["b"], torch.zeros(5, dtype=torch.bfloat16))



@pytest.mark.timeout(120)
def test_remote_tier_then_load_from_the_url_after_the_local_directory_is_gone(s3, world1,
                                                                              tmp_path):
    sd = {"w": torch.randn(6, 4), "opt": {"step": 3, "lr": [0.1, 0.01]}}
    assert SnapsvcStorageWriter.validate_checkpoint_id(f"{s3.url}/step_2")
    assert SnapsvcStorageReader.validate_checkpoint_id(f"{s3.url}/step_2")
    w = SnapsvcStorageWriter(tmp_path / "ckpt" / "step_1", remote=s3.url, wait_upload=True,
                             coord_timeout=60)
    try:
        dcp.save(sd, storage_writer=w)
        # a step URL of the remote tier as checkpoint_id: saved locally, resolved once uploaded
        dcp.async_save(sd, checkpoint_id=f"{s3.url}/step_2", storage_writer=w).result(timeout=90)
    finally:
        w.close()
    keys = s3.keys()
    assert {"step_1/manifest.msgpack", "step_2/manifest.msgpack", "step_2/rank0.fdl"} <= set(keys)
    with pytest.raises(ValueError, match="remote tier"):
        SnapsvcStorageWriter(tmp_path / "ckpt" / "step_1").reset("s3://elsewhere/run/step_3")
    shutil.rmtree(tmp_path / "ckpt")
    got = {"w": torch.zeros(6, 4), "opt": {"step": 0, "lr": []}}
    dcp.load(got, storage_reader=SnapsvcStorageReader(f"{s3.url}/step_2"))
    assert torch.equal(got["w"], sd["w"]) and got["opt"] == sd["opt"]


@pytest.mark.timeout(150)
def test_snapsvc_tools_read_a_dcp_written_step(saved, tmp_path, capsys):
    """verify, inspect, ls, consolidate and restore_distributed on step_2 of the 2-rank
    DCP save (w a DTensor sharded by rows over the two ranks)."""
    from snapsvc.cli import main
    tmp, _, _ = saved
    step = tmp / "snap" / "step_2"
    want_w = FULL_W + 1.0
    assert main(["verify", str(step)]) == 0
    out = capsys.readouterr().out
    assert "manifest.msgpack" in out and "rank0.fdl" in out and "rank1.fdl" in out
    assert main(["inspect", str(step / "rank1.fdl")]) == 0
    assert "w" in capsys.readouterr().out
    assert main(["ls", str(tmp / "snap"), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["checkpoints"]
    assert sorted(c["step"] for c in listed) == [1, 2, 3, 4]
    assert main(["consolidate", str(step), str(tmp_path / "whole.fdl")]) == 0
    whole = snapsvc.read_checkpoint(tmp_path / "whole.fdl").entries
    assert torch.equal(whole["w"], want_w) and torch.equal(whole["p"], torch.arange(4.0))
    target = {"w": torch.zeros(8, 8), "b": torch.zeros(5, dtype=torch.bfloat16),
              "meta": {"epoch": 0, "name": ""}, "p": torch.zeros(4)}
    report = snapsvc.restore_distributed(str(step), target)
    # tensors in place; plain values in the report, as snapsvc.restore gives them
    assert torch.equal(target["w"], want_w) and report.state["meta"] == {"epoch": 3,
                                                                         "name": "run"}
    assert torch.equal(target["b"], torch.arange(5, dtype=torch.bfloat16))


@pytest.mark.timeout(120)
def test_reader_reads_a_distributed_snapshot_writer_state_and_names_what_it_cannot(world1,
                                                                                   tmp_path):
    mesh = init_device_mesh("cpu", (1,))
    w = distribute_tensor(FULL_W.clone(), mesh, [Shard(0)])
    model = torch.nn.Linear(2, 2)
    with snapsvc.DistributedSnapshotWriter(tmp_path / "ckpt", coord_timeout=60) as writer:
        writer.submit({"w": w, "n": {"k": [1, 2]}}, 1).result(timeout=60)
        writer.submit({"w": w, "model": model}, 2).result(timeout=60)
    got = {"w": distribute_tensor(torch.zeros(8, 8), mesh, [Shard(0)]), "n": {"k": []}}
    dcp.load(got, storage_reader=SnapsvcStorageReader(tmp_path / "ckpt" / "step_1"))
    assert torch.equal(got["w"].to_local(), FULL_W) and got["n"] == {"k": [1, 2]}
    before = got["w"].to_local().clone()
    with pytest.raises(CheckpointException, match="restore_distributed"):
        dcp.load(got, storage_reader=SnapsvcStorageReader(tmp_path / "ckpt" / "step_2"))
    assert torch.equal(got["w"].to_local(), before)
    # what snapsvc 0.5.0's SnapsvcStorageWriter wrote: a flat state with its metadata entry
    with snapsvc.DistributedSnapshotWriter(tmp_path / "old", coord_timeout=60) as writer:
        writer.submit({"w@0,0": FULL_W.clone(), "snapsvc.dcp": {"version": 1, "items": {}}},
                      7).result(timeout=60)
    with pytest.raises(CheckpointException, match="0.5.0"):
        dcp.load(got, storage_reader=SnapsvcStorageReader(tmp_path / "old" / "step_7"))
    assert torch.equal(got["w"].to_local(), before)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("change", ["shape", "dtype", "requires_grad", "name"])
def test_kept_write_items_follow_every_change_dcp_would_plan(world1, tmp_path, change):
    """stage() keeps a tensor's write items between stages only while its key, class,
    shape, dtype and requires_grad hold: each change gives DCP's items for the new tensor."""
    from torch.distributed.checkpoint.planner_helpers import _create_write_items
    w = SnapsvcStorageWriter(tmp_path / "step_1", coord_timeout=60, slots=3)  # 3 held
    try:
        t = torch.zeros(4, 3)
        first = w.stage({"m": {"t": t}})["m.t"]
        assert w.stage({"m": {"t": t}})["m.t"].items is first.items   # kept
        new = {"shape": torch.zeros(5, 3), "dtype": torch.zeros(4, 3, dtype=torch.float64),
               "requires_grad": torch.zeros(4, 3, requires_grad=True), "name": t}[change]
        key = "u" if change == "name" else "t"
        staged = w.stage({"m": {key: new}})[f"m.{key}"]
    finally:
        w.close()
    assert staged.items is not first.items
    assert staged.__create_write_items__(f"m.{key}", None) == _create_write_items(f"m.{key}", new)


def _fsdp_model():
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _train(model, opt, seed):
    torch.manual_seed(seed)
    model(torch.randn(4, 6)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _titan_states(model, opt, step):
    """What torchtitan's checkpointer saves: the model's state flattened to the top level,
    the optimizer's (flattened), and a train state."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    return {**get_model_state_dict(model),
            "optimizer": get_optimizer_state_dict(
                model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True)),
            "train_state": {"step": step}}


def _locals(sd):
    return {k: (local(v).clone() if isinstance(v, torch.Tensor) else v)
            for k, v in _flat(sd).items()}


def _flat(sd):
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    return flatten_state_dict(sd)[0]


def scenario_torchtitan(rank: int, world: int, tmp: str) -> dict:
    """torchtitan's async_with_pinned_mem call sequence, through SnapsvcStorageWriter: a gloo
    group for the saves, async_save in PROCESS mode with the writer as async_stager, training
    resumes once staging is done, the next save first waits for the previous upload."""
    model, opt = _fsdp_model()
    pg = dist.new_group(backend="gloo")
    writer = SnapsvcStorageWriter(os.path.join(tmp, "titan", "step_0"), coord_timeout=60)
    saved, future = {}, None
    try:
        for step in (1, 2):
            _train(model, opt, step)
            if future is not None:
                future.result(timeout=90)          # torchtitan's _async_wait
            states = _titan_states(model, opt, step)
            future = dcp.async_save(states, storage_writer=writer, async_stager=writer,
                                    checkpoint_id=os.path.join(tmp, "titan", f"step_{step}"),
                                    process_group=pg,
                                    async_checkpointer_type=AsyncCheckpointerType.PROCESS)
            saved[step] = _locals(states)          # the values at stage()
            if step == 2:   # the control: DCP's own writer, the same state
                dcp.save(_titan_states(model, opt, step), process_group=pg,
                         storage_writer=dcp.FileSystemWriter(os.path.join(tmp, "fs")))
            _train(model, opt, 10 + step)          # the next optimizer step, mid-upload
        future.result(timeout=90)
    finally:
        writer.close()
    # resume at world 2 from each step: bit-exact with the values staged
    out = {}
    for step in (1, 2):
        fresh, fresh_opt = _fsdp_model()
        _train(fresh, fresh_opt, 99)               # optimizer state exists, other values
        states = _titan_states(fresh, fresh_opt, 0)
        dcp.load(states, storage_reader=SnapsvcStorageReader(
            os.path.join(tmp, "titan", f"step_{step}")))
        got = _locals(states)
        out[f"step{step}"] = got.keys() == saved[step].keys() and all(
            torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v
            for k, v in saved[step].items())
    dist.destroy_process_group(pg)
    return out


def scenario_load3(rank: int, world: int, tmp: str, root: str) -> dict:
    """World 3 (uneven shards): step_2 through SnapsvcStorageReader equals DCP's own
    FileSystemReader of the control, shard by shard."""
    out = {}
    for name, reader in (("snap", SnapsvcStorageReader(os.path.join(root, "titan", "step_2"))),
                         ("fs", dcp.FileSystemReader(os.path.join(root, "fs")))):
        model, opt = _fsdp_model()
        _train(model, opt, 99)
        states = _titan_states(model, opt, 0)
        dcp.load(states, storage_reader=reader)
        out[name] = _locals(states)
    same = out["snap"].keys() == out["fs"].keys() and all(
        torch.equal(v, out["fs"][k]) if isinstance(v, torch.Tensor) else v == out["fs"][k]
        for k, v in out["snap"].items() if k != "train_state.step")
    return {"same": same}


@pytest.mark.timeout(280)
def test_torchtitan_call_sequence_fsdp2_resumes_at_2_and_reshards_to_1_and_3(tmp_path):
    codes, results = run_world(tmp_path, 2, scenario_torchtitan, run_s=170)
    assert codes == [0, 0], results
    assert results == [{"step1": True, "step2": True}] * 2, results
    # resharded to 1 rank (full tensors): the same as DCP's own reader of the control
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    md = dcp.FileSystemReader(tmp_path / "fs").read_metadata()
    keys = {k: v for k, v in md.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)}
    ours, theirs = ({k: torch.full(tuple(v.size), 7.0, dtype=v.properties.dtype)
                     for k, v in keys.items()} for _ in range(2))
    dcp.load(ours, storage_reader=SnapsvcStorageReader(tmp_path / "titan" / "step_2"),
             no_dist=True)
    dcp.load(theirs, storage_reader=dcp.FileSystemReader(tmp_path / "fs"), no_dist=True)
    assert "0.weight" in ours and any(k.startswith("optimizer.state.") for k in ours)
    assert all(torch.equal(ours[k], theirs[k]) for k in keys)
    (tmp_path / "world3").mkdir()   # a rendezvous file of its own
    codes, results = run_world(tmp_path / "world3", 3, scenario_load3, run_s=90,
                               root=str(tmp_path))
    assert codes == [0, 0, 0] and results == [{"same": True}] * 3, results

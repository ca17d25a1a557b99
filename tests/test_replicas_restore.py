"""Issue 32, the restore side: a whole FSDP2 training state through peer replicas.

World 4 as 2 nodes x 2 ranks (``SNAPSVC_NODE``), FSDP2 Linear-ReLU-Linear,
AdamW, LambdaLR, the global RNG and a loader's state (tests/test_dist_state.py's
run), ``DistributedSnapshotWriter(replicas=1)``: replicas go A <-> B.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import signal

import pytest
import torch

import snapsvc
from dist_world import run_world, write_result

pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 needs torch.distributed")
from test_dist_state import LOADER, dcp_state, make_run, mismatches, observed, train  # noqa: E402
from test_replicas import LINGER_S, NODE_OF, _lose  # noqa: E402

pytest_plugins = ["remote_fixtures"]  # s3


def _fresh_world(tmp) -> None:
    for f in glob.glob(os.path.join(str(tmp), "result*.json")) + [os.path.join(str(tmp),
                                                                               "rendezvous")]:
        if os.path.exists(f):   # a new world: a fresh rendezvous
            os.unlink(f)


def _drop_replicas(d: str, steps, world: int) -> None:
    """A failed run must not leave replicas in the tmpfs (a clean close drops them)."""
    from snapsvc.distributed.replicas import held_by
    from snapsvc.files.ramtier import drop
    for n in steps:
        for holder in range(world):
            for ram in held_by(d, n, holder, world).values():
                drop(ram)


def _log_to(tmp: str, rank: int) -> str:
    path = os.path.join(tmp, f"log{rank}.txt")
    logging.basicConfig(level=logging.INFO, filename=path, force=True)
    return path


def _state(model, opt, sched, step: int) -> dict:
    return {"model": model, "optim": opt, "sched": sched, "rng": torch.get_rng_state(),
            "loader": {**LOADER, "batch": step}}


# -- item 1: node B lost, step 20 (memory-only) resumed from node A's RAM; DCP control ----
def scenario_fsdp_save(rank, world, tmp):
    import torch.distributed.checkpoint as dcp
    os.environ["SNAPSVC_NODE"] = NODE_OF[rank]
    d = os.path.join(tmp, "ckpt")
    torch.manual_seed(1234)   # every rank draws the same inputs
    model, opt, sched = make_run(0)
    w = snapsvc.DistributedSnapshotWriter(d, replicas=1, linger=LINGER_S,
                                          coord_timeout=30).start()
    train(model, opt, sched, 2)
    h10 = w.submit(_state(model, opt, sched, 10), 10)   # persisted
    train(model, opt, sched, 2)
    h20 = w.submit(_state(model, opt, sched, 20), 20, persist=False)
    # the control: the same state, DCP's async_save (the scheduler as a Stateful)
    dcp.async_save(dcp_state(model, opt, sched),
                   checkpoint_id=os.path.join(tmp, "dcp20")).result(timeout=60)
    for h in (h10, h20):
        h.result(30)
        h.replicated(timeout=30)
    at_save = observed(model, opt, sched)   # collectives: full tensors
    train(model, opt, sched, 1)             # the uninterrupted run, one step on
    want = observed(model, opt, sched)
    if rank == 0:
        torch.save({"at_save": at_save, "want": want}, os.path.join(tmp, "expect.pt"))
    torch.distributed.barrier()
    if NODE_OF[rank] == "B":   # node B is lost: sidecars, RAM copies, replicas held, files
        _lose(w, d, rank, world, (10, 20), disk_too=(10, 20))
    write_result(tmp, rank, {"manifest20": os.path.basename(h20.result(1).manifest)})
    os.kill(os.getpid(), signal.SIGKILL)   # every trainer dies (the job restarts)


def scenario_fsdp_resume(rank, world, tmp):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    os.environ["SNAPSVC_NODE"] = NODE_OF[rank]
    log = _log_to(tmp, rank)
    d = os.path.join(tmp, "ckpt")
    torch.manual_seed(99)   # fresh objects, another seed and RNG
    model, opt, sched = make_run(7)
    expect = torch.load(os.path.join(tmp, "expect.pt"))
    out: dict = {}
    with snapsvc.DistributedSnapshotWriter(d, replicas=1, linger=LINGER_S,
                                           coord_timeout=30) as w:
        out["attached"] = w.writer.attached is not None
        path = snapsvc.latest_checkpoint(d)
        r = snapsvc.restore_distributed(path, {"model": model, "optim": opt, "sched": sched})
    out["path"], out["loader"] = os.path.basename(path), r.state["loader"]
    rng = r.state["rng"]
    out["at_restore"] = mismatches(expect["at_save"], observed(model, opt, sched))
    # the control: DCP's copy of the same step, into other fresh objects
    model3, opt3, sched3 = make_run(7)
    saved = dcp_state(model3, opt3, sched3)
    dcp.load(saved, checkpoint_id=os.path.join(tmp, "dcp20"))
    set_state_dict(model3, opt3, model_state_dict=saved["model"],
                   optim_state_dict=saved["optim"])
    out["dcp_at_restore"] = mismatches(expect["at_save"], observed(model3, opt3, sched3))
    out["same_rng"] = torch.equal(rng, saved["rng"])
    torch.set_rng_state(rng)
    train(model, opt, sched, 1)
    torch.set_rng_state(saved["rng"])
    train(model3, opt3, sched3, 1)
    ours, theirs = observed(model, opt, sched), observed(model3, opt3, sched3)
    out["resumed"] = mismatches(expect["want"], ours)
    out["dcp_resumed"] = mismatches(expect["want"], theirs)
    out["each_other"] = mismatches(ours, theirs)
    with open(log) as f:
        out["log"] = f.read()
    return out


# -- item 2: the same step at world 2, straight from node A's RAM (own copies, replicas) --
def scenario_reshard_from_ram(rank, world, tmp):
    """Node A alone (ranks 0, 1), no writer: rank r's own RAM copy (its sidecar lingers)
    and its replica of rank r + 2's file are the whole step; DCP's files the control."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    os.environ["SNAPSVC_NODE"] = NODE_OF[rank]
    log = _log_to(tmp, rank)
    d = os.path.join(tmp, "ckpt")
    torch.manual_seed(99)
    model, opt, sched = make_run(7)
    expect = torch.load(os.path.join(tmp, "expect.pt"))
    path = snapsvc.latest_checkpoint(d)
    r = snapsvc.restore_distributed(path, {"model": model, "optim": opt, "sched": sched})
    out = {"path": os.path.basename(path), "loader": r.state["loader"],
           "at_restore": mismatches(expect["at_save"], observed(model, opt, sched))}
    model3, opt3, sched3 = make_run(7)   # the control: DCP resharding its files
    saved = dcp_state(model3, opt3, sched3)
    dcp.load(saved, checkpoint_id=os.path.join(tmp, "dcp20"))
    set_state_dict(model3, opt3, model_state_dict=saved["model"],
                   optim_state_dict=saved["optim"])
    out["dcp_at_restore"] = mismatches(expect["at_save"], observed(model3, opt3, sched3))
    torch.set_rng_state(r.state["rng"])
    train(model, opt, sched, 1)
    torch.set_rng_state(saved["rng"])
    train(model3, opt3, sched3, 1)
    out["each_other"] = mismatches(observed(model, opt, sched), observed(model3, opt3, sched3))
    with open(log) as f:
        out["log"] = f.read()
    return out


@pytest.mark.slow   # three worlds (4, 2, 4 ranks) of FSDP2: ~26 s on a loaded 2-core box
@pytest.mark.timeout(400)
def test_fsdp_state_node_lost_resumes_from_peer_ram_like_dcp(tmp_path):
    """Steps 10 (persisted) and 20 (memory-only) of a whole FSDP2 training state; node B
    (ranks 2, 3) is lost: its trainers and sidecars SIGKILLed, its RAM copies and the
    replicas it held dropped, its files deleted. New node-B processes on the same ids and
    node A's new trainers resume step 20 bit-exactly (parameters, both AdamW moments,
    LambdaLR's lrs and last_epoch, RNG, loader), node B's files from node A's RAM, as DCP's
    async_save of the same step does; one more step matches the uninterrupted run.
    Before that, node A alone (world 2) restores step 20 resharded, straight from its RAM
    (own copies and the replicas of node B's files), bit-exactly, as DCP's files do."""
    d = str(tmp_path / "ckpt")
    try:
        codes, results = run_world(tmp_path, 4, scenario_fsdp_save, run_s=150,
                                   check_shm=False)
        assert codes == [-signal.SIGKILL] * 4, codes
        assert {r["manifest20"] for r in results} == {"manifest.ram.msgpack"}
        assert not glob.glob(os.path.join(d, "step_*", "rank[23].*"))   # node B's files gone
        _fresh_world(tmp_path)
        codes, resharded = run_world(tmp_path, 2, scenario_reshard_from_ram, run_s=120,
                                     check_shm=False)
        assert codes == [0] * 2, codes
        _fresh_world(tmp_path)
        codes, results = run_world(tmp_path, 4, scenario_fsdp_resume, run_s=150)
        assert codes == [0] * 4, codes
    finally:
        _drop_replicas(d, (10, 20), 4)
    assert [r["attached"] for r in results] == [True, True, False, False]
    for r, res in enumerate(results):
        assert res["path"] == "step_20", r
        assert res["loader"] == {**LOADER, "batch": 20}
        assert res["same_rng"], r
        for key in ("at_restore", "dcp_at_restore", "resumed", "dcp_resumed", "each_other"):
            assert res[key] == [], (r, key, res[key])
    # node B's files came from node A's RAM (the replicas), node A's from its own
    log0, log1, log2 = (results[r]["log"] for r in (0, 1, 2))
    assert "step 20: rank 2's file from rank 0's replica RAM" in log0
    assert "step 20: rank 3's file from rank 1's replica RAM" in log1
    assert "step 20: rank 0's file from rank 0's own RAM" in log0
    assert "step 20: rank 2's file from rank 0's RAM, over the gloo group" in log2
    assert "from disk" not in log0 + log2
    # item 2: at world 2, bit-exactly, from RAM only: own copies and replicas
    for r, res in enumerate(resharded):
        assert res["path"] == "step_20" and res["loader"] == {**LOADER, "batch": 20}
        for key in ("at_restore", "dcp_at_restore", "each_other"):
            assert res[key] == [], (r, key, res[key])
    for r, res in enumerate(resharded):
        for origin, source in ((0, "rank 0's own RAM"), (1, "rank 1's own RAM"),
                               (2, "rank 0's replica RAM"), (3, "rank 1's replica RAM")):
            held_here = source.startswith(f"rank {r}'")
            line = (f"step 20: rank {origin}'s file from {source}" if held_here else
                    f"step 20: rank {origin}'s file from rank {1 - r}'s RAM, over the gloo group")
            assert line in res["log"], (r, line, res["log"])
        assert "from disk" not in res["log"]


# -- item 3: the remote tier, the last of the four sources ---------------------------------
TWO_NODES = {0: "A", 1: "B"}


def scenario_remote_save(rank, world, tmp, remote):
    from test_replicas import _train, _trainer
    os.environ["SNAPSVC_NODE"] = TWO_NODES[rank]
    d = os.path.join(tmp, "ckpt")
    model, opt = _trainer(rank, 1)
    w = snapsvc.DistributedSnapshotWriter(d, replicas=1, linger=LINGER_S, remote=remote,
                                          keep_in_memory=4, coord_timeout=30).start()
    handles = {}
    for step in (5, 10, 15, 20):   # 15 memory-only; the others persisted and uploaded
        handles[step] = w.submit(model, step, optimizer=opt, persist=step != 15)
        torch.save(model.state_dict(), os.path.join(tmp, f"expect{step}_{rank}.pt"))
        _train(model, opt)
    urls = [handles[n].uploaded(timeout=60) for n in (5, 10, 20)]
    for h in handles.values():
        h.replicated(timeout=30)
    if TWO_NODES[rank] == "B":   # node B is lost: its sidecar, RAM copies, replicas held
        _lose(w, d, rank, world, (5, 10, 15, 20), disk_too=(5, 10, 20))
    write_result(tmp, rank, {"urls": urls})
    os.kill(os.getpid(), signal.SIGKILL)


def unreachable_listing(d: str, remote: str, closed: bool) -> list:
    """latest_checkpoint(remote=) where this rank's endpoint is a closed loopback port
    (``closed``): the error's type and message, and the seconds it took."""
    import socket
    import time
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    if closed:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{s.getsockname()[1]}"
    t0 = time.monotonic()
    try:
        snapsvc.latest_checkpoint(d, remote=remote, timeout=3)
        return ["no error", time.monotonic() - t0]
    except OSError as e:
        return [f"{type(e).__name__}: {e}", time.monotonic() - t0]
    finally:
        os.environ["AWS_ENDPOINT_URL"] = endpoint


def scenario_remote_resume(rank, world, tmp, remote):
    from test_replicas import _trainer
    os.environ["SNAPSVC_NODE"] = TWO_NODES[rank]
    log = _log_to(tmp, rank)
    d = os.path.join(tmp, "ckpt")
    model, opt = _trainer(rank, 2)
    out: dict = {}

    def attempt(step: int, **kw) -> str:
        try:
            snapsvc.restore_distributed(os.path.join(d, f"step_{step}"), model, opt, **kw)
        except snapsvc.SnapsvcError as e:
            return f"{type(e).__name__}: {e}"
        return "ok"

    def same(step: int) -> bool:
        want = torch.load(os.path.join(tmp, f"expect{step}_{rank}.pt"))
        return all(torch.equal(v, want[k]) for k, v in model.state_dict().items())

    with snapsvc.DistributedSnapshotWriter(d, replicas=1, linger=LINGER_S, remote=remote,
                                           keep_in_memory=4, coord_timeout=30) as w:
        out["attached"] = w.writer.attached is not None
        # step 15, memory-only, is complete in RAM (rank 1's file in rank 0's replica)
        # and newer than the remote tier's newest: every rank takes it
        out["latest"] = snapsvc.latest_checkpoint(d, remote=remote)
        # a step committed remotely between the ranks' listings: rank 0's listing has
        # step 20 (a mounted remote holding it), rank 1's not yet: one answer, no hang
        seen = os.path.join(tmp, "mounted20") if rank == 0 else None
        before = os.path.getsize(log)
        out["latest_race"] = snapsvc.latest_checkpoint(d, remote=seen)
        # a remote tier whose newest is step 15 too: a tie goes to the fastest tier, RAM
        out["latest_tie"] = snapsvc.latest_checkpoint(d, remote=os.path.join(tmp, "tie15"))
        with open(log) as f:   # what these two checked: no step below the remote's newest
            out["race_log"] = f.read()[before:]
        out["unreachable"] = unreachable_listing(d, remote, rank == 0)
        out["step15"] = attempt(15, remote=remote)
        out["same15"] = same(15)
        out["without_remote"] = attempt(10)
        out["step10"] = attempt(10, remote=remote)
        out["same10"] = same(10)
        model.load_state_dict(_trainer(rank, 2)[0].state_dict())
        out["mounted"] = attempt(10, remote=os.path.join(tmp, "mounted"))   # a mounted remote
        out["same_mounted"] = same(10)
        out["step5"] = attempt(5, remote=remote)   # rank 1's only copy is bad
        out["still10"] = same(10)                  # nothing changed on the failed rank
    with open(log) as f:
        out["log"] = f.read()
    return out


def _flip(data: bytes) -> bytes:
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0xFF
    return bytes(bad)


def _complete_copy(step: str, to) -> None:
    """A mounted remote tier's step complete as latest_checkpoint sees it (its manifest,
    every file it lists at its size): the memory-only ``step``'s, its files zeros."""
    from snapsvc.distributed.manifest import RAM_MANIFEST_NAME, read_manifest
    m = read_manifest(os.path.join(step, RAM_MANIFEST_NAME))
    to.mkdir(parents=True)
    shutil.copyfile(os.path.join(step, RAM_MANIFEST_NAME), to / "manifest.msgpack")
    for r in m.ranks:
        files = [(r.file, r.size), (r.file + ".meta", 0)] + [
            (c["file"], c["size"]) for c in (r.optim, r.data) if c is not None]
        for name, size in files:
            (to / name).write_bytes(bytes(size))


@pytest.mark.timeout(240)   # ~9 s beside the other world tests (the fork server is up)
def test_remote_tier_is_the_last_source(s3, tmp_path):
    """World 2 as nodes A and B, replicas=1, remote=S3 (moto); steps 5 and 10 persisted
    and uploaded, 15 memory-only; node B is lost (sidecar, RAM, disk). latest_checkpoint(
    remote=) takes step 15, complete in RAM, on both ranks, and it restores; when only
    rank 0's remote listing has a newer step (20: a commit between the ranks' listings)
    both ranks take it, where before rank 1 waited in a gather rank 0 never joined; a
    remote whose newest is step 15 too (a tie) gives step 15's local path (RAM, the
    fastest tier), and neither check CRC-checks a step below the remote's newest; when
    rank 0's remote is unreachable (a closed port) both ranks raise the same OSError
    naming rank 0, within seconds. Rank 0's replica of rank 1's step
    10 is then corrupted in place, so rank 1's file is in no good RAM copy and not on
    disk: restore_distributed(step_10, remote=) takes rank 0's from its own RAM and rank
    1's from the remote tier, CRC-checked, bit-exactly (from S3, and from a mounted
    directory); the bad replica is skipped and logged with the rank and the source. Without remote= it is an error naming rank 1.
    Step 5's remote copy of rank 1's file is corrupted too: skipped, logged, and the
    restore fails on rank 1 without changing its model."""
    from snapsvc.distributed.replicas import held_by
    from snapsvc.files.ramtier import drop
    d = str(tmp_path / "ckpt")
    try:
        codes, results = run_world(tmp_path, 2, scenario_remote_save, run_s=150,
                                   check_shm=False, remote=s3.url)
        assert codes == [-signal.SIGKILL] * 2, codes
        assert results[0]["urls"] == [f"{s3.url}/step_{n}" for n in (5, 10, 20)]
        assert not glob.glob(os.path.join(d, "step_*", "rank1.*"))
        replica = held_by(d, 10, 0, 2)[1]   # rank 0's RAM copy of rank 1's step 10
        with open(replica, "rb") as f:
            bad = _flip(f.read())
        with open(replica, "r+b") as f:
            f.write(bad)
        _drop_replicas(d, (5,), 2)
        # step 20 is on the remote tier only in a mounted copy (so S3's newest is 10),
        # and rank 1's file of it is in no RAM copy: not complete in RAM
        for key in [k for k in s3.keys() if k.startswith("step_20/")]:
            copy = tmp_path / "mounted20" / key
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_bytes(s3.read(key))
            s3.client.delete_object(Bucket=s3.bucket, Key=f"{s3.prefix}/{key}")
        drop(held_by(d, 20, 0, 2)[1])
        _complete_copy(os.path.join(d, "step_15"), tmp_path / "tie15" / "step_15")
        mounted = tmp_path / "mounted" / "step_10"   # the remote tier as a mounted directory
        mounted.mkdir(parents=True)
        for key in [k for k in s3.keys() if k.startswith("step_10/rank1.")]:
            (mounted / key.partition("/")[2]).write_bytes(s3.read(key))
        s3.write("step_5/rank1.fdl", _flip(s3.read("step_5/rank1.fdl")))
        _fresh_world(tmp_path)
        codes, results = run_world(tmp_path, 2, scenario_remote_resume, run_s=150,
                                   remote=s3.url)
        assert codes == [0, 0], codes
    finally:
        _drop_replicas(d, (5, 10, 15, 20), 2)
    r0, r1 = results
    assert [r0["attached"], r1["attached"]] == [True, False]
    # latest_checkpoint(remote=): a step complete in RAM newer than the remote tier's
    # newest, the same on both ranks
    assert r0["latest"] == r1["latest"] == os.path.join(d, "step_15")
    assert r0["step15"] == r1["step15"] == "ok" and r0["same15"] and r1["same15"]
    assert r0["latest_tie"] == r1["latest_tie"] == os.path.join(d, "step_15")
    # rank 0's remote is unreachable, rank 1's not: the same error on both, no wait
    # (before, rank 1 waited out RAM_TIMEOUT in a gather rank 0 had left)
    assert r0["unreachable"][0] == r1["unreachable"][0], (r0["unreachable"], r1["unreachable"])
    assert r0["unreachable"][0].count("rank 0: listing s3://") == 1, r0["unreachable"]
    assert r0["unreachable"][1] < 20 and r1["unreachable"][1] < 20
    assert r0["latest_race"] == r1["latest_race"] == str(tmp_path / "mounted20" / "step_20")
    assert "step 20 is not complete in RAM: no live copy of rank(s) [1]" in r0["log"]
    # step 10 (its bad replica) is below every rank's remote listing there: not checked
    assert "rank 0's replica of rank 1's file of step 10 is bad" in r0["log"]
    assert "file of step 10" not in r0["race_log"], r0["race_log"]
    assert "step 15: rank 1's file from rank 0's replica RAM" in r0["log"]
    assert r0["without_remote"] == "ok"
    assert "no good copy of rank 1's file" in r1["without_remote"]
    assert r0["step10"] == r1["step10"] == "ok" and r0["same10"] and r1["same10"]
    assert "rank 0's replica of rank 1's file of step 10 is bad, skipped" in r0["log"]
    assert ("step 10: rank 0's file from rank 0's own RAM" in r0["log"]
            or "step 10: rank 0's file from disk" in r0["log"])   # a persisted step's RAM copy
    assert "step 10: rank 1's file from" not in r0["log"]   # rank 0 needs only its own
    assert f"step 10: rank 1's file from the remote tier ({s3.url}/step_10/rank1.fdl)" \
        in r1["log"]
    assert r1["mounted"] == "ok" and r1["same_mounted"]
    assert f"step 10: rank 1's file from the remote tier ({tmp_path}/mounted/step_10/rank1.fdl)" \
        in r1["log"]
    assert r0["step5"] == "ok"
    assert "no good copy of rank 1's file" in r1["step5"] and "remote tier" in r1["step5"]
    assert "rank 1's file of step 5 on the remote tier is bad, skipped" in r1["log"]
    assert r1["still10"]

"""Issue 32: peer replicas for node loss (placement, replication, restore from a peer's RAM)."""

from __future__ import annotations

import os

import pytest

from snapsvc.distributed.replicas import node_id, place_replicas


def test_placement_ring_over_distinct_nodes():
    nodes = ["A", "A", "B", "B"]
    assert [place_replicas(nodes, r, 1) for r in range(4)] == [[2], [3], [0], [1]]
    six = ["A", "A", "B", "B", "C", "C"]
    assert place_replicas(six, 0, 1) == [2]
    assert place_replicas(six, 5, 1) == [1]          # C's second rank -> A's second rank
    assert place_replicas(six, 0, 2) == [2, 4]       # two copies, two other nodes
    assert place_replicas(six, 2, 2) == [4, 0]
    # deterministic: the same answer on every rank, whatever the call order
    assert place_replicas(six, 3, 2) == place_replicas(list(six), 3, 2)
    # not enough nodes: other ranks, never the origin, never twice
    assert place_replicas(["A", "A", "A"], 0, 1) == [1]
    assert place_replicas(nodes, 0, 3) == [2, 1, 3]
    assert place_replicas(nodes, 0, 0) == [] and place_replicas(["A"], 0, 1) == []


def test_node_id_order(monkeypatch):
    monkeypatch.delenv("SNAPSVC_NODE", raising=False)
    monkeypatch.delenv("GROUP_RANK", raising=False)
    import socket
    assert node_id() == socket.gethostname()
    monkeypatch.setenv("GROUP_RANK", "3")
    assert node_id() == "3"
    monkeypatch.setenv("SNAPSVC_NODE", "b")
    assert node_id() == "b"


# -- world 4 as 2 nodes x 2 ranks: node B lost, resumed from node A's RAM ---------------
import glob  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

from bitwise import assert_bit_identical  # noqa: E402
from dist_world import run_world, write_result  # noqa: E402

NODE_OF = {0: "A", 1: "A", 2: "B", 3: "B"}


def _trainer(rank: int, seed: int):
    torch.manual_seed(seed * 10 + rank)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _train(model, opt) -> None:
    loss = model(torch.randn(8, 16)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def _state(model, opt):
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optim": opt.state_dict()["state"], "lr": opt.param_groups[0]["lr"]}


def scenario_save_and_die(rank, world, tmp, corrupt=False):
    import snapsvc
    from snapsvc.distributed.replicas import held_by
    from snapsvc.files.ramtier import drop, held
    os.environ["SNAPSVC_NODE"] = NODE_OF[rank]
    d = os.path.join(tmp, "ckpt")
    model, opt = _trainer(rank, 1)
    w = snapsvc.DistributedSnapshotWriter(d, replicas=1, linger=60, coord_timeout=30)
    _train(model, opt)
    h10 = w.submit(model, 10, optimizer=opt)
    torch.save(_state(model, opt), os.path.join(tmp, f"expect10_{rank}.pt"))
    _train(model, opt)
    h20 = w.submit(model, 20, optimizer=opt, persist=False)
    torch.save(_state(model, opt), os.path.join(tmp, f"expect20_{rank}.pt"))
    h10.result(30)
    report = h20.result(30)
    holders = h20.replicated(timeout=30)
    h10.replicated(timeout=30)
    mine20 = sorted(held_by(d, 20, rank, world))
    out = {"holders": holders, "held20": mine20, "in_ram": held(h20.file) is not None,
           "manifest": os.path.basename(report.manifest),
           "on_disk20": os.path.exists(h20.file), "stats": w.stats()["replicated"]}
    if corrupt and rank == 0:   # flip a byte of its replica of rank 2's file, in place
        ram = held_by(d, 20, 0, world)[2]
        with open(ram, "r+b") as f:
            f.seek(os.path.getsize(ram) // 2)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))
    if NODE_OF[rank] == "B":   # node B is lost: its sidecars, its RAM, its disk
        os.kill(w.writer.pid, signal.SIGKILL)
        own = held(h20.file)
        if own is not None:
            drop(own)
        for n in (10, 20):
            for ram in held_by(d, n, rank, world).values():
                drop(ram)
        if not corrupt:   # with a corrupted replica, step 10 on disk is the next source
            for p in glob.glob(os.path.join(d, "step_10", f"rank{rank}.*")):
                os.unlink(p)
    write_result(tmp, rank, out)
    os.kill(os.getpid(), signal.SIGKILL)   # every trainer dies (the job restarts)


def scenario_resume(rank, world, tmp):
    import snapsvc
    os.environ["SNAPSVC_NODE"] = NODE_OF[rank]
    d = os.path.join(tmp, "ckpt")
    logging.basicConfig(level=logging.INFO, filename=os.path.join(tmp, f"log{rank}.txt"))
    model, opt = _trainer(rank, 2)   # other values than the saved ones
    _train(model, opt)
    with snapsvc.DistributedSnapshotWriter(d, replicas=1, linger=60, coord_timeout=30) as w:
        attached = w.writer.attached
        path = snapsvc.latest_checkpoint(d)
        snapsvc.restore_distributed(path, model, opt)
        got = _state(model, opt)
    name = "expect20" if path.endswith("step_20") else "expect10"
    expected = torch.load(os.path.join(tmp, f"{name}_{rank}.pt"))
    assert_bit_identical(got, expected, f"rank {rank}")
    with open(os.path.join(tmp, f"log{rank}.txt")) as f:
        log = f.read()
    return {"path": os.path.basename(path), "attached": attached is not None, "log": log}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("corrupt", [False, True], ids=["node-lost", "corrupt-replica"])
def test_node_lost_resumes_from_peer_ram(tmp_path, corrupt):
    codes, results = run_world(tmp_path, 4, scenario_save_and_die, run_s=100, check_shm=False,
                               corrupt=corrupt)
    assert codes == [-signal.SIGKILL] * 4
    assert [r["holders"] for r in results] == [[2], [3], [0], [1]]    # a ring over two nodes
    assert [r["held20"] for r in results] == [[2], [3], [0], [1]]
    assert all(r["in_ram"] and not r["on_disk20"] and r["manifest"] == "manifest.ram.msgpack"
               for r in results)
    assert not os.path.exists(tmp_path / "ckpt" / "step_20" / "manifest.msgpack")
    for f in glob.glob(str(tmp_path / "result*.json")) + [str(tmp_path / "rendezvous")]:
        if os.path.exists(f):   # a new world: a fresh rendezvous
            os.unlink(f)
    codes, results = run_world(tmp_path, 4, scenario_resume, run_s=100)
    assert codes == [0] * 4
    # node A's new trainers took over their lingering sidecars; node B's found none
    assert [r["attached"] for r in results] == [True, True, False, False]
    if not corrupt:
        assert {r["path"] for r in results} == {"step_20"}
        # node B's files came from node A's RAM; node A's from its own
        assert "rank 2's file from rank 0's replica RAM" in results[0]["log"]
        assert "rank 0's file from rank 0's own RAM" in results[0]["log"]
        assert "rank 2's file from rank 0's RAM, over the gloo group" in results[2]["log"]
    else:   # rank 0's replica of rank 2 is bad: step 20 is not whole anywhere; step 10 is
        assert {r["path"] for r in results} == {"step_10"}
        assert "rank 0's replica of rank 2's file of step 20 is bad, skipped" in results[0]["log"]

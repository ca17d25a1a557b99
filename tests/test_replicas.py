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
LINGER_S = 150   # node A's sidecars wait this long for the new world (a loaded CI is slow)


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


def scenario_save_and_die(rank, world, tmp):
    import snapsvc
    from snapsvc.distributed.replicas import held_by
    from snapsvc.files.ramtier import drop, held
    os.environ["SNAPSVC_NODE"] = NODE_OF[rank]
    d = os.path.join(tmp, "ckpt")
    model, opt = _trainer(rank, 1)
    w = snapsvc.DistributedSnapshotWriter(d, replicas=1, linger=LINGER_S, coord_timeout=30)
    handles = {}
    for step, persist in ((10, True), (20, False), (30, False)):   # 20, 30: memory-only
        _train(model, opt)
        handles[step] = w.submit(model, step, optimizer=opt, persist=persist)
        torch.save(_state(model, opt), os.path.join(tmp, f"expect{step}_{rank}.pt"))
    reports = {n: h.result(30) for n, h in handles.items()}
    holders = [handles[n].replicated(timeout=30) for n in (10, 20, 30)]
    h20 = handles[20]
    out = {"holders": holders, "held20": sorted(held_by(d, 20, rank, world)),
           "in_ram": held(h20.file) is not None, "manifest": os.path.basename(reports[20].manifest),
           "on_disk20": os.path.exists(h20.file), "replicated": w.stats()["replicated"]}
    if rank == 0:   # flip a byte of its replica of rank 2's step 30, in place in the tmpfs
        ram = held_by(d, 30, 0, world)[2]
        with open(ram, "r+b") as f:
            f.seek(os.path.getsize(ram) // 2)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))
    if NODE_OF[rank] == "B":   # node B is lost: its sidecars, its RAM, its disk
        os.kill(w.writer.pid, signal.SIGKILL)
        for h in handles.values():
            own = held(h.file)
            if own is not None:
                drop(own)
        for n in handles:
            for ram in held_by(d, n, rank, world).values():
                drop(ram)
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
    with snapsvc.DistributedSnapshotWriter(d, replicas=1, linger=LINGER_S,
                                           coord_timeout=30) as w:
        attached = w.writer.attached
        path = snapsvc.latest_checkpoint(d)
        snapsvc.restore_distributed(path, model, opt)
        got = _state(model, opt)
    name = "expect" + os.path.basename(path).removeprefix("step_")
    expected = torch.load(os.path.join(tmp, f"{name}_{rank}.pt"))
    assert_bit_identical(got, expected, f"rank {rank}")
    with open(os.path.join(tmp, f"log{rank}.txt")) as f:
        log = f.read()
    return {"path": os.path.basename(path), "attached": attached is not None, "log": log}


@pytest.mark.timeout(300)
def test_node_lost_resumes_from_peer_ram(tmp_path):
    """Node B (ranks 2, 3) is lost after steps 10 (persisted), 20 and 30 (memory-only);
    rank 0's replica of rank 2's step 30 is corrupted in place. The new world resumes
    step 20, bit-exactly, node B's files from node A's RAM: step 30 is not whole
    anywhere (the bad replica is skipped and logged; step 20's replica never stands in
    for it), and step 10 lost node B's disk files."""
    try:
        _node_loss(tmp_path)
    finally:   # a failed run must not leave replicas in the tmpfs (a clean close drops them)
        from snapsvc.distributed.replicas import held_by
        from snapsvc.files.ramtier import drop
        for n in (10, 20, 30):
            for holder in range(4):
                for ram in held_by(str(tmp_path / "ckpt"), n, holder, 4).values():
                    drop(ram)


def _node_loss(tmp_path):
    codes, results = run_world(tmp_path, 4, scenario_save_and_die, run_s=150, check_shm=False)
    assert codes == [-signal.SIGKILL] * 4
    assert [r["holders"] for r in results] == [[[2]] * 3, [[3]] * 3, [[0]] * 3, [[1]] * 3]
    assert [r["held20"] for r in results] == [[2], [3], [0], [1]]    # a ring over two nodes
    assert all(r["in_ram"] and not r["on_disk20"] and r["manifest"] == "manifest.ram.msgpack"
               and r["replicated"] == 3 for r in results)
    assert not os.path.exists(tmp_path / "ckpt" / "step_20" / "manifest.msgpack")
    for f in glob.glob(str(tmp_path / "result*.json")) + [str(tmp_path / "rendezvous")]:
        if os.path.exists(f):   # a new world: a fresh rendezvous
            os.unlink(f)
    codes, results = run_world(tmp_path, 4, scenario_resume, run_s=150)
    assert codes == [0] * 4
    # node A's new trainers took over their lingering sidecars; node B's found none
    assert [r["attached"] for r in results] == [True, True, False, False]
    assert {r["path"] for r in results} == {"step_20"}
    log0, log2 = results[0]["log"], results[2]["log"]
    assert "rank 0's replica of rank 2's file of step 30 is bad, skipped" in log0
    assert "step 30 is not complete in RAM: no live copy of rank(s) [2]" in log0
    # node B's files came from node A's RAM; node A's from its own
    assert "step 20: rank 2's file from rank 0's replica RAM" in log0
    assert "step 20: rank 0's file from rank 0's own RAM" in log0
    assert "step 20: rank 2's file from rank 0's RAM, over the gloo group" in log2


# -- a holder that cannot hold is passed over; what stays in RAM follows completeness ------
FOUR_NODES = {0: "A", 1: "B", 2: "C", 3: "D"}   # one rank per node: ring 0->1->2->3->0
KIB = 1024


def scenario_pass_over(rank, world, tmp):
    import snapsvc
    from snapsvc.distributed.replicas import held_by
    from snapsvc.files.ramtier import held
    os.environ["SNAPSVC_NODE"] = FOUR_NODES[rank]
    logging.basicConfig(level=logging.WARNING, filename=os.path.join(tmp, f"log{rank}.txt"))
    d = os.path.join(tmp, "ckpt")
    # rank 1 (node B) has room for two of rank 0's 256 KiB replicas, not for a 1 MiB one
    limit = {"memory_limit": 640 * KIB} if rank == 1 else {}
    w = snapsvc.DistributedSnapshotWriter(d, replicas=1, coord_timeout=30, **limit)
    out: dict = {"replicated": {}, "after": {}}
    with w:
        for step in range(1, 9):
            n = (256 if step != 5 else 1024) * KIB // 4 if rank == 0 else 16
            h = w.submit({"w": torch.full((n,), float(step))}, step, persist=False)
            h.result(30)
            try:
                out["replicated"][step] = h.replicated(timeout=30)
            except snapsvc.SnapsvcError as e:
                out["replicated"][step] = str(e)
            # what this rank holds once the step's round is over, per step so far
            out["after"][step] = {n: [held(os.path.join(d, f"step_{n}", f"rank{rank}.fdl"))
                                      is not None, sorted(held_by(d, n, rank, world))]
                                  for n in range(1, step + 1)}
    with open(os.path.join(tmp, f"log{rank}.txt")) as f:
        out["log"] = f.read()
    return out


@pytest.mark.timeout(120)
def test_holder_without_room_is_passed_over(tmp_path):
    """World 4 as 4 nodes. Rank 1 (node B) holds rank 0's replicas within its
    memory_limit, dropping the steps older than the newest complete one first; at
    step 5 rank 0's replica no longer fits beside the newest complete step (4), which
    is never dropped: step 5's replicated() names rank 1 and the limit, and from step
    6 on rank 0's replica goes to node C, with one warning. Steps leave RAM only once
    two newer steps are complete (keep_in_memory=2), on every rank; a step's
    completeness is agreed in the next step's commit exchange."""
    codes, results = run_world(tmp_path, 4, scenario_pass_over, run_s=110)
    assert codes == [0] * 4
    r0 = results[0]["replicated"]
    assert [r0[str(s)] for s in (1, 2, 3, 4)] == [[1]] * 4
    assert "rank 1 (node B)" in r0["5"] and "memory_limit=655360" in r0["5"]
    assert r0["6"] == [2] and r0["7"] == [2] and r0["8"] == [2]
    assert [results[r]["replicated"]["7"] for r in (1, 2, 3)] == [[2], [3], [0]]
    assert results[0]["log"].count("could not hold rank 0's replica") == 1
    held1 = results[1]["after"]
    # under its limit, rank 1 dropped step 1's replica for step 3's (2 is the newest
    # complete then), and kept step 4's through step 5's refusal
    assert held1["3"]["1"][1] == [] and held1["3"]["2"][1] == [0] and held1["3"]["3"][1] == [0]
    assert "drops its RAM copies of step 1" in results[1]["log"]
    assert held1["5"]["4"][1] == [0] and held1["5"]["5"][1] == []
    for r in range(4):
        # after step 7: 4 and 6 are the newest complete (5 is not: its replica was
        # refused), 7's completeness comes with step 8's exchange
        kept = results[r]["after"]["7"]
        assert [s for s, (own, reps) in kept.items() if own or reps] == ["4", "5", "6", "7"]
        # after step 8: steps 6 and 7 (complete) and 8, own copies and replicas
        last = results[r]["after"]["8"]
        assert [s for s, (own, reps) in last.items() if own or reps] == ["6", "7", "8"], (r, last)
        assert all(last[s][0] for s in ("6", "7", "8"))
    assert results[2]["after"]["7"]["7"][1] == [0, 1]   # node C holds A's and B's now


# -- world 6 as 3 nodes x 2 ranks: one node lost, then two ---------------------------------
NODE6 = {0: "A", 1: "A", 2: "B", 3: "B", 4: "C", 5: "C"}   # replicas: A->B, B->C, C->A


def _lose(w, d, rank, world, steps, disk_too):
    """This rank's node is lost: its sidecar, its RAM copies and held replicas (and its
    disk files of ``disk_too``), then every trainer of the world dies."""
    from snapsvc.distributed.replicas import held_by
    from snapsvc.files.ramtier import drop, held
    os.kill(w.writer.pid, signal.SIGKILL)
    for n in steps:
        own = held(os.path.join(d, f"step_{n}", f"rank{rank}.fdl"))
        if own is not None:
            drop(own)
        for ram in held_by(d, n, rank, world).values():
            drop(ram)
    for n in disk_too:
        for p in glob.glob(os.path.join(d, f"step_{n}", f"rank{rank}.*")):
            os.unlink(p)


def _save(w, model, opt, tmp, rank, steps):
    handles = {}
    for step, persist in steps:
        _train(model, opt)
        handles[step] = w.submit(model, step, optimizer=opt, persist=persist)
        torch.save(_state(model, opt), os.path.join(tmp, f"expect{step}_{rank}.pt"))
    for h in handles.values():
        h.result(30)
        h.replicated(timeout=30)


def _restore_check(w, d, tmp, rank, model, opt):
    import snapsvc
    path = snapsvc.latest_checkpoint(d)
    snapsvc.restore_distributed(path, model, opt)
    name = "expect" + os.path.basename(path).removeprefix("step_")
    assert_bit_identical(_state(model, opt), torch.load(os.path.join(tmp, f"{name}_{rank}.pt")),
                         f"rank {rank}")
    return os.path.basename(path)


def scenario_six(rank, world, tmp, phase):
    import snapsvc
    os.environ["SNAPSVC_NODE"] = NODE6[rank]
    d = os.path.join(tmp, "ckpt")
    model, opt = _trainer(rank, {"save": 1, "one": 2, "two": 3}[phase])
    w = snapsvc.DistributedSnapshotWriter(d, replicas=1, linger=LINGER_S,
                                          coord_timeout=30).start()
    out = {"attached": w.writer.attached is not None}   # took over a lingering sidecar
    if phase == "save":   # then node C is lost, its disk files of step 10 too
        _save(w, model, opt, tmp, rank, ((10, True), (20, False)))
        if NODE6[rank] == "C":
            _lose(w, d, rank, world, (10, 20), disk_too=(10,))
    elif phase == "one":   # resume step 20 from RAM; save 30 and 40; nodes B and C are lost
        _train(model, opt)
        out["path"] = _restore_check(w, d, tmp, rank, model, opt)
        _save(w, model, opt, tmp, rank, ((30, True), (40, False)))
        if NODE6[rank] in "BC":
            _lose(w, d, rank, world, (10, 20, 30, 40), disk_too=())
    else:   # step 40 lost rank 2's and 3's every copy: step 30, from disk
        _train(model, opt)
        out["path"] = _restore_check(w, d, tmp, rank, model, opt)
        w.close()
        return out
    write_result(tmp, rank, out)
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.slow   # three worlds of six processes: 2.5-4 min on a loaded 2-core machine
@pytest.mark.timeout(480)
def test_world6_one_node_then_two(tmp_path):
    """World 6 as 3 nodes x 2 ranks, replicas=1. Node C is lost after step 10 (persisted)
    and 20 (memory-only), its disk files with it: the new world resumes step 20 from RAM,
    bit-exactly (node C's files from node A's replicas). It saves 30 (persisted) and 40
    (memory-only); nodes B and C are lost (node B's step 40 was held only by B and C):
    the next world falls back to step 30, from disk, bit-exactly."""
    try:
        for phase, check in (("save", False), ("one", False), ("two", True)):
            for f in glob.glob(str(tmp_path / "result*.json")) + [str(tmp_path / "rendezvous")]:
                if os.path.exists(f):   # a new world: a fresh rendezvous
                    os.unlink(f)
            codes, results = run_world(tmp_path, 6, scenario_six, run_s=130, check_shm=check,
                                       phase=phase)
            assert codes == ([0] * 6 if phase == "two" else [-signal.SIGKILL] * 6), codes
            if phase == "one":
                assert {r["path"] for r in results} == {"step_20"}
                assert [r["attached"] for r in results] == [True] * 4 + [False] * 2
            if phase == "two":
                assert {r["path"] for r in results} == {"step_30"}
                assert [r["attached"] for r in results] == [True] * 2 + [False] * 4
    finally:   # a failed run must not leave replicas in the tmpfs
        from snapsvc.distributed.replicas import held_by
        from snapsvc.files.ramtier import drop
        for n in (10, 20, 30, 40):
            for holder in range(6):
                for ram in held_by(str(tmp_path / "ckpt"), n, holder, 6).values():
                    drop(ram)


def scenario_spares(rank, world, tmp):
    import time
    import snapsvc
    from snapsvc.distributed.replicas import held_by
    from snapsvc.distributed.replicas.send import verified
    os.environ["SNAPSVC_NODE"] = "AB"[rank]
    d = os.path.join(tmp, "ckpt")
    out: dict = {"ok": [], "inodes": [], "sizes": [], "spares": []}
    with snapsvc.DistributedSnapshotWriter(d, replicas=1, keep_in_memory=1,
                                           coord_timeout=30) as w:
        for step in range(1, 5):   # sizes change: a spare larger or smaller than the next
            n = {1: 512, 2: 256, 3: 384, 4: 640}[step] * 256
            h = w.submit({"w": torch.arange(n, dtype=torch.float32) * step}, step,
                         persist=False)
            h.result(30)
            assert h.replicated(timeout=30) == [1 - rank]
            ram = held_by(d, step, rank, world)[1 - rank]
            out["ok"].append(verified(ram, f"step {step}"))
            out["sizes"].append(os.path.getsize(ram))
            out["inodes"].append(os.stat(ram).st_ino)
            deadline = time.monotonic() + 10   # the spare is reserved once the handle settled
            while time.monotonic() < deadline and not any(
                    os.path.getsize(p) >= out["sizes"][-1] for p in w._replicator.keeper.spares()):
                time.sleep(0.02)
            out["spares"].append(sorted(map(os.path.getsize, w._replicator.keeper.spares())))
        out["copies"] = {s: len(w._replicator.keeper.copies(s)) for s in range(1, 5)}
        if rank == 0:   # snapsvc ls: where each rank's file is held
            import contextlib
            import io
            import json
            from snapsvc.cli.core import main
            for argv in (["ls", d, "--json"], ["ls", d]):
                text = io.StringIO()
                with contextlib.redirect_stdout(text):
                    assert main(argv) == 0
                out[argv[-1]] = text.getvalue()
            out["shards"] = json.loads(out.pop("--json"))["shards"]
        torch.distributed.barrier()   # the copies stay until rank 0 listed them
    return out


@pytest.mark.timeout(120)
def test_replicas_received_into_spare_pages(tmp_path):
    """keep_in_memory=1: once a step is agreed complete (at the next step's exchange),
    the replicas before it go; a dropped replica's file is kept as a spare, and after
    each round a spare is reserved for the next; replicas are received into spares'
    pages (shrunk or grown to the new size),
    checked against its CRC-32s; a clean close leaves nothing in /dev/shm (run_world
    checks). `snapsvc ls` shows per step where each rank's file is held."""
    codes, results = run_world(tmp_path, 2, scenario_spares, run_s=110)
    assert codes == [0, 0]
    for r in results:
        assert r["ok"] == [True] * 4
        assert r["sizes"][0] > r["sizes"][2] > r["sizes"][1] and r["sizes"][3] > r["sizes"][0]
        # after each round, a spare of the size just received is reserved for the next
        # (step 2's replica went into step 1's, shrunk); step 1's file, dropped at step
        # 3's exchange, was a spare taken for step 3, shrunk; step 4 grew the largest
        assert r["spares"][0] == r["sizes"][:1] and r["spares"][1] == r["sizes"][1:2], r
        ino = r["inodes"]
        assert ino[2] == ino[0] and len(set(ino)) == 3, r
        assert r["copies"] == {"1": 0, "2": 0, "3": 2, "4": 2}
    assert results[0]["shards"] == {
        "step_4": [["own RAM", "replica RAM (rank 1)"], ["own RAM", "replica RAM (rank 0)"]],
        "step_3": [["own RAM", "replica RAM (rank 1)"], ["own RAM", "replica RAM (rank 0)"]],
        **{f"step_{n}": [[], []] for n in (2, 1)}}
    text = results[0][os.path.join(str(tmp_path), "ckpt")].splitlines()
    for line in ("step_4 0 own RAM, replica RAM (rank 1)", "step_2 1 nowhere: lost"):
        assert line.split() in [t.split() for t in text], text


# -- a holder whose replication is gone: the others go on, re-replicating elsewhere --------
THREE_NODES = {0: "A", 1: "B", 2: "C"}   # ring A -> B -> C -> A


def scenario_holder_gone(rank, world, tmp):
    import snapsvc
    from snapsvc.distributed.replicas import held_by
    from snapsvc.distributed.replicas.send import verified
    os.environ["SNAPSVC_NODE"] = THREE_NODES[rank]
    logging.basicConfig(level=logging.WARNING, filename=os.path.join(tmp, f"log{rank}.txt"))
    d = os.path.join(tmp, "ckpt")
    out: dict = {"replicated": {}, "committed": [], "wait_s": {}}
    import time
    # coord_timeout also bounds each transfer (the replication group's timeout)
    with snapsvc.DistributedSnapshotWriter(d, replicas=1, coord_timeout=6) as w:
        for step in range(1, 5):
            if step == 2 and rank == 1:   # node B's replica holder is gone (its trainer lives)
                w._replicator.stop(10)
            h = w.submit({"w": torch.full((4096,), float(step + rank))}, step, persist=False)
            out["committed"].append(h.result(30).step)   # training and commits go on
            t0 = time.monotonic()
            try:
                out["replicated"][step] = h.replicated(timeout=3 if rank == 1 else 20)
            except TimeoutError as e:
                out["replicated"][step] = f"TimeoutError: {e}"
            except snapsvc.SnapsvcError as e:
                out["replicated"][step] = f"SnapsvcError: {e}"
            out["wait_s"][step] = time.monotonic() - t0
            torch.distributed.barrier()   # the training's own collectives go on too
        out["held4"] = {o: verified(ram, f"{o}") for o, ram in held_by(d, 4, rank, world).items()}
    with open(os.path.join(tmp, f"log{rank}.txt")) as f:
        out["log"] = f.read()
    return out


@pytest.mark.timeout(120)
def test_lost_holder_is_survivable(tmp_path):
    """World 3 as 3 nodes, replicas=1 (A -> B -> C -> A). From step 2, node B's replica
    holder is gone while its trainer still trains and commits. Every step still
    commits on every rank and nothing waits past the group timeout: A's step 2
    replicated() raises naming rank 1 (node B); B's own times out; A warns once, and
    from step 3 A's replica goes to node C (rank 2), which holds it checked. C's copy
    on A goes on throughout."""
    codes, results = run_world(tmp_path, 3, scenario_holder_gone, run_s=110)
    assert codes == [0] * 3
    assert all(r["committed"] == [1, 2, 3, 4] for r in results)
    a, b, c = (r["replicated"] for r in results)
    assert a["1"] == [1] and b["1"] == [2] and c["1"] == [0]
    assert a["2"].startswith("SnapsvcError") and "rank 1 (node B)" in a["2"], a["2"]
    assert a["3"] == [2] and a["4"] == [2]
    assert all(b[s].startswith("TimeoutError") for s in "234"), b
    assert [c[s] for s in "234"] == [[0]] * 3
    assert results[2]["held4"] == {"0": True}   # A's replica, now on C, CRC-checked
    assert results[0]["held4"] == {"2": True}
    log_a = results[0]["log"]
    assert log_a.count("could not hold rank 0's replica") == 1
    assert "from the next step on it goes to rank(s) [2] (node(s) ['C'])" in log_a
    assert "lost its replication link with rank 1 (node B)" in results[2]["log"]
    assert max(results[0]["wait_s"].values()) < 12   # the group timeout (6 s) bounds the wait


def scenario_holder_write_fails(rank, world, tmp):
    import resource
    import signal as sig
    import snapsvc
    from snapsvc.distributed.replicas import held_by, replica_file
    from snapsvc.files.ramtier import ram_path
    os.environ["SNAPSVC_NODE"] = "AB"[rank]
    d = os.path.join(tmp, "ckpt")
    out: dict = {"replicated": {}}
    with snapsvc.DistributedSnapshotWriter(d, replicas=1, coord_timeout=30) as w:
        if rank == 1:   # the holder's files may not grow past 1 MiB: a write fails (EFBIG)
            sig.signal(sig.SIGXFSZ, sig.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
        for step in (1, 2):
            n = (20 << 20) // 4 if rank == 0 else 16   # rank 0's file: 20 MiB, 3 chunks
            h = w.submit({"w": torch.full((n,), float(step))}, step, persist=False)
            h.result(30)
            try:
                out["replicated"][step] = h.replicated(timeout=30)
            except snapsvc.SnapsvcError as e:
                out["replicated"][step] = f"SnapsvcError: {e}"
        folder = os.path.dirname(ram_path(replica_file(d, 1, rank, "x")) or "")
        out["left"] = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
        out["held"] = {s: sorted(held_by(d, s, rank, world)) for s in (1, 2)}
        if rank == 1:
            resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
    return out


@pytest.mark.timeout(120)
def test_holder_write_failure_keeps_the_exchange_in_step(tmp_path):
    """World 2 as 2 nodes. The holder (rank 1) cannot write rank 0's 20 MiB replica
    (its files may not pass 1 MiB: EFBIG in the first of its 3 chunks): it still
    takes the rest of the bytes, leaves no temp file, and answers why; rank 0's
    replicated() names rank 1 (node B) and the error. Rank 1's own replica, sent next on
    the same group, arrives whole; step 2 runs in step (rank 0 has no other node left)."""
    codes, results = run_world(tmp_path, 2, scenario_holder_write_fails, run_s=110)
    assert codes == [0, 0]
    a, b = results[0]["replicated"], results[1]["replicated"]
    assert a["1"].startswith("SnapsvcError") and "rank 1 (node B)" in a["1"], a["1"]
    assert "File too large" in a["1"], a["1"]
    assert b["1"] == [0] and b["2"] == [0]
    assert "only 0 of 1 replica(s) placed" in a["2"], a["2"]
    assert results[1]["left"] == [] and results[1]["held"] == {"1": [], "2": []}
    assert results[0]["held"] == {"1": [1], "2": [1]}


def scenario_receiver_fails_before_the_bytes(rank, world, tmp):
    import errno
    from snapsvc.distributed.replicas import transport as T
    files = [os.path.join(tmp, "a.fdl"), os.path.join(tmp, "a.fdl.meta")]
    out: dict = {"got": []}
    if rank == 0:
        for path, n in zip(files, (300_000, 100)):
            with open(path, "wb") as f:
                f.write(os.urandom(n))
        link = os.path.join(tmp, "link.meta")   # a file the sender cannot open (ELOOP)
        os.symlink(files[1], link)
        fds = len(os.listdir("/proc/self/fd"))
        out["sent"] = [T.send_files(f, 1, None, timeout=10)
                       for f in (files, files, [files[0], link], files)]
        out["fds_kept"] = len(os.listdir("/proc/self/fd")) - fds
        for _ in range(2):   # each after rank 1 gave up receiving it
            torch.distributed.barrier()
            T._send(torch.ones(8, dtype=torch.uint8), 1, None, 10)
        return out
    dst = os.path.join(tmp, "dst")
    os.makedirs(dst)

    def no_space(n):   # the first file's spare: a full tmpfs
        raise OSError(errno.ENOSPC, "No space left on device")

    # 1: spare() fails on the first of two files; 2: os.open fails on the second (a
    # directory holds its temp name); 3: the sender cannot open its second file;
    # 4: a whole transfer on the same group
    blocker = os.path.join(dst, f"a.fdl.meta.{os.getpid()}.tmp")
    for attempt, spare in ((1, no_space), (2, None), (3, None), (4, None)):
        if attempt == 2:
            os.mkdir(blocker)
        header = T.recv_header(0, None, 10)
        if header["error"] is not None:
            out["got"].append(header["error"])
            out[f"left{attempt}"] = sorted(os.listdir(dst))
            continue
        try:
            T.recv_to_folder(0, None, header, dst, spare, timeout=10)
            out["got"].append("ok")
        except OSError as e:
            out["got"].append(errno.errorcode.get(e.errno or 0, str(e)))
        if attempt == 2:
            os.rmdir(blocker)
        out[f"left{attempt}"] = sorted(os.listdir(dst))
    for path in files:
        with open(path, "rb") as a, open(os.path.join(dst, os.path.basename(path)), "rb") as b:
            out.setdefault("same", []).append(a.read() == b.read())
    # receives given up on: one done since is no longer kept alive
    import time
    kept = []
    for _ in range(2):
        with pytest.raises(TimeoutError):
            T._recv(torch.zeros(8, dtype=torch.uint8), 0, None, 0.2)
        kept.append(len(T._abandoned))
        torch.distributed.barrier()
        deadline = time.monotonic() + 10
        while not T._abandoned[-1][0].is_completed() and time.monotonic() < deadline:
            time.sleep(0.01)
    out["abandoned"] = kept
    return out


@pytest.mark.timeout(60)
def test_receiver_failure_before_the_bytes_keeps_the_exchange_in_step(tmp_path):
    """World 2, transport only. The receiver fails on a file before taking its bytes
    (spare() raises ENOSPC on the first of two files; the second's temp file cannot be
    opened): it still takes every byte the sender sends (gloo would abort the process on
    a short receive), leaves no temp file, raises the error, and the next transfer on
    the same group arrives whole. A sender that cannot open one of its files (a symlink)
    sends a header naming the error and no bytes, and keeps no file open. A receive
    given up on is kept alive only until it completes."""
    codes, results = run_world(tmp_path, 2, scenario_receiver_fails_before_the_bytes, run_s=50)
    assert codes == [0, 0], codes
    assert results[0]["sent"] == [300_100, 300_100, 0, 300_100]
    assert results[0]["fds_kept"] == 0
    got = results[1]
    assert got["got"][:2] == ["ENOSPC", "EISDIR"] and got["got"][3] == "ok", got
    assert "link.meta" in got["got"][2] and "symbolic links" in got["got"][2], got
    assert got["left1"] == got["left2"] == got["left3"] == [], got
    assert got["left4"] == ["a.fdl", "a.fdl.meta"] and got["same"] == [True, True], got
    assert got["abandoned"] == [1, 1], got

"""Multi-rank checkpoints: DistributedSnapshotWriter, latest_checkpoint, restore_distributed.

Ranks are spawn-context processes on gloo (CPU), run by tests/dist_world.py.
Every run is bounded: each rank's work has its own timeouts, the parent joins
with a deadline and kills stragglers, and every test carries
pytest.mark.timeout.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import snapsvc
from dist_world import run_world
from snapsvc.distributed import MANIFEST_NAME
from snapsvc.files.durable import TMP_SUFFIX

pytestmark = [pytest.mark.timeout(150)]

RESULT_S = 60.0    # a handle that must resolve


# -- inside the ranks ---------------------------------------------------------------
def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    m[1].running_mean.uniform_()
    return m


def train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(seed)
    model.train()
    loss = model(torch.randn(6, 8)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def outcome(handle, timeout: float = RESULT_S) -> dict:
    """A handle's result as JSON: {"ok": True, ...report} or {"ok": False, "error", ...}."""
    t0 = time.monotonic()
    try:
        r = handle.result(timeout=timeout)
    except snapsvc.DistributedCheckpointError as e:
        return {"ok": False, "type": type(e).__name__, "error": str(e), "timed_out": e.timed_out,
                "failures": {str(k): v for k, v in e.failures.items()},
                "wait_s": time.monotonic() - t0}
    except Exception as e:
        return {"ok": False, "type": type(e).__name__, "error": str(e),
                "wait_s": time.monotonic() - t0}
    return {"ok": True, "path": r.path, "file": r.file, "manifest": r.manifest, "step": r.step,
            "rank": r.rank, "world_size": r.world_size, "bytes": r.bytes,
            "total_bytes": r.total_bytes, "stage_s": r.stage_s, "total_s": r.total_s,
            "wait_s": time.monotonic() - t0}


def rank1_faults(stage: str, path: str) -> None:
    """Fault hook for rank 1's sidecar: in a step directory holding FAULT the
    write fails with ENOSPC; in one holding DIE the sidecar SIGKILLs itself."""
    if stage != "write":
        return
    d = os.path.dirname(path)
    if os.path.exists(os.path.join(d, "FAULT")):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    if os.path.exists(os.path.join(d, "DIE")):
        os.kill(os.getpid(), signal.SIGKILL)


def try_submit(w, model, step: int) -> str:
    """'accepted', or the refusal of a writer that stopped after a failure."""
    try:
        w.submit(model, step)
        return "accepted"
    except snapsvc.DistributedCheckpointError as e:
        return f"{type(e).__name__}: {e}"


def scenario_happy(rank: int, world: int, tmp: str, other: str | None = None,
                   compressed: bool = False) -> dict:
    """Steps 1 and 2 pipelined (submitted before either resolves), step 3 with
    the optimizer; then restore step 3 into fresh objects, and optionally a
    checkpoint of another world size."""
    d = os.path.join(tmp, "ckpt")
    model = make_model(100 + rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out: dict = {"steps": {}}
    with snapsvc.DistributedSnapshotWriter(d, coord_timeout=60, compressed=compressed) as w:
        handles, saved = {}, {}
        for step in (1, 2, 3):
            train_step(model, opt, 1000 * step + rank)
            saved[step] = state(model)
            kw = {"optimizer": opt, "extra": {"rank": rank}} if step == 3 else {}
            t0 = time.perf_counter()
            handles[step] = w.submit(model, step, metrics={"loss": step + rank / 10},
                                     epoch=step, **kw)
            out.setdefault("submit_s", []).append(time.perf_counter() - t0)
            if step == 2:
                out["pending_after_submit"] = not handles[1].done() or not handles[2].done()
        saved_opt = {k: v.clone() for k, v in opt.state[model[0].weight].items()
                     if torch.is_tensor(v)}
        for step, h in handles.items():
            out["steps"][str(step)] = outcome(h)
        out["latest"] = snapsvc.latest_checkpoint(d)
        out["stats"] = {k: v for k, v in w.stats().items() if k != "writer"}
    fresh = make_model(7)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    report = snapsvc.restore_distributed(out["latest"], fresh, fresh_opt)
    out["restored_equal"] = same(state(fresh), saved[3])
    got = fresh_opt.state[fresh[0].weight]
    out["optim_equal"] = all(torch.equal(got[k], v) for k, v in saved_opt.items())
    out["report"] = {"epoch": report.epoch, "metrics": report.metrics, "extra": report.extra,
                     "loaded": len(report.loaded), "missing": report.missing}
    older = make_model(8)
    snapsvc.restore_distributed(os.path.join(d, "step_1"), older)
    out["step1_equal"] = same(state(older), saved[1])
    if other is not None:
        try:
            snapsvc.restore_distributed(other, make_model(9))
            out["other"] = "restored"
        except snapsvc.WorldSizeMismatchError as e:
            out["other"] = f"{type(e).__name__}: {e}"
            out["other_sizes"] = [e.saved, e.current]
    return out


def scenario_faults(rank: int, world: int, tmp: str) -> dict:
    """Step 1 ok; 2: rank 1 cannot write (ENOSPC); 3: rank 1's sidecar is
    SIGKILLed mid-write; 4 ok (sidecar restarted); 5: rank 1's submit()
    raises; 6: rank 1 submits step 7 instead (out of step); 8 ok."""
    d = os.path.join(tmp, "ckpt")
    model = make_model(200 + rank)
    out: dict = {"steps": {}, "latest_after": {}}
    hook = rank1_faults if rank == 1 else None
    with snapsvc.DistributedSnapshotWriter(d, coord_timeout=60, fault_hook=hook) as w:
        for step in (1, 2, 3, 4, 5, 6, 8):
            with torch.no_grad():
                model[0].weight.add_(1.0)
            pid = w.writer.pid
            submitted, kw = step, {}
            if rank == 1 and step == 5:
                kw["extra"] = object()  # not plain data: submit() raises a TypeError
            if rank == 1 and step == 6:
                submitted = 7
            try:
                res = outcome(w.submit(model, submitted, **kw))
            except TypeError as e:
                res = {"ok": False, "raised": f"{type(e).__name__}: {e}"}
            res["sidecar_restarted"] = w.writer.pid != pid
            out["steps"][str(step)] = res
            out["latest_after"][str(step)] = snapsvc.latest_checkpoint(d)
        out["stats"] = {k: v for k, v in w.stats().items() if k != "writer"}
        out["restarts"] = w.writer.stats()["restarts"]
    return out


def scenario_rank_killed(rank: int, world: int, tmp: str) -> dict:
    """Step 1 ok; the last rank SIGKILLs itself right after staging step 2."""
    d = os.path.join(tmp, "ckpt")
    model = make_model(300 + rank)
    out: dict = {}
    with snapsvc.DistributedSnapshotWriter(d, coord_timeout=30) as w:
        out["step1"] = outcome(w.submit(model, 1))
        with torch.no_grad():
            model[0].weight.add_(1.0)
        h = w.submit(model, 2)
        if rank == world - 1:
            with open(os.path.join(tmp, f"sidecar{rank}.pid"), "w") as f:
                f.write(str(w.writer.pid))
            os.kill(os.getpid(), signal.SIGKILL)
        out["step2"] = outcome(h)
        out["latest"] = snapsvc.latest_checkpoint(d)
        out["submit_after"] = try_submit(w, model, 3)
    return out


def scenario_hung_rank(rank: int, world: int, tmp: str) -> dict:
    """Step 1 ok; for step 2 rank 1 stays alive but never submits (it waits
    for rank 0 to report), so rank 0's exchange runs into coord_timeout."""
    d = os.path.join(tmp, "ckpt")
    model = make_model(400 + rank)
    flag = os.path.join(tmp, "rank0_done")
    out: dict = {}
    with snapsvc.DistributedSnapshotWriter(d, coord_timeout=5) as w:
        # The sidecar answers READY before it imports its writing half; a first write waits
        # for that import, slow on a loaded box next to this test's 5 s: write once beforehand.
        w.writer.submit(model, os.path.join(tmp, f"warm{rank}.fdl")).result(timeout=120)
        dist.barrier()  # both sidecars are up: step 1's exchange is well inside 5 s
        out["step1"] = outcome(w.submit(model, 1))
        if rank == 0:
            t0 = time.monotonic()
            out["step2"] = outcome(w.submit(model, 2))
            out["step2_s"] = time.monotonic() - t0
            out["latest"] = snapsvc.latest_checkpoint(d)
            out["submit_after"] = try_submit(w, model, 3)
            open(flag, "w").close()
        else:
            deadline = time.monotonic() + 60
            while not os.path.exists(flag) and time.monotonic() < deadline:
                time.sleep(0.05)
    return out


def manifest_of(path) -> snapsvc.distributed.Manifest:
    return snapsvc.read_manifest(path)


def wait_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.05)
    raise AssertionError(f"pid {pid} still running after {timeout} s")


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    """One world-size-2 happy run, shared by the tests that read its output."""
    tmp = tmp_path_factory.mktemp("world2")
    codes, results = run_world(tmp, 2, scenario_happy)
    return tmp, codes, results


# -- happy path ---------------------------------------------------------------------
def check_happy(tmp, codes, results, world: int, suffix: str = ".fdl") -> None:
    assert codes == [0] * world
    d = tmp / "ckpt"
    for rank, res in enumerate(results):
        for step in ("1", "2", "3"):
            s = res["steps"][step]
            assert s["ok"], f"rank {rank} step {step}: {s}"
            assert s["path"] == str(d / f"step_{step}") and s["rank"] == rank
            assert s["world_size"] == world and s["file"].endswith(f"rank{rank}{suffix}")
        assert res["pending_after_submit"]  # submit returned before anything was coordinated
        assert res["latest"] == str(d / "step_3")
        assert res["restored_equal"] and res["optim_equal"] and res["step1_equal"]
        assert res["report"]["epoch"] == 3 and res["report"]["extra"] == {"rank": rank}
        assert res["report"]["metrics"] == {"loss": pytest.approx(3 + rank / 10)}
        assert res["stats"] == {"submitted": 3, "committed": 3, "failed": 0, "broken": False}
    for step in (1, 2, 3):
        m = manifest_of(d / f"step_{step}")
        assert m.step == step and m.world_size == world and m.format == "fdl"
        assert [r.file for r in m.ranks] == [f"rank{r}{suffix}" for r in range(world)]
        assert m.metrics == {"loss": float(step)} and m.epoch == step  # rank 0's
        for r in m.ranks:
            path = d / f"step_{step}" / r.file
            v = snapsvc.verify(path)
            assert v.ok, str(v)
            assert (v.size, v.crc32) == (r.size, r.crc32)
            assert (r.optim is not None) == (step == 3)
        assert results[0]["steps"][str(step)]["total_bytes"] == sum(
            r.size + (r.optim["size"] if r.optim else 0) for r in m.ranks)
    assert snapsvc.latest_checkpoint(d) == str(d / "step_3")
    assert not [n for _, _, fs in os.walk(d) for n in fs if n.endswith(TMP_SUFFIX)]


def test_happy_path_world2(world2):
    tmp, codes, results = world2
    check_happy(tmp, codes, results, 2)
    print("submit() stalls, ms:", [[round(s * 1e3, 1) for s in r["submit_s"]] for r in results])


def test_happy_path_world3_gzip_and_world_size_change_refused(tmp_path, world2):
    other = str(world2[0] / "ckpt" / "step_3")
    codes, results = run_world(tmp_path, 3, scenario_happy, other=other, compressed=True)
    check_happy(tmp_path, codes, results, 3, suffix=".fdl.gz")
    for res in results:  # a world-2 checkpoint restored at world size 3
        assert res["other"].startswith("WorldSizeMismatchError")
        assert "2 ranks" in res["other"] and "world size is 3" in res["other"]
        assert res["other_sizes"] == [2, 3]


# -- faults ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def faults2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults2")
    for step, flag in ((2, "FAULT"), (3, "DIE")):  # read by rank 1's sidecar only
        (tmp / "ckpt" / f"step_{step}").mkdir(parents=True)
        (tmp / "ckpt" / f"step_{step}" / flag).write_bytes(b"")
    codes, results = run_world(tmp, 2, scenario_faults)
    assert codes == [0, 0]
    return tmp, results


def test_rank_that_cannot_write_fails_every_handle(faults2):
    tmp, results = faults2
    d = tmp / "ckpt"
    for rank, res in enumerate(results):
        assert res["steps"]["1"]["ok"]
        s = res["steps"]["2"]
        assert not s["ok"] and s["type"] == "DistributedCheckpointError" and not s["timed_out"]
        assert list(s["failures"]) == ["1"], s
        assert "rank 1" in s["error"] and "No space left on device" in s["error"]
        assert res["latest_after"]["2"] == str(d / "step_1")  # the previous one stays latest
    assert not (d / "step_2" / MANIFEST_NAME).exists()
    assert (d / "step_2" / "rank0.fdl").exists()  # rank 0's file is there, and not enough


def test_rank_whose_writer_dies_fails_every_handle_then_recovers(faults2):
    tmp, results = faults2
    d = tmp / "ckpt"
    for rank, res in enumerate(results):
        s = res["steps"]["3"]
        assert not s["ok"] and s["type"] == "DistributedCheckpointError" and not s["timed_out"]
        assert list(s["failures"]) == ["1"]
        assert "BrokenWriterError" in s["error"] and "SIGKILL" in s["error"]
        assert res["latest_after"]["3"] == str(d / "step_1")
        assert res["steps"]["4"]["ok"]  # the group is intact; the sidecar restarted
        assert res["latest_after"]["4"] == str(d / "step_4")
    assert results[1]["restarts"] == 1 and results[1]["steps"]["4"]["sidecar_restarted"]
    assert results[0]["restarts"] == 0
    assert not (d / "step_3" / MANIFEST_NAME).exists()


def test_rank_whose_submit_raises_or_is_out_of_step_fails_every_handle(faults2):
    tmp, results = faults2
    d = tmp / "ckpt"
    assert results[1]["steps"]["5"]["raised"].startswith(
        "UnsupportedStateError: extra: a value of type object is not storable")
    s = results[0]["steps"]["5"]  # rank 0 does not wait forever for rank 1's part
    assert not s["ok"] and list(s["failures"]) == ["1"]
    assert "submit() raised UnsupportedStateError" in s["error"]
    for res in results:
        s = res["steps"]["6"]
        assert not s["ok"] and sorted(s["failures"]) == ["0", "1"] and "out of step" in s["error"]
        assert "submitted step 6" in s["error"] and "submitted step 7" in s["error"]
        assert res["latest_after"]["6"] == str(d / "step_4")
        assert res["steps"]["8"]["ok"] and res["latest_after"]["8"] == str(d / "step_8")
        assert res["stats"] == {"submitted": 7, "committed": 3, "failed": 4, "broken": False}
    for step in (5, 6, 7):
        assert not (d / f"step_{step}" / MANIFEST_NAME).exists()
    assert snapsvc.latest_checkpoint(d) == str(d / "step_8")


def test_rank_sigkilled_mid_save_leaves_checkpoint_incomplete(tmp_path):
    codes, results = run_world(tmp_path, 3, scenario_rank_killed)
    assert codes == [0, 0, -signal.SIGKILL]
    assert results[2] is None
    d = tmp_path / "ckpt"
    for res in results[:2]:
        assert res["step1"]["ok"]
        s = res["step2"]
        assert not s["ok"] and s["type"] == "DistributedCheckpointError" and s["timed_out"]
        assert "coord_timeout=30 s" in s["error"]
        assert s["wait_s"] < 30  # a closed connection is seen at once, not at the timeout
        assert res["latest"] == str(d / "step_1")
        assert res["submit_after"].startswith("DistributedCheckpointError")
        assert "no more submits" in res["submit_after"]
    # The dead rank's sidecar finishes what was handed to it, then exits: its
    # file may appear, and the checkpoint is still incomplete without a manifest.
    wait_gone(int((tmp_path / "sidecar2.pid").read_text()), 30)
    assert not (d / "step_2" / MANIFEST_NAME).exists()
    assert snapsvc.latest_checkpoint(d) == str(d / "step_1")
    with pytest.raises(snapsvc.FormatError, match="incomplete"):
        snapsvc.read_manifest(d / "step_2")
    print("rank death seen by the survivors after (s):",
          [round(r["step2"]["wait_s"], 3) for r in results[:2]])


def test_hung_rank_times_out_and_writer_refuses_further_submits(tmp_path):
    codes, results = run_world(tmp_path, 2, scenario_hung_rank)
    assert codes == [0, 0]
    res = results[0]
    assert res["step1"]["ok"] and results[1]["step1"]["ok"]
    s = res["step2"]
    assert not s["ok"] and s["timed_out"] and "coord_timeout=5 s" in s["error"]
    assert 4 < res["step2_s"] < 30
    assert res["latest"] == str(tmp_path / "ckpt" / "step_1")
    assert "no more submits" in res["submit_after"]
    assert not (tmp_path / "ckpt" / "step_2" / MANIFEST_NAME).exists()


# -- latest_checkpoint and restore_distributed, in this process -----------------------
def test_latest_checkpoint_skips_incomplete_and_damaged(tmp_path, world2):
    d = tmp_path / "ckpt"
    shutil.copytree(world2[0] / "ckpt", d)
    assert snapsvc.latest_checkpoint(d) == str(d / "step_3")
    (d / "step_10").mkdir()                         # no manifest: incomplete
    shutil.copy(d / "step_3" / "rank0.fdl", d / "step_10" / "rank0.fdl")
    (d / "step_x").mkdir()                          # not a step directory
    (d / "step_11").write_bytes(b"")                # a file, not a directory
    assert snapsvc.latest_checkpoint(d) == str(d / "step_3")
    os.remove(d / "step_3" / "rank1.fdl")           # manifest, but a rank file is missing
    assert snapsvc.latest_checkpoint(d) == str(d / "step_2")
    with open(d / "step_2" / "rank0.fdl", "r+b") as f:  # truncated
        f.truncate(10)
    assert snapsvc.latest_checkpoint(d) == str(d / "step_1")
    (d / "step_1" / MANIFEST_NAME).write_bytes(b"\x93not a manifest")
    assert snapsvc.latest_checkpoint(d) is None
    assert snapsvc.latest_checkpoint(tmp_path / "nowhere") is None
    with pytest.raises(snapsvc.FormatError, match="not valid msgpack|not a snapsvc manifest"):
        snapsvc.read_manifest(d / "step_1")


def test_restore_distributed_checks_world_size_and_crc(tmp_path, world2, monkeypatch):
    d = tmp_path / "ckpt"
    shutil.copytree(world2[0] / "ckpt", d)
    step = d / "step_3"
    # This process has no process group: world size 1, and the checkpoint has 2.
    with pytest.raises(snapsvc.WorldSizeMismatchError,
                       match="saved by 2 ranks but the current world size is 1") as ei:
        snapsvc.restore_distributed(step, make_model(0))
    assert (ei.value.saved, ei.value.current) == (2, 1) and isinstance(ei.value, ValueError)
    with pytest.raises(snapsvc.FormatError, match="incomplete"):
        snapsvc.restore_distributed(d, make_model(0))  # the base directory, not a step
    # As rank 1 of 2: a byte flipped in place (same size) is caught by the CRC.
    monkeypatch.setattr(snapsvc.distributed.restore, "_rank_and_world", lambda pg: (1, 2))
    model = make_model(0)
    snapsvc.restore_distributed(step, model)
    path = step / "rank1.fdl"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    before = state(model)
    with pytest.raises(snapsvc.FormatError, match="CRC-32"):
        snapsvc.restore_distributed(step, model)
    assert same(state(model), before)  # nothing was loaded


def test_constructor_needs_torch_distributed(tmp_path):
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        snapsvc.DistributedSnapshotWriter(tmp_path)

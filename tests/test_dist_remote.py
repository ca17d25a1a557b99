"""DistributedSnapshotWriter(remote=...): each rank uploads its files, rank 0 commits the
remote manifest last; latest_checkpoint over both tiers; restore_distributed from a URL.

Against moto's S3 server on loopback (tests/remote_fixtures.py). The cheap tests run a
world of one rank in this process (gloo); one test spawns a world of two ranks to save
and one to restore (tests/dist_world.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import shutil
import time

import pytest
import torch
from torch import nn

import snapsvc
from dist_world import run_world
from snapsvc.cli import main
from snapsvc.distributed import MANIFEST_NAME
from snapsvc.remote.upload import Uploader

pytest_plugins = ["remote_fixtures"]  # s3, unreachable_s3, secret

pytest.importorskip("obstore")

RESULT_S = 60.0


def make_model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(4, 8)).sum().backward()
    opt.step()
    return m, opt


def same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))



def flip(s3, key: str, at: int) -> bytes:
    """Flip one byte of a remote object; its good bytes, to put back."""
    good = s3.read(key)
    bad = bytearray(good)
    bad[at] ^= 0x10
    s3.write(key, bytes(bad))
    return good


# -- one rank, in this process --------------------------------------------------------
@pytest.mark.timeout(120)
def test_world1_remote_tiers_latest_checkpoint_and_corruption(s3, world1, tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    d = tmp_path / "ckpt"
    model, opt = make_model(0)
    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(1)
    state = {"w": distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)]), "b": torch.randn(3),
             "n": 2}
    with snapsvc.DistributedSnapshotWriter(d, coord_timeout=60, remote=s3.url) as w:
        h1 = w.submit(model, 1, optimizer=opt)
        h2 = w.submit(state, 2)   # DTensors: pieces, read back by byte range
        assert h1.uploaded(timeout=RESULT_S) == f"{s3.url}/step_1"
        assert h2.uploaded(timeout=RESULT_S) == f"{s3.url}/step_2"
        assert h2.result(timeout=0).path == str(d / "step_2")
    assert sorted(s3.keys()) == [
        "step_1/manifest.msgpack", "step_1/rank0.fdl", "step_1/rank0.fdl.meta",
        "step_1/rank0.optim.fdl", "step_2/manifest.msgpack", "step_2/rank0.fdl",
        "step_2/rank0.fdl.meta"]
    for step in (1, 2):   # the remote manifest is the local one
        assert s3.read(f"step_{step}/{MANIFEST_NAME}") == \
            (d / f"step_{step}" / MANIFEST_NAME).read_bytes()

    # the newest complete step of either tier; the local one when both have it
    latest = snapsvc.latest_checkpoint
    assert latest(d, remote=s3.url) == str(d / "step_2")
    local = {"w": distribute_tensor(torch.zeros(6, 4), mesh, [Shard(0)]), "b": torch.zeros(3)}
    snapsvc.restore_distributed(d / "step_2", local)   # the same reads, from a local file
    assert torch.equal(local["w"].to_local(), state["w"].to_local())
    shutil.rmtree(d / "step_2")
    assert latest(d, remote=s3.url) == f"{s3.url}/step_2"
    manifest2 = s3.read(f"step_2/{MANIFEST_NAME}")
    s3.client.delete_object(Bucket=s3.bucket, Key=f"{s3.prefix}/step_2/{MANIFEST_NAME}")
    assert latest(d, remote=s3.url) == str(d / "step_1")   # no manifest: never chosen
    s3.write(f"step_2/{MANIFEST_NAME}", manifest2)
    meta = s3.read("step_2/rank0.fdl.meta")
    s3.client.delete_object(Bucket=s3.bucket, Key=f"{s3.prefix}/step_2/rank0.fdl.meta")
    assert latest(d, remote=s3.url) == str(d / "step_1")   # a listed file missing
    s3.write("step_2/rank0.fdl.meta", meta)
    shutil.rmtree(d)
    assert latest(d) is None
    assert latest(d, remote=s3.url) == f"{s3.url}/step_2"

    # restore from the remote tier, the local one deleted: bit-exact
    back, back_opt = make_model(5)
    snapsvc.restore_distributed(f"{s3.url}/step_1", back, back_opt)
    assert same(model, back)
    assert torch.equal(back_opt.state_dict()["state"][0]["exp_avg"],
                       opt.state_dict()["state"][0]["exp_avg"])
    target = {"w": distribute_tensor(torch.zeros(6, 4), mesh, [Shard(0)]), "b": torch.zeros(3)}
    report = snapsvc.restore_distributed(f"{s3.url}/step_2", target)
    assert torch.equal(target["w"].to_local(), state["w"].to_local())
    assert torch.equal(target["b"], state["b"]) and report.state["n"] == 2

    # a flipped byte in a remote rank file is refused, and nothing changes
    size1 = s3.keys()["step_1/rank0.fdl"]
    good = flip(s3, "step_1/rank0.fdl", size1 - 3)
    fresh, fresh_opt = make_model(6)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(snapsvc.FormatError, match="rank0") as e:
        snapsvc.restore_distributed(f"{s3.url}/step_1", fresh, fresh_opt)
    assert s3.url in str(e.value)
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())
    s3.write("step_1/rank0.fdl", good)
    flip(s3, "step_2/rank0.fdl", s3.keys()["step_2/rank0.fdl"] - 3)
    target = {"w": distribute_tensor(torch.zeros(6, 4), mesh, [Shard(0)]), "b": torch.zeros(3)}
    with pytest.raises(snapsvc.FormatError, match="CRC-32") as e:
        snapsvc.restore_distributed(f"{s3.url}/step_2", target)
    assert s3.url in str(e.value)
    assert not target["w"].to_local().any() and not target["b"].any()


@pytest.mark.timeout(120)
def test_world1_remote_retention_keeps_the_newest_complete_steps(s3, world1, tmp_path):
    model, _ = make_model(0)
    with snapsvc.DistributedSnapshotWriter(tmp_path / "ckpt", coord_timeout=60, remote=s3.url,
                                           remote_keep_last=2) as w:
        for step in (1, 2, 3):
            assert w.submit(model, step).uploaded(timeout=RESULT_S) == f"{s3.url}/step_{step}"
        stats = w.stats()
    assert stats["uploaded"] == 3 and stats["upload_failed"] == 0
    assert sorted({k.partition("/")[0] for k in s3.keys()}) == ["step_2", "step_3"]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step_1", "step_2", "step_3"]

    # A rank's upload of a step saved again (a run resumed from an earlier step) deletes
    # the step's remote manifest before its files: here the new upload fails (its local
    # file no longer matches its metadata), and the old manifest is not left over it.
    rank0 = tmp_path / "ckpt" / "step_3" / "rank0.fdl"
    data = bytearray(rank0.read_bytes())
    data[-3] ^= 0x10
    rank0.write_bytes(bytes(data))
    done: queue.Queue = queue.Queue()
    up = Uploader(s3.url, str(tmp_path / "ckpt"), remote_timeout=30.0, options=None,
                  keep_last=None, on_done=lambda job, url, error, skipped: done.put(error),
                  scan=False, uncommit=(MANIFEST_NAME,))
    up.start()
    up.enqueue(1, str(rank0))
    assert "crc32" in done.get(timeout=RESULT_S)
    up.close(10)
    assert f"step_3/{MANIFEST_NAME}" not in s3.keys()
    assert snapsvc.latest_checkpoint(tmp_path / "nowhere", remote=s3.url) == f"{s3.url}/step_2"


@pytest.mark.timeout(120)
def test_world1_unreachable_remote_fails_uploaded_and_local_commits_go_on(unreachable_s3,
                                                                          world1, tmp_path,
                                                                          secret):
    model, _ = make_model(0)
    d = tmp_path / "ckpt"
    with snapsvc.DistributedSnapshotWriter(d, coord_timeout=60, remote=unreachable_s3,
                                           remote_timeout=3.0) as w:
        handles = [w.submit(model, step) for step in (1, 2)]
        for h in handles:
            assert h.result(timeout=RESULT_S).step == h.step   # committed locally
        for h in handles:
            with pytest.raises(snapsvc.UploadError, match="not committed on the remote tier"
                               ) as e:
                h.uploaded(timeout=RESULT_S)
            assert "rank 0" in str(e.value) and secret not in str(e.value)
        stats = w.stats()
    assert stats["committed"] == 2 and stats["upload_failed"] == 2
    assert snapsvc.latest_checkpoint(d) == str(d / "step_2")


@pytest.mark.timeout(120)
def test_world1_steps_left_local_only_are_uploaded_by_the_next_writer(s3, world1, tmp_path):
    # A remote that fails every upload (its bucket is missing), then is back: the next
    # writer on the directory uploads what the first one left local-only, newest first,
    # except a step that remote_keep_last would remove at once (step 1 here).
    url = "s3://snapsvc-late-bucket/ckpt"
    d = tmp_path / "ckpt"
    models = [make_model(seed) for seed in (1, 2, 3)]
    with snapsvc.DistributedSnapshotWriter(d, coord_timeout=60, remote=url,
                                           remote_timeout=1.0) as w:
        handles = [w.submit(m, step, optimizer=o) for step, (m, o) in enumerate(models, 1)]
        for h in handles:
            h.result(timeout=RESULT_S)
            with pytest.raises(snapsvc.UploadError):
                h.uploaded(timeout=RESULT_S)
    s3.client.create_bucket(Bucket="snapsvc-late-bucket")
    with snapsvc.DistributedSnapshotWriter(d, coord_timeout=60, remote=url,
                                           remote_keep_last=2) as w:
        pass   # close() waits for the uploads it started
    assert w.stats()["uploaded"] == 2   # step 1 would have been uploaded, then pruned
    late = dataclasses.replace(s3, bucket="snapsvc-late-bucket")
    assert sorted({k.partition("/")[0] for k in late.keys()}) == ["step_2", "step_3"]
    for step in (2, 3):   # the remote manifest is the local one
        assert late.read(f"step_{step}/{MANIFEST_NAME}") == \
            (d / f"step_{step}" / MANIFEST_NAME).read_bytes()

    shutil.rmtree(d)
    assert snapsvc.latest_checkpoint(d, remote=url) == f"{url}/step_3"
    back, back_opt = make_model(5)
    snapsvc.restore_distributed(f"{url}/step_3", back, back_opt)
    assert same(models[2][0], back)
    assert torch.equal(back_opt.state_dict()["state"][0]["exp_avg"],
                       models[2][1].state_dict()["state"][0]["exp_avg"])


@pytest.mark.timeout(180)
def test_world1_catch_up_is_tried_again_after_an_outage(s3, fault_proxy, world1, tmp_path,
                                                        caplog):
    """The remote tier is down when the next writer starts: its listing of what an
    earlier run left local-only is retried, and after the outage, once the next step
    is exchanged, the catch-up runs again and uploads them."""
    url = "s3://snapsvc-late-bucket2/ckpt"
    d = tmp_path / "ckpt"
    model, _ = make_model(1)
    with snapsvc.DistributedSnapshotWriter(d, coord_timeout=60, remote=url,
                                           remote_timeout=1.0) as w:
        for step in (1, 2):   # the bucket is missing: both stay local-only
            with pytest.raises(snapsvc.UploadError):
                w.submit(model, step).uploaded(timeout=RESULT_S)
    s3.client.create_bucket(Bucket="snapsvc-late-bucket2")
    proxy = fault_proxy([])
    proxy.outage(True)
    with snapsvc.DistributedSnapshotWriter(d, coord_timeout=60, remote=url,
                                           remote_timeout=3.0) as w:
        deadline = time.monotonic() + 60
        while "looked for again" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        proxy.outage(False)
        assert w.submit(model, 3).uploaded(timeout=RESULT_S) == f"{url}/step_3"
    late = dataclasses.replace(s3, bucket="snapsvc-late-bucket2")
    assert sorted({k for k in late.keys() if k.endswith(MANIFEST_NAME)}) == [
        f"step_{n}/{MANIFEST_NAME}" for n in (1, 2, 3)]


@pytest.mark.timeout(120)
def test_world1_a_resumed_run_keeps_the_step_it_commits(s3, world1, tmp_path):
    """remote_keep_last ranks steps by write order: a run resumed from step 2 commits
    step 3 again beside the first run's steps 4 and 5, and keeps it."""
    model, _ = make_model(0)
    d = tmp_path / "ckpt"
    with snapsvc.DistributedSnapshotWriter(d, coord_timeout=60, remote=s3.url,
                                           remote_keep_last=2) as w:
        for step in range(1, 6):
            w.submit(model, step).uploaded(timeout=RESULT_S)
    shutil.rmtree(d / "step_3")
    with snapsvc.DistributedSnapshotWriter(d, coord_timeout=60, remote=s3.url,
                                           remote_keep_last=2) as w:
        assert w.submit(model, 3).uploaded(timeout=RESULT_S) == f"{s3.url}/step_3"
    assert sorted({k.partition("/")[0] for k in s3.keys()}) == ["step_3", "step_5"]


# -- two ranks ----------------------------------------------------------------------------
def scenario_save(rank: int, world: int, tmp: str, remote: str) -> dict:
    model, opt = make_model(100 + rank)
    with snapsvc.DistributedSnapshotWriter(os.path.join(tmp, "ckpt"), coord_timeout=60,
                                           remote=remote) as w:
        h = w.submit(model, 7, optimizer=opt, metrics={"loss": 0.5})
        url = h.uploaded(timeout=RESULT_S)
        committed = h.result(timeout=0).path
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()},
               os.path.join(tmp, f"saved{rank}.pt"))
    return {"url": url, "committed": committed}


def scenario_restore(rank: int, world: int, tmp: str, url: str) -> dict:
    model, opt = make_model(7)
    snapsvc.restore_distributed(url, model, opt)
    saved = torch.load(os.path.join(tmp, f"saved{rank}.pt"))
    got = opt.state_dict()["state"]
    return {"model": all(torch.equal(v, saved["model"][k]) for k, v in model.state_dict().items()),
            "opt": all(torch.equal(got[i][k], saved["opt"]["state"][i][k])
                       for i in saved["opt"]["state"] for k in ("exp_avg", "exp_avg_sq"))}


@pytest.mark.timeout(420)
def test_world2_uploaded_on_both_ranks_then_restored_from_the_remote_tier(s3, tmp_path, capsys):
    codes, results = run_world(tmp_path, 2, scenario_save, run_s=180, remote=s3.url)
    assert codes == [0, 0], results
    url = f"{s3.url}/step_7"
    assert [r["url"] for r in results] == [url, url]
    assert sorted(s3.keys()) == ["step_7/manifest.msgpack"] + sorted(
        f"step_7/rank{r}{ext}" for r in (0, 1) for ext in (".fdl", ".fdl.meta", ".optim.fdl"))
    d = tmp_path / "ckpt"
    assert snapsvc.latest_checkpoint(d, remote=s3.url) == str(d / "step_7")
    # snapsvc ls: the step is one checkpoint on both tiers, not each rank's file with its
    # rank as its step (Hardening 3, 20)
    capsys.readouterr()
    assert main(["ls", str(d), "--remote", s3.url, "--json"]) == 0
    [listed] = json.loads(capsys.readouterr().out)["checkpoints"]
    assert listed["name"] == "step_7" and listed["step"] == 7
    assert listed["tiers"] == ["local", "remote"] and listed["metrics"] == {"loss": 0.5}
    assert listed["bytes"] == sum(p.stat().st_size for p in (d / "step_7").iterdir())
    assert main(["ls", s3.url]) == 0
    assert [r.split()[:2] for r in capsys.readouterr().out.splitlines()[1:]] == [
        ["step_7", "7"]]
    shutil.rmtree(d)
    assert snapsvc.latest_checkpoint(d, remote=s3.url) == url
    for r in (0, 1):
        os.remove(tmp_path / f"result{r}.json")
    codes, results = run_world(tmp_path, 2, scenario_restore, run_s=180, url=url)
    assert codes == [0, 0] and results == [{"model": True, "opt": True}] * 2, results

"""SnapshotWriter(remote=...) end to end, against a real S3 server on loopback (moto)
and a mounted-directory remote: upload after the local commit, ``uploaded()``,
reading a checkpoint by URL, faults, rotation per tier, a sidecar killed
mid-upload. The parts alone are tested in tests/test_remote_store.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time

import pytest
import torch
from torch import nn

import snapsvc
pytest_plugins = ["remote_fixtures"]  # s3, unreachable_s3, fault_proxy, secret

pytest.importorskip("obstore")

pytestmark = pytest.mark.timeout(180)


def _model(seed: int = 0, width: int = 16) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 2))
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(4, 8)).sum().backward()
    opt.step()
    return m, opt


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_upload_then_restore_with_the_local_directory_deleted(s3, tmp_path):
    d = tmp_path / "ck"
    model, opt = _model()
    with snapsvc.SnapshotWriter(d, remote=s3.url) as w:
        h = w.submit(model, "step1.fdl", optimizer=opt, metrics={"loss": 0.5},
                     extra={"step": 1})
        h.result(timeout=60)
        assert h.uploaded(timeout=60) == f"{s3.url}/step1.fdl"
        w.submit({"model": model, "opt": opt, "step": 1}, "state.fdl").uploaded(timeout=60)
    assert sorted(s3.keys()) == ["state.fdl", "state.fdl.meta", "step1.fdl", "step1.fdl.meta",
                                 "step1.optim.fdl"]
    shutil.rmtree(d)
    url = f"{s3.url}/step1.fdl"
    back, back_opt = _model(seed=1)
    assert not _same(model, back)
    report = snapsvc.restore(url, back, back_opt)
    assert _same(model, back) and report.extra == {"step": 1}
    assert all(torch.equal(opt.state_dict()["state"][0][k], back_opt.state_dict()["state"][0][k])
               for k in ("exp_avg", "exp_avg_sq"))
    state = snapsvc.load(f"{s3.url}/state.fdl")
    assert state["step"] == 1 and torch.equal(state["model"]["0.weight"], model[0].weight)
    ck = snapsvc.read_checkpoint(url)
    assert ck.path == url and list(ck.entries) == list(model.state_dict())
    assert snapsvc.verify(url).ok
    assert s3.multipart_uploads() == []


def test_flipped_byte_in_a_remote_object_is_refused_and_nothing_changes(s3, tmp_path):
    model, opt = _model()
    with snapsvc.SnapshotWriter(tmp_path, remote=s3.url) as w:
        w.submit(model, "m.fdl", optimizer=opt).uploaded(timeout=60)
    url = f"{s3.url}/m.fdl"
    for key in ("m.fdl", "m.optim.fdl"):
        good = s3.read(key)
        bad = bytearray(good)
        bad[len(bad) - 3] ^= 0x10  # inside the last tensor's data
        s3.write(key, bytes(bad))
        target, target_opt = _model(seed=2)
        before = {k: v.clone() for k, v in target.state_dict().items()}
        with pytest.raises(snapsvc.FormatError, match=key.replace(".", r"\.")) as e:
            snapsvc.restore(url, target, target_opt)
        assert s3.url in str(e.value)
        assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
        assert target_opt.state_dict()["state"][0]["step"] == 1  # its own, untouched
        report = snapsvc.verify(url)
        assert not report.ok and any(key in p for p in report.problems)
        with pytest.raises(snapsvc.FormatError, match=key.replace(".", r"\.")):
            snapsvc.read_checkpoint(url)
        s3.write(key, good)
    assert snapsvc.verify(url).ok


def test_unreachable_remote_fails_uploaded_in_time_and_local_writes_go_on(unreachable_s3,
                                                                         tmp_path, capfd,
                                                                         secret):
    model, _ = _model()
    t0 = time.monotonic()
    w = snapsvc.SnapshotWriter(tmp_path, remote=unreachable_s3, remote_timeout=3.0)
    try:
        handles = [w.submit(model, f"step{i}.fdl") for i in (1, 2, 3)]
        for h in handles:
            h.result(timeout=60)  # durable locally, whatever the remote does
        with pytest.raises(snapsvc.UploadError) as e:
            handles[-1].uploaded(timeout=60)
        assert isinstance(e.value, snapsvc.SnapsvcError)
        assert "step3.fdl" in str(e.value) and secret not in str(e.value)
        assert snapsvc.verify(tmp_path / "step3.fdl").ok
    finally:
        w.close()
    assert time.monotonic() - t0 < 60  # 3 s deadlines, with a loaded machine's slack
    for h in handles:
        with pytest.raises(snapsvc.UploadError):
            h.uploaded(timeout=0)
    out, err = capfd.readouterr()
    assert secret not in out + err


def test_connection_resets_and_stalls_are_retried_within_remote_timeout(s3, fault_proxy,
                                                                        tmp_path):
    proxy = fault_proxy(["reset", "stall", "reset", "reset", "stall"])
    model, opt = _model()
    # a stalled request is cut after 2 s (the default is 30 s, within remote_timeout)
    with snapsvc.SnapshotWriter(tmp_path, remote=s3.url, remote_timeout=120,
                                remote_options={"client_options": {"timeout": "2s"}}) as w:
        h = w.submit(model, "step1.fdl", optimizer=opt)
        assert h.uploaded(timeout=150) == f"{s3.url}/step1.fdl"
    assert proxy.met == ["reset", "stall", "reset", "reset", "stall"]
    for name in ("step1.fdl", "step1.optim.fdl", "step1.fdl.meta"):
        assert s3.read(name) == (tmp_path / name).read_bytes()
    assert s3.multipart_uploads() == []


def test_uploaded_without_remote_is_none_and_times_out_while_pending(unreachable_s3, tmp_path):
    model, _ = _model()
    with snapsvc.SnapshotWriter(tmp_path / "a") as w:
        h = w.submit(model, "x.fdl")
        assert h.uploaded(timeout=60) is None
    w = snapsvc.SnapshotWriter(tmp_path / "b", remote=unreachable_s3, remote_timeout=30.0)
    try:
        h = w.submit(model, "x.fdl")
        h.result(timeout=60)
        with pytest.raises(TimeoutError):
            h.uploaded(timeout=0.2)
    finally:
        w.close(timeout=0)  # no waiting for uploads: each is reported not uploaded
    with pytest.raises(snapsvc.UploadError, match="not uploaded"):
        h.uploaded(timeout=10)


def test_close_past_remote_timeout_is_routine(s3, fault_proxy, tmp_path, capfd):
    """An endpoint that never answers: close() gives the uploads remote_timeout, then
    each fails with why; a warning, no traceback."""
    fault_proxy(["stall"] * 100)
    model, _ = _model()
    w = snapsvc.SnapshotWriter(tmp_path, remote=s3.url, remote_timeout=1.0)
    try:
        handles = [w.submit(model, f"step{i}.fdl") for i in (1, 2, 3)]
    finally:
        w.close()
    for h in handles:
        with pytest.raises(snapsvc.UploadError, match="not uploaded|remote_timeout"):
            h.uploaded(timeout=10)
    assert "Traceback" not in capfd.readouterr().err


def test_rotation_on_each_tier(s3, tmp_path, capsys):
    model, opt = _model()
    with snapsvc.SnapshotWriter(tmp_path, keep_last=2, remote=s3.url, remote_keep_last=1) as w:
        for i in (1, 2, 3):
            w.submit(model, f"step{i}.fdl", optimizer=opt).uploaded(timeout=60)
        w.submit(model, "best.fdl").uploaded(timeout=60)
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["best.fdl", "best.fdl.meta", "step2.fdl", "step2.fdl.meta", "step2.optim.fdl",
         "step3.fdl", "step3.fdl.meta", "step3.optim.fdl"])
    assert sorted(s3.keys()) == ["best.fdl", "best.fdl.meta", "step3.fdl", "step3.fdl.meta",
                                 "step3.optim.fdl"]
    # the CLI shows which tier holds what, and reads and checks a URL
    from snapsvc.cli.core import main
    capsys.readouterr()
    assert main(["ls", str(tmp_path), "--remote", s3.url, "--json"]) == 0
    listed = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checkpoints"]}
    assert {n: (c["step"], c["tiers"]) for n, c in listed.items()} == {
        "step3.fdl": (3, ["local", "remote"]), "step2.fdl": (2, ["local"]),
        "best.fdl": (None, ["local", "remote"])}
    assert listed["step3.fdl"]["bytes"] == sum(
        os.path.getsize(tmp_path / n) for n in ("step3.fdl", "step3.fdl.meta", "step3.optim.fdl"))
    assert main(["verify", f"{s3.url}/step3.fdl"]) == 0
    assert main(["inspect", f"{s3.url}/step3.fdl", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["path"] == f"{s3.url}/step3.fdl"


def test_mounted_directory_remote(tmp_path):
    model, opt = _model()
    remote = tmp_path / "shared" / "run1"
    with snapsvc.SnapshotWriter(tmp_path / "local", remote=str(remote)) as w:
        assert w.submit(model, "sub/step7.fdl", optimizer=opt).uploaded(timeout=60) == \
            str(remote / "sub" / "step7.fdl")
    for name in ("step7.fdl", "step7.fdl.meta", "step7.optim.fdl"):
        assert (remote / "sub" / name).read_bytes() == \
            (tmp_path / "local" / "sub" / name).read_bytes()
    assert not [n for n in os.listdir(remote / "sub") if n.startswith(".")]  # no temp left
    shutil.rmtree(tmp_path / "local")
    back, _ = _model(seed=3)
    snapsvc.restore(remote / "sub" / "step7.fdl", back)
    assert _same(model, back)


def test_sidecar_killed_mid_upload_then_every_durable_checkpoint_is_committed(s3, tmp_path):
    big = nn.Linear(1024, 6000)  # ~24 MB: a multipart upload of several parts
    w = snapsvc.SnapshotWriter(tmp_path, remote=s3.url)
    try:
        first = [w.submit(big, f"step{i}.fdl") for i in (1, 2)]
        for h in first:
            h.result(timeout=60)
        os.kill(w.pid, signal.SIGKILL)  # while the uploads run (or just after)
        for h in first:
            try:
                h.uploaded(timeout=60)
            except snapsvc.SnapsvcError:
                pass  # not committed: the next sidecar finds it
        w.submit(big, "step3.fdl").result(timeout=120)  # a new sidecar (restart=True)
    finally:
        w.close()
    keys = s3.keys()
    for i in (1, 2, 3):
        for suffix in ("", ".meta"):
            name = f"step{i}.fdl{suffix}"
            assert s3.read(name) == (tmp_path / name).read_bytes(), name
    assert set(keys) == {f"step{i}.fdl{s}" for i in (1, 2, 3) for s in ("", ".meta")}
    assert s3.multipart_uploads() == []


def test_rotation_never_takes_files_a_retrying_upload_needs(s3, fault_proxy, tmp_path, capfd):
    """keep_last=1 and an outage: step1's upload began, then step2 rotated step1 away
    locally; the upload's retry still has step1's files and commits it."""
    proxy = fault_proxy([])
    proxy.outage(True)
    model, opt = _model()
    with snapsvc.SnapshotWriter(tmp_path, keep_last=1, remote=s3.url, remote_timeout=60,
                                remote_options={"retry_config": {"max_retries": 1}}) as w:
        h1 = w.submit(model, "step1.fdl", optimizer=opt)
        h1.result(timeout=60)
        err, deadline = "", time.monotonic() + 60
        while "step1.fdl failed" not in err and time.monotonic() < deadline:
            time.sleep(0.05)  # step1's first attempt failed: its upload has begun
            err += capfd.readouterr().err
        w.submit(model, "step2.fdl", optimizer=opt).result(timeout=60)
        assert not (tmp_path / "step1.fdl").exists()  # rotated away locally
        time.sleep(1.5)  # a failed attempt or two
        proxy.outage(False)
        assert h1.uploaded(timeout=90) == f"{s3.url}/step1.fdl"
    back, _ = _model(seed=4)
    snapsvc.restore(f"{s3.url}/step1.fdl", back)
    assert _same(model, back)


def test_a_resumed_run_keeps_what_it_commits_on_each_tier(s3, tmp_path):
    """A run resumed from step 2 writes step3 again while steps 4 and 5 of the first run
    are there: each tier ranks by write order, so neither deletes the new step3."""
    model, _ = _model()
    with snapsvc.SnapshotWriter(tmp_path, remote=s3.url, remote_keep_last=2) as w:
        for i in range(1, 6):
            w.submit(model, f"step{i}.fdl").uploaded(timeout=60)
    with snapsvc.SnapshotWriter(tmp_path, keep_last=1, remote=s3.url,
                                remote_keep_last=2) as w:
        assert w.submit(model, "step3.fdl").uploaded(timeout=60) == f"{s3.url}/step3.fdl"
    assert sorted(s3.keys()) == ["step3.fdl", "step3.fdl.meta", "step5.fdl", "step5.fdl.meta"]
    assert (tmp_path / "step3.fdl.meta").exists()


def test_remote_settings_refused_at_construction(s3, tmp_path, secret):
    """What cannot work is refused before any sidecar starts, never echoing a secret:
    credentials in a URL, options obstore would refuse (or panic on) in the sidecar,
    and a directory remote that is the local one through a symlink, inside it or
    around it."""
    with pytest.raises(ValueError, match="AWS_SECRET_ACCESS_KEY") as e:
        snapsvc.SnapshotWriter(tmp_path, remote=f"s3://AKIAKEY:{secret}@bucket/run")
    assert secret not in str(e.value) and "AKIAKEY" not in str(e.value)
    with pytest.raises(ValueError) as e:
        snapsvc.restore(f"s3://AKIAKEY:{secret}@bucket/run/x.fdl", nn.Linear(1, 1))
    assert secret not in str(e.value)
    for options, why in (({"region_name": "x"}, "region_name"),
                         ({"timeout": "10s"}, "client_options"),
                         ({"client_options": {"timeout": "soon"}}, "soon")):
        with pytest.raises(ValueError, match=why):
            snapsvc.SnapshotWriter(tmp_path, remote=s3.url, remote_options=options)
    local = tmp_path / "local"
    (local / "sub").mkdir(parents=True)
    os.symlink(local, tmp_path / "link")
    for remote in (tmp_path / "link", tmp_path / "link" / "sub", tmp_path):
        with pytest.raises(ValueError, match="apart from it"):
            snapsvc.SnapshotWriter(local, remote=str(remote))
    # an empty remote is no place (it uploaded into the current directory)
    for remote in ("", " "):
        with pytest.raises(ValueError, match="names no place"):
            snapsvc.SnapshotWriter(local, remote=remote)


def test_every_url_uploaded_returns_reads_back(s3, tmp_path):
    """Folder names with '#', '%41', '?' or a trailing space, under a prefix with '#':
    each uploaded() URL reads back, naming the object as the store lists it; a name
    the store cannot hold (a tab) is refused at submit."""
    model, _ = _model()
    url = f"s3://{s3.bucket}/run#1"
    names = ["a#b/step1.fdl", "p%41/step1.fdl", "q?r/step1.fdl", "sp /step1.fdl"]
    with snapsvc.SnapshotWriter(tmp_path, remote=url) as w:
        with pytest.raises(snapsvc.PathError, match="control character"):
            w.submit(model, "t\tb.fdl")
        urls = [w.submit(model, n).uploaded(timeout=60) for n in names]
    assert urls == [f"{url}/{n}" for n in names]
    for u in urls:
        back, _ = _model(seed=5)
        snapsvc.restore(u, back)
        assert _same(model, back)
    listed = s3.client.list_objects_v2(Bucket=s3.bucket)["Contents"]
    assert sorted(o["Key"] for o in listed if o["Key"].endswith("step1.fdl")) == \
        sorted(f"run#1/{n}" for n in names)


def test_reads_by_url_have_a_deadline(s3, fault_proxy, tmp_path):
    """An endpoint that accepts connections and never answers: a read by URL gives up
    at its timeout=, an OSError naming it."""
    fault_proxy(["stall"] * 100)
    url = f"{s3.url}/step1.fdl"
    with pytest.raises(OSError, match=url):  # the request's own timeout, or the deadline's
        snapsvc.restore(url, nn.Linear(1, 1), timeout=1)
    report = snapsvc.verify(url, timeout=1)
    assert not report.ok and url in report.problems[0]
    with pytest.raises(OSError, match=s3.url):  # multi-rank checkpoints too
        snapsvc.latest_checkpoint(tmp_path, remote=s3.url, timeout=1)
    with pytest.raises(OSError, match="step_1"):
        snapsvc.restore_distributed(f"{s3.url}/step_1", nn.Linear(1, 1), timeout=1)


def test_no_room_for_a_fetch_is_a_local_error(s3, tmp_path, monkeypatch):
    """Short writes, then ENOSPC, where a fetch lands its bytes: an OSError naming
    where and how many bytes, not a corrupt remote object."""
    import errno
    model, _ = _model(width=512)
    with snapsvc.SnapshotWriter(tmp_path, remote=s3.url) as w:
        w.submit(model, "m.fdl").uploaded(timeout=60)
    size = os.path.getsize(tmp_path / "m.fdl")
    real, calls = os.pwrite, []

    def full(fd, data, at):
        calls.append(at)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, bytes(data)[: len(data) // 2], at)

    monkeypatch.setattr(os, "pwrite", full)
    for read in (lambda u: snapsvc.restore(u, _model(seed=6)[0]), snapsvc.verify):
        calls.clear()
        with pytest.raises(OSError) as e:
            read(f"{s3.url}/m.fdl")
        assert not isinstance(e.value, snapsvc.FormatError)
        assert e.value.errno == errno.ENOSPC and f"{size} bytes" in str(e.value)
        assert "snapsvc-fetch-" in str(e.value)  # where

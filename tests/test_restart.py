"""The RAM tier (issue 31, item 1): memory-only snapshots and persist_every."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import snapsvc
from snapsvc.files import ramtier
from snapsvc.files.metafile import meta_path


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "step": seed}


@pytest.mark.timeout(60)
def test_memory_only_submit_is_read_from_ram_and_not_on_disk(tmp_path, no_leaks):
    path = tmp_path / "step1.fdl"
    with snapsvc.SnapshotWriter(tmp_path) as w:
        report = w.submit(_state(1), path, persist=False).result(30)
        assert report.in_memory and report.bytes == 0
        assert not path.exists() and not os.path.exists(meta_path(path))
        assert sorted(os.listdir(tmp_path)) == []
        loaded = snapsvc.load(path)
        assert torch.equal(loaded["w"], _state(1)["w"]) and loaded["step"] == 1
        target = {"w": torch.zeros(64, 32), "step": 0}
        snapsvc.restore(path, target)
        assert torch.equal(target["w"], _state(1)["w"])
        assert snapsvc.verify(path).ok
        ram = ramtier.held(path)
        assert ram is not None and ram.startswith("/dev/shm/")
        assert {os.stat(p).st_mode & 0o777 for p in (ram, meta_path(ram))} == {0o600}
        # the next memory-only snapshot of the series replaces it (keep_in_memory=1)
        w.submit(_state(2), tmp_path / "step2.fdl", persist=False).result(30)
        assert ramtier.held(path) is None and ramtier.held(tmp_path / "step2.fdl")
    # the sidecar has exited: its RAM copies are gone, nothing on disk either
    assert ramtier.held(tmp_path / "step2.fdl") is None
    assert sorted(os.listdir(tmp_path)) == []
    assert ramtier.ram_path(tmp_path / "x") is None  # its folder is gone (no_leaks: the root)
    with pytest.raises(FileNotFoundError):
        snapsvc.load(tmp_path / "step2.fdl")


@pytest.mark.timeout(60)
def test_a_ram_copy_read_the_wrong_way_names_its_own_error(tmp_path):
    """No disk copy to fall back to: the RAM copy's error, not 'no such checkpoint'."""
    model = torch.nn.Linear(4, 4)
    with snapsvc.SnapshotWriter(tmp_path) as w:
        w.submit(model, "m.fdl", persist=False).result(30)
        loaded = snapsvc.load(tmp_path / "m.fdl")["model"]   # a model checkpoint, read from RAM
        assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
        with pytest.raises(snapsvc.ArchitectureMismatchError, match="architecture mismatch"):
            snapsvc.restore(tmp_path / "m.fdl", torch.nn.Linear(4, 5))
        snapsvc.restore(tmp_path / "m.fdl", torch.nn.Linear(4, 4))


@pytest.mark.timeout(60)
def test_persist_every_persists_each_kth_submit_per_series(tmp_path, no_leaks):
    with snapsvc.SnapshotWriter(tmp_path, persist_every=3, keep_in_memory=2) as w:
        handles = [w.submit(_state(i), tmp_path / f"step{i}.fdl") for i in range(1, 8)]
        best = w.submit(_state(0), tmp_path / "best.fdl").result(30)  # a series of its own
        reports = [h.result(30) for h in handles]
        assert [r.in_memory for r in reports] == [True, True, False, True, True, False, True]
        assert best.in_memory  # the first of its series
        on_disk = sorted(p for p in os.listdir(tmp_path) if p.endswith(".fdl"))
        assert on_disk == ["step3.fdl", "step6.fdl"]
        # the newest two memory-only ones of the series are held
        assert [i for i in range(1, 8) if ramtier.held(tmp_path / f"step{i}.fdl")] == [5, 7]
        assert snapsvc.load(tmp_path / "step7.fdl")["step"] == 7


@pytest.mark.timeout(60)
def test_ram_copy_newer_than_disk_wins_and_a_bad_one_falls_back(tmp_path, no_leaks):
    path = tmp_path / "last.fdl"
    with snapsvc.SnapshotWriter(tmp_path) as w:
        w.submit(_state(1), path).result(30)           # durable
        w.submit(_state(2), path, persist=False).result(30)   # newer, RAM only
        assert snapsvc.load(path)["step"] == 2
        ram = ramtier.held(path)
        with open(ram, "r+b") as f:  # flip a byte of the RAM copy's tensor data
            f.seek(os.path.getsize(ram) - 8)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0xFF]))
        with pytest.warns(RuntimeWarning, match="RAM copy .* is bad"):
            assert snapsvc.load(path)["step"] == 1
        with pytest.warns(RuntimeWarning, match="RAM copy .* is bad"):
            assert snapsvc.verify(path).ok
        # a durable write of the same path makes the RAM copy stale: it goes
        w.submit(_state(3), path).result(30)
        assert ramtier.held(path) is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert snapsvc.load(path)["step"] == 3


@pytest.mark.timeout(60)
def test_latest_sees_ram_disk_and_a_mounted_remote(tmp_path):
    d, far = tmp_path / "ckpt", tmp_path / "far"
    far.mkdir()
    assert snapsvc.latest(d) is None
    with snapsvc.SnapshotWriter(d, persist_every=2) as w:
        for i in range(1, 4):  # step2 on disk, step3 in RAM
            w.submit(_state(i), f"step{i}.fdl").result(30)
        (d / "step9.fdl").write_bytes(b"torn")  # no .meta: incomplete, never the answer
        assert snapsvc.latest(d) == str(d / "step3.fdl")
        assert snapsvc.load(snapsvc.latest(d))["step"] == 3
        for suffix in ("", ".meta"):  # a newer step on the mounted remote tier
            (far / f"step5.fdl{suffix}").write_bytes((d / f"step2.fdl{suffix}").read_bytes())
        assert snapsvc.latest(d, remote=far) == str(far / "step5.fdl")
    assert snapsvc.latest(d) == str(d / "step2.fdl")  # the RAM copy went with its sidecar


def test_foreign_or_symlinked_ram_dir_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(ramtier, "SHM", str(tmp_path))
    monkeypatch.setattr(ramtier, "ram_root", lambda: str(tmp_path / "root"))
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    os.symlink(tmp_path / "elsewhere", tmp_path / "root")
    with pytest.raises(snapsvc.UnsafePathError, match="symlink"):
        ramtier.ram_path(tmp_path / "x.fdl", create=True)
    os.unlink(tmp_path / "root")
    (tmp_path / "root").mkdir(mode=0o755)
    os.chmod(tmp_path / "root", 0o755)
    with pytest.raises(snapsvc.UnsafePathError, match="mode 755"):
        ramtier.held(tmp_path / "x.fdl")
    os.chmod(tmp_path / "root", 0o700)
    real = os.lstat
    monkeypatch.setattr(ramtier.os, "lstat", lambda p: os.stat_result(
        (*real(p)[:4], os.getuid() + 1, *real(p)[5:])))  # faked ownership
    with pytest.raises(snapsvc.UnsafePathError, match="owned by uid"):
        ramtier.ram_path(tmp_path / "x.fdl", create=True)


# -- linger: a sidecar outlives its SIGKILLed trainer --------------------------
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from snapsvc.files import rendezvous  # noqa: E402

_TRAINER = """
import os, signal, sys, torch, snapsvc
w = snapsvc.SnapshotWriter(sys.argv[1], linger=float(sys.argv[2]), persist_every=10)
state = {"w": torch.randn(256, 256, generator=torch.Generator().manual_seed(0)), "step": 0}
for step in range(1, 4):  # all memory-only: persist_every=10
    state["w"].add_(1)
    state["step"] = step
    w.submit(state, f"step{step}.fdl").result(30)
print(w.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _killed_trainer(directory, linger: float) -> int:
    """Run a trainer that SIGKILLs itself after three memory-only snapshots; its sidecar's pid."""
    out, err = directory / "trainer.out", directory / "trainer.err"
    with open(out, "w") as o, open(err, "w") as e:  # files: the sidecar outlives the trainer
        code = subprocess.run([sys.executable, "-c", _TRAINER, str(directory), str(linger)],
                              stdout=o, stderr=e, timeout=60).returncode
    assert code == -signal.SIGKILL, err.read_text()
    return int(out.read_text().split()[-1])


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def _socket(directory) -> str | None:
    path = rendezvous.socket_path(str(directory))
    return path if path is not None and os.path.exists(path) else None


@pytest.mark.timeout(90)
def test_new_trainer_attaches_and_restores_a_memory_only_snapshot_bit_exact(tmp_path):
    pid = _killed_trainer(tmp_path, linger=30)
    path = tmp_path / "step3.fdl"
    expected = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        expected.add_(1)  # as the trainer did, rounding included
    assert not path.exists() and not os.path.exists(meta_path(path))  # never on disk
    deadline = time.monotonic() + 20
    while _socket(tmp_path) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _socket(tmp_path) is not None and not _gone(pid, 0)
    assert torch.equal(snapsvc.load(path)["w"], expected)  # readable while it lingers
    with snapsvc.SnapshotWriter(tmp_path, linger=30) as w:
        assert w.attached is not None and w.attached.pid == pid
        assert w.attached.held == [str(path)] and w.attached.failures == []
        assert _gone(pid, 20) and _socket(tmp_path) is None  # it handed over and left
        target = {"w": torch.zeros(256, 256), "step": 0}
        snapsvc.restore(path, target)
        assert torch.equal(target["w"], expected) and snapsvc.load(path)["step"] == 3
    # the new sidecar held it, even with no write of its own; a clean close frees it
    assert _socket(tmp_path) is None and ramtier.held(path) is None
    assert ramtier.ram_path(tmp_path / "x") is None  # the directory's RAM folder is gone


_FAILING = """
import functools, os, signal, sys, snapsvc, torch, hooks
d = sys.argv[1]
w = snapsvc.SnapshotWriter(d, linger=30, fault_hook=functools.partial(hooks.fail_late, 1.0))
open(os.path.join(d, hooks.FLAG), "w").close()
w.submit({"w": torch.ones(4)}, "bad.fdl")  # fails a second later, the trainer gone
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.timeout(60)
def test_a_write_that_failed_while_detached_is_reported_at_attach(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))}
    code = subprocess.run([sys.executable, "-c", _FAILING, str(tmp_path)], env=env,
                          cwd=os.path.dirname(__file__), stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, timeout=60).returncode
    assert code == -signal.SIGKILL
    deadline = time.monotonic() + 20
    while _socket(tmp_path) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    with snapsvc.SnapshotWriter(tmp_path) as w:
        w.start()
        assert w.attached is not None
        [(path, error)] = w.attached.failures
        assert path == str(tmp_path / "bad.fdl") and "No space left" in error
    assert not (tmp_path / "bad.fdl").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("linger", [0.0, 1.0])  # 0: as before linger existed, no wait at all
def test_linger_expiry_leaves_no_process_shm_entry_or_socket(tmp_path, linger):
    pid = _killed_trainer(tmp_path, linger=linger)
    assert _gone(pid, 30)
    assert _socket(tmp_path) is None
    assert ramtier.held(tmp_path / "step3.fdl") is None
    assert ramtier.ram_path(tmp_path / "x") is None  # the directory's RAM folder is gone
    with snapsvc.SnapshotWriter(tmp_path) as w:  # nothing to attach to
        w.start()
        assert w.attached is None


@pytest.mark.timeout(60)
def test_sigterm_ends_a_lingering_sidecar_leaving_nothing(tmp_path):
    pid = _killed_trainer(tmp_path, linger=60)
    deadline = time.monotonic() + 20
    while _socket(tmp_path) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ramtier.held(tmp_path / "step3.fdl") is not None
    os.kill(pid, signal.SIGTERM)
    assert _gone(pid, 20)
    assert _socket(tmp_path) is None and ramtier.ram_path(tmp_path / "x") is None

"""Fault tolerance: writer death, trainer death, disk faults, torn snapshots,
integrity, shutdown. Every case runs in bounded time and leaks nothing."""

from __future__ import annotations

import errno
import functools
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest
import torch
from torch import nn

import snapsvc
from snapsvc.files.durable import TMP_SUFFIX
from snapsvc.files.meta import meta_path
import hooks

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leaks")]
HERE = os.path.dirname(os.path.abspath(__file__))


def temps(directory) -> list[str]:
    return [n for n in os.listdir(directory) if n.endswith(TMP_SUFFIX)]


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


def gone(pid: int) -> bool:
    """Exited: reaped, or a zombie with no thread left. (A zombie main thread
    alone is not enough: the other threads, and the open files, may linger.)"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        return zombie and len(os.listdir(f"/proc/{pid}/task")) <= 1
    except FileNotFoundError:
        return True


def weights(path) -> float:
    return snapsvc.read_checkpoint(path).entries["weight"].sum().item()


# -- writer death ----------------------------------------------------------------
def test_sigkilled_writer_fails_every_pending_handle_within_2s(tmp_path, net):
    hook = functools.partial(hooks.pause, "write", "slow", 30.0)
    with snapsvc.SnapshotWriter(tmp_path, slots=2, fault_hook=hook) as w:
        a = w.submit(net, "slow_a.fdl")
        b = w.submit(net, "slow_b.fdl")
        wait_for(lambda: temps(tmp_path), 30, "the writer to open its temp file")
        dead_pid = w.pid
        t0 = time.monotonic()
        os.kill(dead_pid, signal.SIGKILL)
        for h in (a, b):
            with pytest.raises(snapsvc.BrokenWriterError, match="SIGKILL") as ei:
                h.result(timeout=2.0)
            assert isinstance(ei.value, RuntimeError)
        detect_s = time.monotonic() - t0
        assert detect_s < 2.0
        assert not (tmp_path / "slow_a.fdl").exists() and not (tmp_path / "slow_b.fdl").exists()
        assert temps(tmp_path)  # the dead writer's leftover...
        report = w.submit(net, "after.fdl").result(timeout=60)  # ...restart removes it
        assert w.pid != dead_pid and w.stats()["restarts"] == 1 and w.stats()["broken"] == 2
        assert temps(tmp_path) == [] and snapsvc.verify(report.path).ok
    print(f"writer death detected in {detect_s * 1e3:.1f} ms")


@pytest.mark.parametrize("delay", [0.0, 0.005, 0.02, 0.05, 0.15])
def test_kill_at_any_moment_leaves_no_partial_file(tmp_path, delay):
    model = nn.Linear(256, 256)
    with snapsvc.SnapshotWriter(tmp_path, slots=2, policy="block") as w:
        handles = [w.submit(model, f"k{i}.fdl") for i in range(2)]
        time.sleep(delay)
        dead_pid = w.pid
        os.kill(dead_pid, signal.SIGKILL)
        outcomes = []
        for h in handles:
            try:
                h.result(timeout=2.0)
                outcomes.append("ok")
            except snapsvc.BrokenWriterError:
                outcomes.append("broken")
        finals = [n for n in os.listdir(tmp_path) if n.endswith(".fdl")]
        for name in finals:  # whatever is under a final name is whole
            assert snapsvc.verify(tmp_path / name, require_meta=False).ok
            if (tmp_path / (name + ".meta")).exists():
                assert snapsvc.verify(tmp_path / name).ok
        for name, outcome in zip(["k0.fdl", "k1.fdl"], outcomes):
            if outcome == "ok":
                assert name in finals
        wait_for(lambda: gone(dead_pid), 5, "the kill to land")  # SIGKILL is not instant
        assert w.submit(model, "next.fdl").result(timeout=60).bytes > 0
        assert temps(tmp_path) == []


def test_writer_failing_at_start_is_reported(tmp_path):
    w = snapsvc.SnapshotWriter(tmp_path, fault_hook=hooks.fail_start)
    with pytest.raises(snapsvc.BrokenWriterError, match="exited with code 1"):
        w.start()
    w.close()


def test_no_restart_when_disabled(tmp_path, net):
    with snapsvc.SnapshotWriter(tmp_path, restart=False) as w:
        w.submit(net, "a.fdl").result(timeout=60)
        os.kill(w.pid, signal.SIGKILL)
        wait_for(lambda: w._book.broken is not None, 5, "the death to be noticed")
        with pytest.raises(snapsvc.BrokenWriterError, match="SIGKILL"):
            w.submit(net, "b.fdl")
        assert w.stats()["restarts"] == 0


# -- trainer death and shutdown ------------------------------------------------
def run_trainer(mode: str, directory, n: int, delay: float, drain: float = 60.0):
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "trainer_script.py"), mode,
                             str(directory), str(n), str(delay), str(drain)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise AssertionError(f"trainer failed to start: {proc.communicate(timeout=10)[1]}")
    return proc, json.loads(line)


def check_written(info) -> None:
    for path, expected in zip(info["paths"], info["sums"]):
        report = snapsvc.verify(path)
        assert report.ok, str(report)
        assert weights(path) == pytest.approx(expected)


def test_sigkilled_trainer_writer_finishes_then_exits(tmp_path):
    shm_before = set(os.listdir("/dev/shm"))
    t0 = time.monotonic()
    proc, info = run_trainer("sigkill", tmp_path, 3, 0.5)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    proc.stdout.close()
    proc.stderr.close()
    wait_for(lambda: gone(info["writer_pid"]), 60, "the orphaned writer to exit")
    elapsed = time.monotonic() - t0
    check_written(info)  # every submit that returned is on disk, whole
    wait_for(lambda: set(os.listdir("/dev/shm")) <= shm_before, 20, "/dev/shm to be clean")
    print(f"orphaned writer finished 3 files and exited {elapsed:.2f} s after the trainer started")


def test_interpreter_exit_without_close_drains(tmp_path):
    proc, info = run_trainer("exit", tmp_path, 2, 0.5)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    wait_for(lambda: gone(info["writer_pid"]), 10, "the writer to exit")
    check_written(info)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_in_trainer_drains_pending_writes(tmp_path, sig):
    proc, info = run_trainer("wait", tmp_path, 2, 1.0)
    proc.send_signal(sig)
    proc.communicate(timeout=60)
    assert proc.returncode != 0  # it did stop on the signal...
    wait_for(lambda: gone(info["writer_pid"]), 10, "the writer to exit")
    check_written(info)  # ...after the queued writes were done


def test_write_not_done_in_time_is_logged(tmp_path):
    proc, info = run_trainer("exit", tmp_path, 1, 10.0, drain=0.5)
    _, err = proc.communicate(timeout=60)
    assert "not written within" in err and info["paths"][0] in err
    wait_for(lambda: gone(info["writer_pid"]), 10, "the writer to exit")
    assert not os.path.exists(info["paths"][0]) and temps(tmp_path) == []


# -- disk faults -----------------------------------------------------------------
def _mount(*args: str) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


@contextmanager
def fault_scenario(kind: str, base):
    """Yield (directory, hook, errno expected, arm()): arm() turns the fault on."""
    d = base / "ckpt"
    d.mkdir()
    flag = d / hooks.FLAG

    def arm_flag() -> None:
        flag.write_bytes(b"")

    if kind == "enospc-fs":
        if not _mount("-t", "tmpfs", "-o", "size=192k", "tmpfs", str(d)):
            pytest.skip("cannot mount a small tmpfs here")
        try:
            yield d, None, errno.ENOSPC, lambda: None  # the big model does not fit
        finally:
            subprocess.run(["umount", str(d)], check=True)
    elif kind == "readonly":
        if not (_mount("--bind", str(d), str(d))):
            pytest.skip("cannot bind-mount here")
        try:
            yield d, None, errno.EROFS, lambda: _mount("-o", "remount,bind,ro", str(d))
        finally:
            subprocess.run(["umount", str(d)], check=True)
    elif kind == "eacces":
        if os.geteuid() != 0:
            pytest.skip("needs root to switch to user nobody")
        os.chmod(d, 0o755)
        yield d, hooks.drop_root, errno.EACCES, arm_flag
    elif kind == "efbig":
        yield d, functools.partial(hooks.limit_fsize, 4096), errno.EFBIG, arm_flag
    elif kind == "enospc-hook":
        yield d, functools.partial(hooks.raise_errno, "write", errno.ENOSPC), errno.ENOSPC, arm_flag
    elif kind == "fsync":
        yield d, functools.partial(hooks.raise_errno, "fsync", errno.EIO), errno.EIO, arm_flag
    else:
        raise ValueError(kind)


@pytest.mark.parametrize("kind", ["enospc-fs", "enospc-hook", "efbig", "eacces", "readonly",
                                  "fsync"])
def test_disk_fault_keeps_previous_checkpoint(tmp_path, kind):
    small, big = nn.Linear(16, 16), nn.Linear(256, 256)  # 1 KiB vs 257 KiB
    with fault_scenario(kind, tmp_path) as (d, hook, expected, arm):
        with snapsvc.SnapshotWriter(fault_hook=hook) as w:
            target = d / "model.fdl"
            w.submit(small, target, epoch=1).result(timeout=60)
            before = target.read_bytes(), open(meta_path(target), "rb").read()
            arm()
            with pytest.raises(snapsvc.WriteFailedError) as ei:
                w.submit(big, target, epoch=2).result(timeout=60)
            assert ei.value.errno == expected, ei.value
            assert ei.value.filename == str(target) and str(target) in str(ei.value)
            assert (target.read_bytes(), open(meta_path(target), "rb").read()) == before
            assert snapsvc.verify(target).ok
            assert temps(d) == []
            # the sidecar keeps serving
            other = tmp_path / "elsewhere"
            other.mkdir()
            assert w.submit(big, other / "ok.fdl").result(timeout=60).bytes > 0


def test_vanished_directory(tmp_path, net):
    d = tmp_path / "gone"
    d.mkdir()
    with snapsvc.SnapshotWriter() as w:
        w.submit(net, d / "a.fdl").result(timeout=60)
        for name in os.listdir(d):
            os.unlink(d / name)
        d.rmdir()
        with pytest.raises(snapsvc.WriteFailedError) as ei:
            w.submit(net, d / "a.fdl").result(timeout=60)
        assert ei.value.errno == errno.ENOENT and ei.value.filename == str(d / "a.fdl")
        assert w.submit(net, tmp_path / "b.fdl").result(timeout=60).bytes > 0


# -- torn snapshots --------------------------------------------------------------
def test_100_submits_each_followed_by_an_update(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64))
    expected = []
    with snapsvc.SnapshotWriter(tmp_path, slots=2) as w:
        handles = []
        for i in range(100):
            expected.append({k: v.clone() for k, v in model.state_dict().items()})
            handles.append(w.submit(model, f"u{i}.fdl"))
            with torch.no_grad():  # at once, while the writer may be reading
                for p in model.parameters():
                    p.mul_(1.01).add_(0.5)
                model[1].running_mean.add_(1)
        for h in handles:
            h.result(timeout=60)
    for i, state in enumerate(expected):
        got = snapsvc.read_checkpoint(tmp_path / f"u{i}.fdl").entries
        assert all(torch.equal(got[k], state[k]) for k in state), f"file u{i}.fdl is torn"


# -- integrity ---------------------------------------------------------------------
@pytest.mark.parametrize("name", ["v.fdl", "v.fdl.gz"])
def test_verify_detects_every_single_byte_corruption(tmp_path, name):
    snap = snapsvc.snapshot_cpu(nn.Linear(4, 3), epoch=1)
    path = tmp_path / name
    snap.save_file(path)
    good = path.read_bytes()
    assert snapsvc.verify(path).ok
    missed = []
    for offset in range(len(good)):
        for flip in (0x01, 0x80, 0xFF):
            bad = bytearray(good)
            bad[offset] ^= flip
            path.write_bytes(bad)
            if snapsvc.verify(path).ok:
                missed.append((offset, flip))
    path.write_bytes(good)
    assert missed == [], f"undetected corruptions: {missed[:10]}"


def test_verify_reports_truncation_and_missing_metadata(tmp_path):
    snap = snapsvc.snapshot_cpu(nn.Linear(4, 3))
    snap.save_file(tmp_path / "t.fdl")
    data = (tmp_path / "t.fdl").read_bytes()
    (tmp_path / "t.fdl").write_bytes(data[:-3])
    report = snapsvc.verify(tmp_path / "t.fdl")
    assert not report.ok and any("only 9 remain" in p and "bias" in p for p in report.problems)
    assert any("size" in p for p in report.problems)
    snapsvc.save_checkpoint(tmp_path / "bare.fdl", {"w": torch.zeros(2)})
    assert not snapsvc.verify(tmp_path / "bare.fdl").ok
    assert snapsvc.verify(tmp_path / "bare.fdl", require_meta=False).ok

"""Ctrl-C or SIGTERM while a submit is blocked on the sidecar's socket (issue 30, item 4).

A WRITE larger than the socket buffer, sent while the sidecar is busy, blocks
in the send. A signal that arrives then must not cut the message: the
sidecar would read the next bytes as its body and the writer would wedge.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time

import pytest
import torch
from torch import nn

import snapsvc
from tests import hooks

BIG_EXTRA = "x" * (8 << 20)  # far larger than a Unix socket's buffer (~200 KiB)


def _signal_later(signum: int, delay: float) -> threading.Timer:
    t = threading.Timer(delay, os.kill, (os.getpid(), signum))
    t.start()
    return t


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum, exc", [(signal.SIGINT, KeyboardInterrupt),
                                         (signal.SIGTERM, SystemExit)])
def test_a_signal_during_a_blocked_submit_leaves_the_writer_working(tmp_path, no_leaks,
                                                                    signum, exc):
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    hook = functools.partial(hooks.hold, "GO", "first")  # the sidecar stays busy
    w = snapsvc.SnapshotWriter(tmp_path, slots=2, fault_hook=hook)
    try:
        first = w.submit(model, "first.fdl")
        timer = _signal_later(signum, 0.5)
        started = time.monotonic()
        with pytest.raises(exc):
            w.submit(model, "second.fdl", extra=BIG_EXTRA)
        timer.join()
        assert time.monotonic() - started < 30, "the signal was held back until the send ended"
        open(tmp_path / "GO", "w").close()
        first.result(timeout=60)
        expect = {k: v.clone() for k, v in model.state_dict().items()}
        w.submit(model, "third.fdl", extra="small").result(timeout=60)
        t0 = time.monotonic()
        w.close(timeout=60)
        assert time.monotonic() - t0 < 60
    finally:
        open(tmp_path / "GO", "w").close()
        w.close(timeout=10)
    for name in ("first.fdl", "third.fdl"):
        fresh = nn.Linear(64, 64)
        snapsvc.restore(str(tmp_path / name), fresh)
        for k, v in fresh.state_dict().items():
            assert torch.equal(v, expect[k]), (name, k)
    # the interrupted message went out whole: the sidecar wrote it, not garbage
    report = snapsvc.verify(str(tmp_path / "second.fdl"))
    assert report.ok, str(report)


_SCRIPT = """
import functools, sys
import torch
from torch import nn
sys.path.insert(0, {tests!r})
import hooks, snapsvc
torch.manual_seed(0)
model = nn.Linear(64, 64)
with snapsvc.SnapshotWriter({directory!r}, slots=2,
                            fault_hook=functools.partial(hooks.sleep, 1.5)) as w:
    w.submit(model, "first.fdl")
    print("busy", flush=True)
    w.submit(model, "second.fdl", extra="x" * (8 << 20))  # blocks: the sidecar is busy
    print("not interrupted", flush=True)
"""


@pytest.mark.timeout(120)
def test_sigterm_during_a_blocked_submit_still_drains_every_write(tmp_path):
    """The README's promise, as a training script meets it: SIGTERM while a
    large submit waits for the socket unwinds the ``with`` block, and close()
    writes both snapshots."""
    import subprocess
    import sys
    tests = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.Popen([sys.executable, "-c",
                             _SCRIPT.format(tests=tests, directory=str(tmp_path))],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "busy"
        time.sleep(0.5)  # the second submit is blocked in its send by now
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        out = proc.stdout.read()
    finally:
        proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()
    assert rc == 128 + signal.SIGTERM, out
    assert "not interrupted" not in out
    torch.manual_seed(0)
    expect = nn.Linear(64, 64).state_dict()
    for name in ("first.fdl", "second.fdl"):
        report = snapsvc.verify(str(tmp_path / name))
        assert report.ok, str(report)
        fresh = nn.Linear(64, 64)
        snapsvc.restore(str(tmp_path / name), fresh)
        for k, v in fresh.state_dict().items():
            assert torch.equal(v, expect[k]), (name, k)


def _sidecars() -> set[int]:
    """Pids of this process's sidecar children (their boot line names the worker)."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and b"snapsvc.sidecar.worker" in cmd:
            found.add(int(pid))
    return found


@pytest.mark.timeout(120)
def test_ctrl_c_while_the_sidecar_starts_leaves_no_process_and_a_later_submit_works(
        tmp_path, no_leaks):
    before = _sidecars()
    hook = functools.partial(hooks.pause, "start", "", 2.0)  # a slow start: READY comes late
    w = snapsvc.SnapshotWriter(tmp_path, fault_hook=hook)  # not started yet
    try:
        timer = _signal_later(signal.SIGINT, 0.3)
        with pytest.raises(KeyboardInterrupt):
            w.start()
        timer.join()
        assert _sidecars() == before, "the half-started sidecar was left running"
        w.submit(nn.Linear(4, 4), "after.fdl").result(timeout=60)
    finally:
        w.close(timeout=30)
    assert snapsvc.verify(str(tmp_path / "after.fdl")).ok


@pytest.mark.timeout(60)
def test_close_with_a_timeout_returns_while_an_interrupted_write_waits_for_a_hung_sidecar(
        tmp_path, no_leaks):
    """A Ctrl-C leaves its WRITE to the sender; a sidecar that never reads it
    (stopped) must not make close(timeout=) wait past its deadline for STOP."""
    w = snapsvc.SnapshotWriter(tmp_path, slots=2)
    try:
        w.submit(nn.Linear(4, 4), "before.fdl").result(timeout=60)
        os.kill(w.pid, signal.SIGSTOP)
        timer = _signal_later(signal.SIGINT, 0.5)
        with pytest.raises(KeyboardInterrupt):
            w.submit(nn.Linear(4, 4), "stuck.fdl", extra=BIG_EXTRA)
        timer.join()
        t0 = time.monotonic()
        w.close(timeout=2)
        assert time.monotonic() - t0 < 15, "close(timeout=2) waited for the hung sidecar"
    finally:
        w.close(timeout=5)
    assert snapsvc.verify(str(tmp_path / "before.fdl")).ok
    assert not (tmp_path / "stuck.fdl").exists()

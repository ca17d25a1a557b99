"""Fork- and callback-safety of the writer (issue 20, section 3).

A forked child never acts on its parent's writer: it cannot submit through
it, and neither its ``with`` block nor its exit handlers stop, drain or kill
the parent's sidecar. A done-callback cannot stop the thread that delivers
reports, whatever it raises, and a wait called from that thread (inside a
callback) fails at once instead of waiting for itself.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time

import pytest
from torch import nn

import snapsvc
import hooks

HERE = os.path.dirname(os.path.abspath(__file__))


SCENARIOS = [(mode, pending) for mode in ("fork", "dataloader") for pending in ("idle", "pending")]


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory) -> dict[tuple[str, str], tuple]:
    """fork_script.py's four scenarios, each with its own writer and directory, in one
    process (its start, torch's import, is most of each one's cost):
    {(mode, pending): (directory, what it printed)}."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (os.path.dirname(HERE), os.environ.get("PYTHONPATH")) if p)}
    dirs = {s: tmp_path_factory.mktemp("-".join(s)) for s in SCENARIOS}
    argv = [str(a) for s in SCENARIOS for a in (*s, dirs[s])]
    proc = subprocess.run([sys.executable, os.path.join(HERE, "fork_script.py"), *argv],
                          capture_output=True, text=True, timeout=170, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.strip().splitlines() if line.startswith("{")]
    assert len(lines) == len(SCENARIOS), proc.stdout[-3000:]
    return {s: (dirs[s], got) for s, got in zip(SCENARIOS, lines)}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("pending", ["idle", "pending"])
def test_a_forked_child_never_acts_on_the_parents_writer(scenarios, pending):
    tmp_path, got = scenarios["fork", pending]
    assert got["child_code"] == 0 and got["child_s"] < 10, got  # no drain of the parent's writes
    assert got["error"] is not None and got["error"]["snapsvc"], got  # a submit is refused
    assert "fork" in got["error"]["message"], got
    assert not (tmp_path / "child.fdl").exists()
    assert got.get("pending_ok", True) is True and got["after_ok"] is True, got
    assert got["same_sidecar"] and got["restarts"] == 0, got


@pytest.mark.timeout(180)
@pytest.mark.parametrize("pending", ["idle", "pending"])
def test_dataloader_workers_started_after_the_writer_leave_it_alone(scenarios, pending):
    _, got = scenarios["dataloader", pending]
    assert got["batches"] == 8, got
    assert got.get("pending_ok", True) is True and got["after_ok"] is True, got
    assert got["same_sidecar"] and got["restarts"] == 0, got


def raise_(exc: type[BaseException], handle: snapsvc.WriteHandle) -> None:
    raise exc()


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("no_leaks")
@pytest.mark.parametrize("exc", [SystemExit, KeyboardInterrupt, ValueError])
def test_a_raising_done_callback_does_not_stop_the_reports(tmp_path, exc):
    model = nn.Linear(4, 4)
    with snapsvc.SnapshotWriter(tmp_path, fault_hook=functools.partial(hooks.sleep, 0.5)) as w:
        first = w.submit(model, "a.fdl")
        first.add_done_callback(functools.partial(raise_, exc))  # runs on the reader thread
        assert first.result(timeout=60).bytes > 0
        # later handles still resolve, and close() returns
        assert w.submit(model, "b.fdl").result(timeout=30).bytes > 0
        w.finish(timeout=30)
        assert w.stats()["written"] == 2


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("no_leaks")
def test_a_wait_inside_a_done_callback_fails_at_once(tmp_path):
    model = nn.Linear(4, 4)
    seen: dict[str, object] = {}

    def waits(handle: snapsvc.WriteHandle) -> None:
        for name, call in (("wait_path", lambda: w.wait_path(second.path, timeout=5)),
                           ("result", lambda: second.result(timeout=5)),
                           ("exception", lambda: second.exception(timeout=5))):
            t0 = time.monotonic()
            try:
                call()
                seen[name] = "returned"
            except BaseException as e:  # noqa: BLE001
                seen[name] = (e, time.monotonic() - t0)

    with snapsvc.SnapshotWriter(tmp_path, fault_hook=functools.partial(hooks.sleep, 0.5)) as w:
        first = w.submit(model, "a.fdl")
        second = w.submit(model, "b.fdl")
        first.add_done_callback(waits)
        second.result(timeout=60)
    for name in ("wait_path", "result", "exception"):
        err, took = seen[name]
        assert isinstance(err, snapsvc.SnapsvcError) and isinstance(err, RuntimeError), (name, err)
        assert "done-callback" in str(err) and took < 1, (name, err, took)

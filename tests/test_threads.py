"""The client from many threads, bounded slot memory, and errors that do not depend on history."""

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
import hooks
from conftest import sidecar_children

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("no_leaks")]


def run_threads(n: int, target, timeout: float = 120.0) -> list:
    """Run ``target(i)`` on n threads; every one must finish within ``timeout``."""
    results: list = [None] * n

    def body(i: int) -> None:
        try:
            results[i] = target(i)
        except BaseException as e:  # noqa: BLE001 - reported below
            results[i] = e

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a submitting thread hung"
    return results


def test_two_threads_same_model_first_submit(tmp_path):
    model = nn.Linear(256, 256)
    with snapsvc.SnapshotWriter(tmp_path) as w:
        def submits(i: int) -> list:
            return [w.submit(model, f"t{i}-{k}.fdl").result(timeout=60) for k in range(20)]

        results = run_threads(2, submits)
        assert all(isinstance(r, list) and len(r) == 20 for r in results), results
        assert w.stats()["written"] == 40 and w.stats()["slots"] == 2
    for i in range(2):
        for k in range(20):
            assert snapsvc.verify(tmp_path / f"t{i}-{k}.fdl").ok


def test_two_threads_first_submit_unstarted_start_one_sidecar(tmp_path):
    model = nn.Linear(8, 8)
    w = snapsvc.SnapshotWriter(tmp_path)
    barrier = threading.Barrier(4)
    try:
        def first(i: int):
            barrier.wait()
            h = w.submit(model, f"u{i}.fdl")
            return w.pid, h.result(timeout=60)

        results = run_threads(4, first)
        assert not any(isinstance(r, BaseException) for r in results), results
        assert len({pid for pid, _ in results}) == 1
        assert sidecar_children() == [w.pid]
        assert w.stats()["restarts"] == 0 and w.stats()["written"] == 4
    finally:
        w.close()


def test_close_wakes_a_thread_waiting_for_a_slot(tmp_path):
    model = nn.Linear(8, 8)
    hook = functools.partial(hooks.sleep, 1.5)
    w = snapsvc.SnapshotWriter(tmp_path, slots=1, fault_hook=hook).start()
    first = w.submit(model, "a.fdl")  # the writer sleeps in it; the one slot stays busy

    results = []
    waiter = threading.Thread(target=lambda: results.append(_try(w.submit, model, "b.fdl")),
                              daemon=True)
    waiter.start()
    time.sleep(0.3)
    w.close(timeout=30)
    waiter.join(30)
    assert not waiter.is_alive()
    assert first.result(timeout=1).bytes > 0
    (r,) = results
    # either it got the slot after the first write and was written, or close() refused it
    assert isinstance(r, RuntimeError) and "closed" in str(r) or r.result(timeout=1).bytes > 0


def _try(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001
        return e


def test_submit_timeout_waiting_for_a_slot(tmp_path):
    model = nn.Linear(8, 8)
    with snapsvc.SnapshotWriter(tmp_path, slots=1,
                                fault_hook=functools.partial(hooks.sleep, 1.5)) as w:
        w.submit(model, "a.fdl")
        with pytest.raises(TimeoutError, match="no free slot"):
            w.submit(model, "b.fdl", timeout=0.2)
        assert w.submit(model, "c.fdl", timeout=30).result(timeout=30).bytes > 0  # not stranded


def test_stats_and_is_idle_from_other_threads_while_submitting(tmp_path):
    model = nn.Linear(64, 64)
    with snapsvc.SnapshotWriter(tmp_path) as w:
        stop = threading.Event()

        def poll(i: int) -> int:
            n = 0
            while not stop.is_set():
                w.stats()
                w.is_idle()
                n += 1
            return n

        pollers = [threading.Thread(target=poll, args=(i,), daemon=True) for i in range(2)]
        for t in pollers:
            t.start()
        handles = [w.submit(model, f"s{k}.fdl") for k in range(20)]
        for h in handles:
            h.result(timeout=60)
        stop.set()
        for t in pollers:
            t.join(10)
        assert w.stats()["written"] == 20


def _fds(pid: int | str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_slot_memory_and_fds_stay_flat_as_layouts_change(tmp_path):
    model = nn.Linear(1024, 1024)  # ~4 MiB
    with snapsvc.SnapshotWriter(tmp_path) as w:
        sizes, fds, child_fds = [], [], []
        for i in range(20):
            model.register_buffer("grow", torch.zeros(1 + i * 1000))  # a new layout each time
            w.submit(model, f"g{i}.fdl").result(timeout=60)
            sizes.append(w.stats()["slot_bytes"])
            fds.append(_fds())
            child_fds.append(_fds(w.pid))
        one_pool = 2 * (4 << 20)
        assert max(sizes) < 2 * one_pool + (1 << 20), sizes  # at most this pool and one more
        assert max(fds[2:]) <= fds[2] + 2, fds
        assert max(child_fds[2:]) <= child_fds[2] + 2, child_fds
        assert w.stats()["slots"] <= 4
    for i in range(20):
        assert snapsvc.verify(tmp_path / f"g{i}.fdl").ok


def test_max_slot_bytes_refuses_a_layout_that_cannot_fit(tmp_path):
    with snapsvc.SnapshotWriter(tmp_path, max_slot_bytes=1 << 20) as w:
        w.submit(nn.Linear(16, 16), "small.fdl").result(timeout=60)
        with pytest.raises(snapsvc.SlotBudgetError, match="max_slot_bytes") as info:
            w.submit(nn.Linear(1024, 1024), "big.fdl")
        assert isinstance(info.value, ValueError) and isinstance(info.value, snapsvc.SnapsvcError)
        assert w.is_idle() and w.stats()["slot_bytes"] <= 1 << 20


class _Plain(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)


@pytest.mark.parametrize("bad", ["sparse", "meta", "surrogate"])
@pytest.mark.parametrize("after_dense", [False, True])
def test_error_type_does_not_depend_on_history(tmp_path, bad, after_dense):
    with snapsvc.SnapshotWriter(tmp_path) as w:
        if after_dense:
            w.submit(_Plain(torch.eye(4)), "dense.fdl").result(timeout=60)
        if bad == "sparse":
            model = _Plain(torch.eye(4).to_sparse())
        elif bad == "meta":
            model = _Plain(torch.empty(4, 4, device="meta"))
        else:
            model = nn.Module()
            model.register_parameter("w\udcff", nn.Parameter(torch.eye(4)))
        with pytest.raises(snapsvc.EncodeError):
            w.submit(model, "bad.fdl")
        assert w.is_idle()


def test_keep_last_rotates_only_its_series(tmp_path):
    model = nn.Linear(4, 4)
    with snapsvc.SnapshotWriter(tmp_path, keep_last=2) as w:
        w.submit(model, "best.fdl").result(timeout=60)
        for step in range(1, 6):
            w.submit(model, f"step{step}.fdl").result(timeout=60)
        w.submit(model, "best.fdl").result(timeout=60)
    names = sorted(n for n in os.listdir(tmp_path) if n.endswith(".fdl"))
    assert names == ["best.fdl", "step4.fdl", "step5.fdl"]


def test_sigterm_handler_put_back_when_the_last_writer_closes(tmp_path):
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    a = snapsvc.SnapshotWriter(tmp_path).start()
    b = snapsvc.SnapshotWriter(tmp_path).start()
    assert signal.getsignal(signal.SIGTERM) != signal.SIG_DFL
    a.close()
    assert signal.getsignal(signal.SIGTERM) != signal.SIG_DFL  # b still needs it
    b.close()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_sidecar_that_exits_cleanly_on_its_own_is_restarted_not_waited_on(tmp_path):
    model = nn.Linear(8, 8)
    with snapsvc.SnapshotWriter(tmp_path) as w:
        w.submit(model, "a.fdl").result(timeout=60)
        first = w.pid
        w._sidecar.send(snapsvc.format.protocol.pack(snapsvc.format.protocol.STOP))  # exits 0, unasked
        assert w._sidecar.wait_exit(30)
        assert w.submit(model, "b.fdl").result(timeout=60).bytes > 0
        assert w.pid != first and w.stats()["restarts"] == 1

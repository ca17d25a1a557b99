"""The restart tier's bounded memory (issue 31): memory_limit / snapsvc serve --memory."""

from __future__ import annotations

import functools
import os

import pytest
import torch

import snapsvc
from snapsvc.files import ramtier

from tests import hooks

MiB = 1 << 20


def _state(seed: int, mib: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mib * 256, 1024, generator=g), "step": seed}


def _ram_bytes(directory) -> int:
    """The bytes of every RAM copy held for ``directory``."""
    ram = ramtier.ram_path(os.path.join(directory, "x"))
    if ram is None:
        return 0
    folder = os.path.dirname(ram)
    return sum(os.stat(os.path.join(folder, n)).st_size for n in os.listdir(folder))


@pytest.mark.timeout(60)
def test_a_snapshot_over_memory_limit_is_refused_before_a_slot_is_taken(tmp_path, no_leaks):
    with snapsvc.SnapshotWriter(tmp_path, memory_limit=MiB // 2) as w:
        with pytest.raises(snapsvc.MemoryLimitError,
                           match=r"2 slots of \d+ bytes.*memory_limit=524288; raise memory_limit"):
            w.submit(_state(1), "step1.fdl")
        assert w.stats()["slot_bytes"] == 0 and w.stats()["submitted"] == 0
    # memory-only: its two slots fit, the slots and its RAM copy do not
    with snapsvc.SnapshotWriter(tmp_path, memory_limit=3 * MiB) as w:
        assert not w.submit(_state(1), "step1.fdl").result(30).in_memory
        with pytest.raises(snapsvc.MemoryLimitError, match=r"memory-only snapshot needs \d+ "
                           r"bytes.*memory_limit=3145728; raise memory_limit to at least \d+, "
                           r"use fewer slots, or persist it"):
            w.submit(_state(2), "step2.fdl", persist=False)
        assert w.stats()["submitted"] == 1
        # a ValueError too, as SlotBudgetError is
        with pytest.raises(ValueError):
            w.submit(_state(2), "step2.fdl", persist=False)
    with pytest.raises(ValueError, match="memory_limit must be >= 1"):
        snapsvc.SnapshotWriter(tmp_path, memory_limit=0)


@pytest.mark.timeout(60)
def test_memory_limit_evicts_the_oldest_ram_copies_never_past_the_limit(tmp_path, no_leaks):
    limit = 4 * MiB  # one slot (1 MiB + room) and two RAM copies, not three
    with snapsvc.SnapshotWriter(tmp_path, slots=1, memory_limit=limit) as w:
        for i, name in enumerate(["a1.fdl", "b1.fdl", "c1.fdl", "b2.fdl", "d1.fdl"]):
            assert w.submit(_state(i), name, persist=False).result(30).in_memory
            assert w.stats()["slot_bytes"] + _ram_bytes(tmp_path) <= limit
        held = [n for n in ["a1.fdl", "b1.fdl", "c1.fdl", "b2.fdl", "d1.fdl"]
                if ramtier.held(tmp_path / n)]
        assert held == ["b2.fdl", "d1.fdl"]   # the oldest went first (b1: by its series)
        assert torch.equal(snapsvc.load(tmp_path / "d1.fdl")["w"], _state(4)["w"])
        with pytest.raises(FileNotFoundError):
            snapsvc.load(tmp_path / "a1.fdl")   # evicted: no disk copy either
        # a persisted snapshot is never evicted: it is on disk, and its RAM copies are not
        w.submit(_state(9), "e1.fdl").result(30)
        assert (tmp_path / "e1.fdl").exists() and ramtier.held(tmp_path / "d1.fdl")
    # without a limit the same sequence keeps every series' newest
    with snapsvc.SnapshotWriter(tmp_path / "free", slots=1) as w:
        for i, name in enumerate(["a1.fdl", "b1.fdl", "c1.fdl"]):
            w.submit(_state(i), name, persist=False).result(30)
        assert all(ramtier.held(tmp_path / "free" / n) for n in ["a1.fdl", "b1.fdl", "c1.fdl"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", ["latest", "skip", "block"])
def test_a_queued_persisted_snapshot_is_never_dropped_for_a_memory_only_one(tmp_path, policy):
    """Both slots busy: one being written (held 1.5 s), one persisted snapshot queued behind
    it. A memory-only submit then gets the policy; "latest" must not take back the
    persisted one (it waits instead), though it does take back a queued memory-only one."""
    hook = functools.partial(hooks.pause, "open", "slow", 1.5)
    with snapsvc.SnapshotWriter(tmp_path, slots=2, policy=policy, fault_hook=hook) as w:
        first = w.submit(_state(1), "slow1.fdl")
        queued = w.submit(_state(2), "step2.fdl")
        mem = w.submit(_state(3), "step3.fdl", persist=False)
        assert not queued.result(30).skipped
        assert not first.result(30).skipped
        assert (tmp_path / "step2.fdl").exists() and snapsvc.verify(tmp_path / "step2.fdl").ok
        if policy == "skip":
            assert mem.result(30).skipped and not ramtier.held(tmp_path / "step3.fdl")
        else:
            assert mem.result(30).in_memory and ramtier.held(tmp_path / "step3.fdl")
        if policy != "latest":
            return
        # the control: a queued memory-only snapshot is superseded by a newer one
        w.submit(_state(4), "slow4.fdl")
        older = w.submit(_state(5), "step5.fdl", persist=False)
        newer = w.submit(_state(6), "step6.fdl", persist=False)
        assert older.result(30).skipped and newer.result(30).in_memory


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", ["skip", "block"])
def test_memory_limit_taken_by_slots_in_flight_applies_the_policy(tmp_path, policy):
    """Another model's slot, busy writing, takes the room a memory-only copy needs: the
    policy applies (skip drops it, block waits for that write), never an error or a hang."""
    hook = functools.partial(hooks.pause, "open", "slow", 1.5)
    with snapsvc.SnapshotWriter(tmp_path, slots=1, policy=policy, fault_hook=hook,
                                memory_limit=6 * MiB) as w:
        w.submit(_state(0, mib=2), "big0.fdl").result(30)   # its 2 MiB slot, mapped
        slow = w.submit(_state(1, mib=3), "slow1.fdl")   # a 3 MiB slot, busy 1.5 s
        # the 2 MiB slot and a 2 MiB copy fit in 6 MiB, not beside the busy slot
        mem = w.submit(_state(2, mib=2), "big1.fdl", persist=False)
        if policy == "skip":
            assert mem.result(30).skipped and not slow.done()
        else:
            assert mem.result(30).in_memory and slow.done()
            assert torch.equal(snapsvc.load(tmp_path / "big1.fdl")["w"], _state(2, mib=2)["w"])
        assert not slow.result(30).skipped


@pytest.mark.timeout(90)
def test_serve_memory_bounds_its_trainers_and_its_ram_copies(tmp_path):
    """``snapsvc serve --memory``: a trainer without a limit of its own gets the service's
    (an over-limit snapshot is refused at submit); the service evicts its oldest RAM copies."""
    from tests.test_serve import _start

    service = _start(tmp_path, "--memory", str(4 * MiB))
    try:
        with snapsvc.SnapshotWriter(tmp_path, slots=1) as w:
            assert w.attached is not None and w.attached.pid == service.pid
            with pytest.raises(snapsvc.MemoryLimitError, match="memory_limit=4194304"):
                w.submit(_state(1, mib=4), "huge1.fdl")
            for i, name in enumerate(["a1.fdl", "b1.fdl", "c1.fdl"]):
                assert w.submit(_state(i), name, persist=False).result(30).in_memory
                assert w.stats()["slot_bytes"] + _ram_bytes(tmp_path) <= 4 * MiB
        # the trainer is gone; the service holds the two newest copies
        assert [n for n in ["a1.fdl", "b1.fdl", "c1.fdl"] if ramtier.held(tmp_path / n)] \
            == ["b1.fdl", "c1.fdl"]
        # a trainer's own lower limit applies to its session
        with snapsvc.SnapshotWriter(tmp_path, slots=1, memory_limit=3 * MiB) as w:
            w.submit(_state(5), "d1.fdl", persist=False).result(30)
            assert [n for n in ["b1.fdl", "c1.fdl", "d1.fdl"]
                    if ramtier.held(tmp_path / n)] == ["d1.fdl"]
    finally:
        service.terminate()
        service.communicate(timeout=30)
    assert ramtier.held(tmp_path / "d1.fdl") is None

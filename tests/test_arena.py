"""A slot is an arena of bytes: memory follows the layout's bytes, not its names.

A checkpoint whose names change at every save (Lightning's ``best_k_models``
is ``{path: tensor}``; a nested state whose keys change) must reuse the slots
it already has, whose pages are faulted in: the same shared-memory segments
stay mapped in the trainer and in the sidecar, slot memory and open fds
stay flat, nothing is left in /dev/shm (``no_leaks``), and every file still
equals its state at submit.
"""

from __future__ import annotations

import copy
import functools
import os
import threading

import pytest
import torch
from torch import nn

import hooks
import snapsvc
from test_state import assert_same

pytestmark = pytest.mark.timeout(300)


def _segments(pid: int | str = "self") -> set[str]:
    """The shared-memory segments mapped by ``pid`` (torch's are unlinked: '(deleted)')."""
    with open(f"/proc/{pid}/maps") as f:
        return {line.split(None, 5)[5].strip() for line in f
                if len(line.split(None, 5)) == 6 and "/dev/shm/" in line}


def _fds(pid: int | str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _expected(state: dict) -> dict:
    """What load() must return for ``state``, as of now."""
    out = {}
    for k, v in state.items():
        if isinstance(v, nn.Module):
            out[k] = {n: t.clone() for n, t in v.state_dict().items()}
        elif hasattr(v, "state_dict"):
            out[k] = copy.deepcopy(v.state_dict())
        else:
            out[k] = copy.deepcopy(v)
    return out


def _train_state(i: int, model: nn.Module, opt: torch.optim.Optimizer, sched, best: dict) -> dict:
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    sched.step()
    # save_top_k=2: the best two paths, one of which is new at every save
    best[f"epoch={i}-loss={1 / (i + 1):.4f}.ckpt"] = torch.tensor(1 / (i + 1))
    while len(best) > 2:
        best.pop(next(iter(best)))
    return {"model": model, "opt": opt, "sched": sched,
            "loops": {"step": i, "best_k": dict(best), "last": f"epoch={i}.ckpt"}}


def test_memory_stays_flat_as_names_change_at_every_save(tmp_path, no_leaks):
    """100 saves, names changing at each, each written before the next (as
    a trainer whose save interval is longer than a write): after the first
    layouts (one, then two best-k entries) no new segment is ever mapped."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    best: dict = {}
    wanted: dict[str, dict] = {}
    handles = []
    warm_up = 10
    with snapsvc.SnapshotWriter(tmp_path, slots=2) as w:
        figures = []
        for i in range(100):
            state = _train_state(i, model, opt, sched, best)
            wanted[f"s{i}.fdl"] = _expected(state)
            handles.append(w.submit(state, f"s{i}.fdl", timeout=60))
            handles[-1].result(timeout=60)
            stats = w.stats()
            figures.append((stats["slot_bytes"], stats["slots"], _fds(), _fds(w.pid),
                            _segments(), _segments(w.pid)))
        warm = figures[:warm_up]
        most = [max(f[k] for f in warm) for k in range(4)]
        seen = [set().union(*(f[k] for f in warm)) for k in (4, 5)]
        for i, (slot_bytes, slots, fds, child_fds, mine, theirs) in \
                enumerate(figures[warm_up:], warm_up):
            assert slot_bytes <= most[0] and slots <= most[1], (i, slot_bytes, slots, most)
            assert fds <= most[2] + 2 and child_fds <= most[3] + 2, (i, fds, child_fds, most)
            # the same arenas: no fresh shared memory faulted in during the stall
            assert mine <= seen[0] and theirs <= seen[1], (i, mine - seen[0], theirs - seen[1])
        assert most[1] == 2, most  # one pool of two slots all along
    for h in handles:
        report = h.result(timeout=0)
        assert_same(snapsvc.load(report.path), wanted[os.path.basename(report.path)],
                    os.path.basename(report.path))


def test_a_grown_state_takes_a_new_arena_and_the_old_one_goes(tmp_path, no_leaks):
    """Past an arena's room, a larger state gets new slots; the idle ones are freed."""
    small = {"w": torch.ones(1000)}
    with snapsvc.SnapshotWriter(tmp_path, slots=1) as w:
        w.submit(small, "a.fdl").result(timeout=60)
        before = w.stats()["slot_bytes"]
        big = {"w": torch.ones(1000), "x": torch.full((1 << 18,), 2.0)}  # 1 MiB more
        w.submit(big, "b.fdl").result(timeout=60)
        assert w.stats()["slots"] == 1 and w.stats()["slot_bytes"] > before
        w.submit({"renamed": torch.ones(1000)}, "c.fdl").result(timeout=60)
        assert w.stats()["slots"] == 1  # fits in the big arena: no new one
    assert_same(snapsvc.load(tmp_path / "b.fdl"), big)
    assert_same(snapsvc.load(tmp_path / "c.fdl"), {"renamed": torch.ones(1000)})


def test_names_that_alternate_reuse_the_sidecars_headers_and_stay_right(tmp_path, no_leaks):
    """Layouts A, B, A, B...: the sidecar's encoder of each is kept and picked
    again by the layout each WRITE names; every file has its own names."""
    with snapsvc.SnapshotWriter(tmp_path, slots=1) as w:
        for i in range(6):
            state = {("best" if i % 2 else "last"): torch.full((3, 5), float(i)), "i": i}
            w.submit(state, f"a{i}.fdl").result(timeout=60)
            assert_same(snapsvc.load(tmp_path / f"a{i}.fdl"), state)
        assert w.stats()["slots"] == 1


def test_names_that_change_while_a_write_is_queued_take_its_pools_idle_slot(tmp_path, no_leaks):
    """A save whose names are new while the last one is still being written (saves
    that pile up) takes the idle slot of the busy pool, faulted in and mapped by
    the sidecar already: no new memory, and no wait for the sidecar to map any
    (which it would do only after the write in progress)."""
    with snapsvc.SnapshotWriter(tmp_path, slots=2,
                                fault_hook=functools.partial(hooks.pause, "open", "held", 3.0)) as w:
        w.submit({"x": torch.ones(4096)}, "warm.fdl").result(timeout=60)
        before = w.stats()
        held = w.submit({"a": torch.full((4096,), 2.0)}, "held.fdl")  # the sidecar holds it
        renamed = {"b": torch.full((4096,), 3.0)}
        queued = w.submit(renamed, "b.fdl")   # written after the held one
        assert not held.done()   # this submit did not wait for the write in progress
        stats = w.stats()
        assert (stats["slots"], stats["slot_bytes"]) == (before["slots"], before["slot_bytes"])
        # the same names again while both are queued: that pool of one slot, all
        # busy, takes the held write's busy slot, not new memory, and "block" waits
        again = w.submit(renamed, "b2.fdl")
        stats = w.stats()
        assert (stats["slots"], stats["slot_bytes"]) == (before["slots"], before["slot_bytes"])
        for h in (held, queued, again):
            h.result(timeout=60)
        w.submit({"d": torch.full((4096,), 5.0)}, "d.fdl").result(timeout=60)
        assert w.stats()["slots"] <= 2, w.stats()   # the others went once idle
    assert_same(snapsvc.load(tmp_path / "held.fdl"), {"a": torch.full((4096,), 2.0)})
    assert_same(snapsvc.load(tmp_path / "b.fdl"), renamed)
    assert_same(snapsvc.load(tmp_path / "b2.fdl"), renamed)
    assert_same(snapsvc.load(tmp_path / "d.fdl"), {"d": torch.full((4096,), 5.0)})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["block", "skip", "latest"])
def test_names_that_change_while_every_slot_is_busy_take_a_slot_by_the_policy(
        tmp_path, policy, no_leaks):
    """Saves whose names change at each while both slots are still queued or being
    written (Lightning's save_top_k under backpressure): the third is a full pool's
    submit, in the arenas that exist, as if its names had not changed: "block" waits
    for one (up to its timeout), "skip" skips, "latest" takes back the newest queued.
    Never new memory, which the sidecar would map only after the writes queued before
    it. A layout larger than every arena still gets new memory."""
    hold = functools.partial(hooks.hold, "GO", "held")
    with snapsvc.SnapshotWriter(tmp_path, slots=2, policy=policy, fault_hook=hold) as w:
        try:
            w.submit({"x": torch.ones(4096)}, "warm.fdl").result(timeout=60)
            flat = (w.stats()["slots"], w.stats()["slot_bytes"])
            states = {n: {f"best_k/{n}.ckpt": torch.full((4096,), float(i)), "step": i}
                      for i, n in enumerate(("held", "b", "c"))}
            wanted = {n: _expected(s) for n, s in states.items()}
            handles = {}
            for n in ("held", "b"):
                handles[n] = w.submit(states[n], f"{n}.fdl")   # "held" stays in the sidecar
            if policy == "block":
                with pytest.raises(TimeoutError, match="no free slot"):
                    w.submit(states["c"], "c.fdl", timeout=0.3)
            else:
                handles["c"] = w.submit(states["c"], "c.fdl")
                gone = "c" if policy == "skip" else "b"
                assert handles[gone].done() and handles[gone].result().skipped
            assert (w.stats()["slots"], w.stats()["slot_bytes"]) == flat, w.stats()
            for s in states.values():   # the files hold the states of their submits
                next(iter(s.values())).add_(100)
            # the new arenas' SLOT message is read after the held write: let it go meanwhile
            threading.Timer(0.3, (tmp_path / "GO").touch).start()
            big = {"big": torch.full((1 << 18,), 7.0)}   # 1 MiB: past every arena's room
            w.submit(big, "big.fdl", timeout=60).result(timeout=60)
            assert w.stats()["slot_bytes"] > flat[1], w.stats()
            if policy == "block":   # a slot is free now: taken, laid out for these names
                wanted["c"] = _expected(states["c"])
                handles["c"] = w.submit(states["c"], "c.fdl", timeout=60)
            for h in handles.values():
                h.result(timeout=60)
        finally:  # a failed assert must not leave the write held until close's timeout
            (tmp_path / "GO").touch()
    written = {"block": ("held", "b", "c"), "skip": ("held", "b"), "latest": ("held", "c")}
    for n in ("held", "b", "c"):
        assert (tmp_path / f"{n}.fdl").exists() == (n in written[policy]), n
        if n in written[policy]:
            assert_same(snapsvc.load(tmp_path / f"{n}.fdl"), wanted[n], n)
    assert_same(snapsvc.load(tmp_path / "big.fdl"), big)


@pytest.mark.timeout(120)
def test_latest_never_supersedes_another_models_queued_write(tmp_path, no_leaks):
    """"latest" takes back a queued snapshot of the same checkpoint (its layout, or one
    placed like it: names changed), never one of another shape that merely fits in its
    arena: that submit waits for a slot, and every file is written."""
    hold = functools.partial(hooks.hold, "GO", "held")
    with snapsvc.SnapshotWriter(tmp_path, slots=2, policy="latest", fault_hook=hold) as w:
        try:
            w.submit({"x": torch.ones(4096)}, "warm.fdl").result(timeout=60)
            handles = [w.submit({f"{n}/x": torch.full((4096,), float(i))}, f"{n}.fdl")
                       for i, n in enumerate(("held", "b"))]
            other = {"y": torch.full((1024,), 3.0), "z": torch.arange(512)}  # fits, other shape
            with pytest.raises(TimeoutError, match="no free slot"):
                w.submit(other, "other.fdl", timeout=0.3)
            assert not handles[1].done()   # b was not taken back
        finally:
            (tmp_path / "GO").touch()
        for h in handles:
            assert not h.result(timeout=60).skipped
        w.submit(other, "other.fdl", timeout=60).result(timeout=60)
    assert_same(snapsvc.load(tmp_path / "b.fdl"), {"b/x": torch.full((4096,), 1.0)})
    assert_same(snapsvc.load(tmp_path / "other.fdl"), other)

"""SnapsvcStorageWriter's kept stage plan (issue 33): reused while the state is as it was, and
made again at each change ``state_dict()`` would show. Each change saves the state through
``dcp.async_save`` (the writer as its stager), checks that the plan was made again, loads it
back and compares it with the live values, and compares the manifest's shapes, dtypes and
placements with the live tensors': a kept plan that wrongly held would save the old keys,
geometry or placements (a stride, ``requires_grad``, an int key for its str or a mapping's kind
change no byte that DCP reads back: the plan count alone shows those)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from snapsvc.dcp import SnapsvcStorageReader, SnapsvcStorageWriter
from snapsvc.distributed.manifest import read_manifest


def _dt(t: torch.Tensor, placement=None):
    return distribute_tensor(t, init_device_mesh("cpu", (1,)), [placement or Shard(0)])


def _values(n: int = 24, dtype=torch.float32) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float64) / 3 + 1e-9).to(dtype)


# each: (the state saved twice, the state after one change); made inside the test (DTensors
# need the process group)
CHANGES = {
    "key renamed": lambda: ({"m": {"a": _values(), "b": _values()}},
                            {"m": {"a": _values(), "c": _values() * 2}}),
    "key added": lambda: ({"m": {"a": _values()}}, {"m": {"a": _values(), "b": _values() * 2}}),
    "key removed": lambda: ({"m": {"a": _values(), "b": _values()}}, {"m": {"a": _values() * 2}}),
    "int key for str key": lambda: ({"s": {0: _values()}}, {"s": {"0": _values() * 2}}),
    "mapping kind": lambda: ({"m": {"a": _values()}}, {"m": OrderedDict(a=_values() * 2)}),
    "shape": lambda: ({"w": _values().reshape(4, 6)}, {"w": _values().reshape(6, 4) * 2}),
    "dtype": lambda: ({"w": _values()}, {"w": _values(dtype=torch.float64)}),
    "strides": lambda: ({"w": _values(36).reshape(6, 6)},
                        {"w": _values(36).reshape(6, 6).t() * 2}),
    "requires_grad": lambda: ({"w": _values()}, {"w": _values().requires_grad_()}),
    "tensor to plain value": lambda: ({"x": _values(), "w": _values()},
                                      {"x": 2.5, "w": _values()}),
    "plain value to tensor": lambda: ({"x": 2.5, "w": _values()},
                                      {"x": _values() * 2, "w": _values()}),
    "list walked into": lambda: ({"l": [1, 2], "w": _values()},
                                 {"l": [1, _values() * 2], "w": _values()}),
    "DTensor placements": lambda: ({"w": _dt(_values(36).reshape(6, 6))},
                                   {"w": _dt(_values(36).reshape(6, 6) * 2, Shard(1))}),
    "DTensor to Replicate": lambda: ({"w": _dt(_values(36).reshape(6, 6))},
                                     {"w": _dt(_values(36).reshape(6, 6) * 2, Replicate())}),
    "DTensor local shape": lambda: ({"w": _dt(_values(36).reshape(6, 6))},
                                    {"w": _dt(_values(24).reshape(4, 6) * 2)}),
    "DTensor for tensor": lambda: ({"w": _values(36).reshape(6, 6)},
                                   {"w": _dt(_values(36).reshape(6, 6) * 2)}),
}


def _zeroed(v):
    if isinstance(v, torch.Tensor):
        z = v.detach().clone()
        (z.to_local() if hasattr(z, "to_local") else z).zero_()
        return z
    if isinstance(v, dict):
        return type(v)((k, _zeroed(x)) for k, x in v.items())
    if isinstance(v, list):
        return [_zeroed(x) for x in v]
    return None


def _same(got, want) -> bool:
    if isinstance(want, torch.Tensor):
        local = (lambda t: t.to_local() if hasattr(t, "to_local") else t)
        return (isinstance(got, torch.Tensor) and got.dtype == want.dtype
                and torch.equal(local(got), local(want).detach()))
    if isinstance(want, dict):
        return list(got) == list(want) and all(_same(got[k], want[k]) for k in want)
    if isinstance(want, list):
        return len(got) == len(want) and all(map(_same, got, want))
    return got == want


def _tensors(v) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    values = v.values() if isinstance(v, dict) else v if isinstance(v, list) else ()
    return [t for x in values for t in _tensors(x)]


def _recorded(step) -> list:
    """(shape, dtype, placements) of each tensor the step's manifest lists."""
    m = read_manifest(step)
    return sorted((r["shape"], r["dtype"], r["placements"]) for r in m.ranks[0].entries)


def _live(state) -> list:
    def placements(t):
        return [f"S{p.dim}" if isinstance(p, Shard) else "R" for p in t.placements] \
            if hasattr(t, "placements") else None
    return sorted((list(t.shape), str(t.dtype).removeprefix("torch."), placements(t))
                  for t in _tensors(state))


def _save(w: SnapsvcStorageWriter, state: dict, root, step: int) -> None:
    dcp.async_save(state, storage_writer=w,
                   checkpoint_id=root / f"step_{step}").result(timeout=60)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("change", list(CHANGES))
def test_kept_stage_plan_is_made_again_at_each_change(world1, tmp_path, change):
    before, after = CHANGES[change]()
    root = tmp_path / "ckpt"
    w = SnapsvcStorageWriter(root / "step_1", coord_timeout=60)
    try:
        _save(w, before, root, 1)
        _save(w, before, root, 2)
        assert w._plan.planned == 1      # the second stage kept the first one's plan
        _save(w, after, root, 3)
        assert w._plan.planned == 2, f"{change}: the kept plan was reused"
    finally:
        w.close()
    got = _zeroed(after)
    dcp.load(got, storage_reader=SnapsvcStorageReader(root / "step_3"))
    assert _same(got, after), (got, after)
    assert _recorded(root / "step_3") == _live(after)   # shapes, dtypes, placements


@pytest.mark.timeout(120)
def test_kept_stage_plan_copies_the_tensors_and_plain_values_of_now(world1, tmp_path):
    """A kept plan: new tensor objects of the same geometry (state_dict() makes new ones each
    call), their values, new plain values, and a DTensor's new local tensor are all saved."""
    root = tmp_path / "ckpt"
    dtensor = _dt(_values(36).reshape(6, 6))

    def state(scale: float, lr: float) -> dict:
        return {"model": {"a": _values() * scale, "w": dtensor},
                "optim": {"state": {0: {"step": torch.tensor(scale), "exp_avg": _values() + scale}},
                          "param_groups": [{"lr": lr, "betas": (0.9, scale), "params": [0]}]}}
    w = SnapsvcStorageWriter(root / "step_1", coord_timeout=60)
    try:
        _save(w, {**state(1.0, 0.1), "phase": "start"}, root, 1)
        dtensor._local_tensor = dtensor._local_tensor * 5   # as FSDP2's load_state_dict does
        last = state(3.0, 0.05)
        last["phase"] = "warmup"
        _save(w, last, root, 2)
        last["phase"] = "train"
        _save(w, last, root, 3)
        _save(w, last, root, 4)   # nothing changed since: the values of step 3, not step 1's
        assert w._plan.planned == 1
    finally:
        w.close()
    for step, phase in ((2, "warmup"), (3, "train"), (4, "train")):
        got = _zeroed(last)
        got["optim"]["param_groups"] = [{"lr": 0.0, "betas": (0.0, 0.0), "params": []}]
        got["phase"] = ""
        dcp.load(got, storage_reader=SnapsvcStorageReader(root / f"step_{step}"))
        assert _same(got["model"], last["model"]) and _same(got["optim"]["state"],
                                                            last["optim"]["state"])
        assert got["optim"]["param_groups"][0]["lr"] == 0.05, step
        assert tuple(got["optim"]["param_groups"][0]["betas"]) == (0.9, 3.0), step
        assert got["phase"] == phase, step


@pytest.mark.timeout(120)
def test_kept_stage_plan_keeps_no_tensor_of_the_state_alive(world1, tmp_path):
    """The plan outlives the state it was made from: the state's tensors (here, what a
    replaced model held) are freed as they would be without it."""
    import gc
    import weakref
    root = tmp_path / "ckpt"
    state = {"model": {"a": _values(), "w": _dt(_values(36).reshape(6, 6))}}
    refs = [weakref.ref(state["model"]["a"]), weakref.ref(state["model"]["w"]._local_tensor)]
    w = SnapsvcStorageWriter(root / "step_1", coord_timeout=60)
    try:
        _save(w, state, root, 1)
        del state
        gc.collect()
        assert [r() for r in refs] == [None, None]
        assert w._plan._kept is not None   # the plan itself is still kept
    finally:
        w.close()


@pytest.mark.timeout(120)
def test_two_copies_staged_under_one_kept_plan_each_write_their_own_values(world1, tmp_path):
    """A kept plan's staged states share their placeholders (one carries the ticket): two
    copies held at once (``slots=2``) still write each its own slot's values."""
    root = tmp_path / "ckpt"
    state = {"m": {"a": _values(), "b": _values(36).reshape(6, 6)}, "lr": 0.1}
    w = SnapsvcStorageWriter(root / "step_1", coord_timeout=60)
    try:
        _save(w, state, root, 1)
        first = w.stage(state)
        want_first = {"m": {k: v.clone() for k, v in state["m"].items()}, "lr": 0.1}
        with torch.no_grad():
            state["m"]["a"].mul_(2)
            state["m"]["b"].add_(1)
        state["lr"] = 0.05
        second = w.stage(state)
        assert w._plan.planned == 1
        dcp.save(first, storage_writer=w, checkpoint_id=root / "step_2")
        dcp.save(second, storage_writer=w, checkpoint_id=root / "step_3")
    finally:
        w.close()
    for step, want in ((2, want_first), (3, state)):
        got = {"m": _zeroed(state["m"]), "lr": 0.0}
        dcp.load(got, storage_reader=SnapsvcStorageReader(root / f"step_{step}"))
        assert _same(got, want), (step, got, want)

"""Nested training state through the sidecar: submit(state), load, restore, refusals."""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch import nn

import snapsvc
from snapsvc.errors import EncodeError, SnapsvcError, UnsupportedStateError

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("no_leaks")]


def make_gan(seed: int):
    torch.manual_seed(seed)
    gen = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))
    disc = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 1))
    opt_g = torch.optim.AdamW(gen.parameters(), lr=1e-3, betas=(0.5, 0.9))
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt_g, step_size=2, gamma=0.5)
    return gen, disc, opt_g, opt_d, sched


def train(gen, disc, opt_g, opt_d, sched, steps: int = 3) -> None:
    for _ in range(steps):
        loss = disc(gen(torch.randn(16, 4))).mean()
        opt_g.zero_grad()
        opt_d.zero_grad()
        loss.backward()
        opt_g.step()
        opt_d.step()
        sched.step()


def live_state(gen, disc, opt_g, opt_d, sched) -> dict:
    return {"model": gen, "disc": disc, "opt_g": opt_g, "opt_d": opt_d, "sched": sched,
            "rng": torch.get_rng_state(), "py_rng": random.getstate(),
            "step": torch.tensor(7), "ema": {0: torch.ones(3), 1: torch.zeros(3)},
            "hist": {1: 0.5, 2: float("nan"), "inf": float("-inf")},
            "loader": {"epoch": 2, "batch": 17, "order": (3, 1, 2), "tag": b"\x00\xff",
                       "none": None, "flag": True, "weird/key": [1, [2, (3,)]],
                       "#hash": "str"}}


def snapshot_values(state: dict) -> dict:
    """Clones of every value, as load() should return them."""
    def sd(x):
        return {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                for k, v in x.items()}
    out = {"model": {k: v.clone() for k, v in state["model"].state_dict().items()},
           "disc": {k: v.clone() for k, v in state["disc"].state_dict().items()},
           "sched": dict(state["sched"].state_dict())}
    for name in ("opt_g", "opt_d"):
        o = state[name].state_dict()
        out[name] = {"state": {i: sd(s) for i, s in o["state"].items()},
                     "param_groups": o["param_groups"]}
    return out


def assert_same(a, b, path="state"):
    """Exact equality, types included: dict key types, tuple vs list, NaN, tensor dtype."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b) and [type(k) for k in a] == [type(k) for k in b], path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, path


def test_nested_state_roundtrip_exact_and_snapshot_semantics(tmp_path):
    objs = make_gan(0)
    train(*objs)
    state = live_state(*objs)
    before = snapshot_values(state)
    plain = {k: state[k] for k in ("rng", "py_rng", "step", "ema", "hist", "loader")}
    plain = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in plain.items()}
    plain["ema"] = {k: v.clone() for k, v in state["ema"].items()}
    with snapsvc.SnapshotWriter(tmp_path) as w:
        handle = w.submit(state, "gan.fdl", metrics={"loss": 0.5}, epoch=3)
        train(*objs)  # at once: nothing of this may reach the file
        state["ema"][0].add_(5)
        state["step"].add_(1)
        report = handle.result(timeout=60)
    assert report.bytes > 0 and not report.skipped
    loaded = snapsvc.load(tmp_path / "gan.fdl")
    assert list(loaded) == list(state)
    for key in before:
        assert_same(loaded[key], before[key], key)
    for key in plain:
        assert_same(loaded[key], plain[key], key)
    assert loaded["rng"].dtype == torch.uint8  # in the data file: .fdl has no uint8
    assert snapsvc.verify(tmp_path / "gan.fdl").ok


def test_restore_into_fresh_objects_is_bit_exact(tmp_path):
    objs = make_gan(0)
    train(*objs)
    state = live_state(*objs)
    with snapsvc.SnapshotWriter(tmp_path) as w:
        w.submit(state, "gan.fdl", epoch=4).result(timeout=60)
    fresh = make_gan(1)
    target = live_state(*fresh)
    target["step"], target["ema"] = torch.tensor(0), {0: torch.zeros(3), 1: torch.ones(3)}
    report = snapsvc.restore(tmp_path / "gan.fdl", target, strict=True)
    assert report.epoch == 4 and not report.skipped and not report.missing
    assert set(report.restored) >= {"model", "disc", "opt_g", "opt_d", "sched"}
    assert_same(snapshot_values(target), snapshot_values(state))
    assert torch.equal(target["step"], torch.tensor(7))
    assert torch.equal(target["ema"][0], torch.ones(3))
    assert report.state["hist"][1] == 0.5 and report.state["loader"]["order"] == (3, 1, 2)
    # training goes on identically from both
    torch.manual_seed(5)
    train(*objs, steps=2)
    torch.manual_seed(5)
    train(*fresh, steps=2)
    for a, b in zip(objs[0].state_dict().values(), fresh[0].state_dict().values()):
        assert torch.equal(a, b)


def test_restore_checks_everything_before_changing_anything(tmp_path):
    objs = make_gan(0)
    train(*objs)
    with snapsvc.SnapshotWriter(tmp_path) as w:
        w.submit(live_state(*objs), "gan.fdl").result(timeout=60)
    fresh = make_gan(1)
    target = live_state(*fresh)
    target["opt_d"] = torch.optim.SGD([*fresh[1].parameters()][:2], lr=0.1)  # fewer params
    before = {k: v.clone() for k, v in fresh[0].state_dict().items()}
    sched_before = dict(fresh[4].state_dict())
    with pytest.raises(snapsvc.ArchitectureMismatchError, match="opt_d"):
        snapsvc.restore(tmp_path / "gan.fdl", target)
    for k, v in fresh[0].state_dict().items():
        assert torch.equal(v, before[k]), k
    assert fresh[4].state_dict() == sched_before
    target = live_state(*fresh)
    target["step"] = torch.zeros(2)  # shape differs
    with pytest.raises(snapsvc.ShapeMismatchError, match=r"state\['step'\]"):
        snapsvc.restore(tmp_path / "gan.fdl", target)
    assert all(torch.equal(v, before[k]) for k, v in fresh[0].state_dict().items())


def test_model_keeps_its_own_names_so_flodl_loads_it(tmp_path):
    objs = make_gan(0)
    gen = objs[0]
    with snapsvc.SnapshotWriter(tmp_path) as w:
        w.submit({"opt": objs[2], "model": gen, "rng": torch.get_rng_state()},
                 "s.fdl").result(timeout=60)
    names = snapsvc.checkpoint_keys(tmp_path / "s.fdl")
    model_names = [n for n, _ in snapsvc.files.checkpoint.model_tensors(gen)]
    assert names[:len(model_names)] == model_names  # first, in flodl's order
    assert all(n.startswith("opt/") for n in names[len(model_names):])
    ckpt = snapsvc.read_checkpoint(tmp_path / "s.fdl")
    assert ckpt.structural_hash == snapsvc.structural_hash(gen)
    fresh = make_gan(1)[0]
    report = snapsvc.load_checkpoint(tmp_path / "s.fdl", fresh)  # flodl's rules
    assert report.loaded == model_names and not report.missing
    for a, b in zip(gen.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)


def test_entry_names_escape_keys_and_mark_ints(tmp_path):
    state = {"a/b": torch.ones(1), "#1": torch.ones(1), 1: torch.ones(1), "l": [torch.ones(1)],
             "100%": torch.ones(1)}
    with snapsvc.SnapshotWriter(tmp_path) as w:
        w.submit(state, "n.fdl").result(timeout=60)
    assert snapsvc.checkpoint_keys(tmp_path / "n.fdl") == ["a%2Fb", "%231", "#1", "l/#0",
                                                         "100%25"]
    assert list(snapsvc.load(tmp_path / "n.fdl")) == ["a/b", "#1", 1, "l", "100%"]


class _Thing:
    pass


def _cycle():
    d: dict = {"x": 1}
    d["self"] = d
    return d


@pytest.mark.parametrize("value, where", [
    (lambda: 1, "state['bad']"),
    (_Thing(), "state['bad']"),
    ({1, 2}, "state['bad']"),
    ({"deep": [0, {"s": frozenset()}]}, "state['bad']['deep'][1]['s']"),
    (torch.eye(2).to_sparse(), "state['bad']"),
    (torch.empty(2, device="meta"), "state['bad']"),
    ({2.5: 1}, "state['bad'][2.5]"),
    ({(1, 2): 1}, "state['bad'][(1, 2)]"),
    (_cycle(), "state['bad']['self']"),
    (bytearray(b"x"), "state['bad']"),
])
def test_refused_values_name_their_path_and_take_no_slot(tmp_path, value, where):
    with snapsvc.SnapshotWriter(tmp_path) as w:
        with pytest.raises(UnsupportedStateError) as info:
            w.submit({"ok": torch.ones(2), "bad": value}, "r.fdl")
        assert isinstance(info.value, TypeError) and isinstance(info.value, SnapsvcError)
        assert str(info.value).startswith(where + ":"), str(info.value)
        assert w.is_idle() and w.stats()["slot_bytes"] == 0
        w.submit({"ok": torch.ones(2)}, "fine.fdl").result(timeout=60)  # still serving
    assert not (tmp_path / "r.fdl").exists()


def test_int_keys_in_extra_round_trip_and_never_kill_the_sidecar(tmp_path, net):
    extra = {"hist": {1: 0.5, 2: (1, 2)}, 3: [b"x", None], "ids": [2 ** 64 - 1, -(2 ** 63), 0]}
    with snapsvc.SnapshotWriter(tmp_path) as w:
        pid = w.pid
        w.submit(net, "a.fdl", extra=extra).result(timeout=60)
        w.submit(net, "b.fdl").result(timeout=60)
        assert w.pid == pid and w.stats()["restarts"] == 0
    assert snapsvc.restore(tmp_path / "a.fdl", net).extra == extra


@pytest.mark.parametrize("kwargs, error", [
    ({"epoch": 2 ** 64}, EncodeError),
    ({"extra": {"blob": bytes(65 << 20)}}, EncodeError),
    ({"extra": {"s": "\udcff"}}, EncodeError),
    ({"extra": {"big": 2 ** 70}}, EncodeError),
    ({"extra": {2 ** 70: "big key"}}, EncodeError),
    # a list of ints alone is checked in one pass (issue 34): its bounds still hold
    ({"extra": {"ids": [1, 2, 2 ** 64]}}, EncodeError),
    ({"extra": {"ids": (-(2 ** 63) - 1, 0)}}, EncodeError),
])
def test_bad_values_fail_before_a_slot_is_taken(tmp_path, net, kwargs, error):
    with snapsvc.SnapshotWriter(tmp_path, slots=1) as w:
        with pytest.raises(error) as info:
            w.submit(net, "x.fdl", **kwargs)
        assert isinstance(info.value, ValueError) and isinstance(info.value, SnapsvcError)
        assert w.is_idle()
        # the single slot is free: this would block forever otherwise
        w.submit(net, "y.fdl").result(timeout=60)
    assert not (tmp_path / "x.fdl").exists()


def test_overlap_mode_state_never_mixes_steps(tmp_path):
    objs = make_gan(0)
    gen, disc, opt_g, opt_d, sched = objs
    with snapsvc.SnapshotWriter(tmp_path, overlap=True) as w:
        w.guard(opt_g)
        w.guard(opt_d)
        handles, expected = [], []
        for i in range(5):
            loss = disc(gen(torch.randn(16, 4))).mean()
            opt_g.zero_grad()
            opt_d.zero_grad()
            loss.backward()
            state = {"model": gen, "disc": disc, "opt_g": opt_g, "opt_d": opt_d}
            expected.append(snapshot_values({**state, "sched": sched}))
            handles.append(w.submit(state, f"o{i}.fdl"))
            opt_g.step()  # waits for the copy through the guard
            opt_d.step()
        for h in handles:
            h.result(timeout=60)
    for i, want in enumerate(expected):
        got = snapsvc.load(tmp_path / f"o{i}.fdl")
        for key in ("model", "disc", "opt_g", "opt_d"):
            assert_same(got[key], want[key], f"o{i}[{key}]")


def test_a_corrupt_state_file_is_refused_and_nothing_changes(tmp_path):
    objs = make_gan(0)
    train(*objs)
    with snapsvc.SnapshotWriter(tmp_path) as w:
        w.submit(live_state(*objs), "gan.fdl").result(timeout=60)
    data = bytearray((tmp_path / "gan.fdl").read_bytes())
    data[-3] ^= 0x01  # a data byte of the last entry
    (tmp_path / "gan.fdl").write_bytes(data)
    with pytest.raises(snapsvc.FormatError, match="CRC-32"):
        snapsvc.load(tmp_path / "gan.fdl")
    fresh = make_gan(1)
    target = live_state(*fresh)
    before = snapshot_values(target)
    with pytest.raises(snapsvc.FormatError, match="CRC-32"):
        snapsvc.restore(tmp_path / "gan.fdl", target)
    assert_same(snapshot_values(target), before)


def test_every_corrupt_byte_of_the_metadata_is_refused(tmp_path):
    state = {"model": nn.Linear(2, 2), "hist": {1: 0.5, 2: (3, b"x")}, "n": 7}
    with snapsvc.SnapshotWriter(tmp_path) as w:
        w.submit(state, "m.fdl", epoch=5).result(timeout=60)
    meta = tmp_path / "m.fdl.meta"
    good = meta.read_bytes()
    want = snapsvc.load(tmp_path / "m.fdl")
    for offset in range(len(good)):
        for flip in (0x01, 0x80):
            bad = bytearray(good)
            bad[offset] ^= flip
            meta.write_bytes(bad)
            try:
                got = snapsvc.load(tmp_path / "m.fdl")
            except snapsvc.FormatError:
                continue
            assert_same(got, want, f"offset {offset} flip {flip:#x}")  # never a wrong value
    meta.write_bytes(good)
    assert snapsvc.verify(tmp_path / "m.fdl").ok


def _tuples_as_lists(groups: list) -> list:
    return [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in groups]


def test_load_of_a_model_checkpoint_is_the_state_model_and_optimizer(tmp_path):
    """Issue 30 item 9: submit(model, optimizer=) and a flodl-style save_file load as if
    {"model": model, "optimizer": opt} had been submitted, in torch's state_dict forms."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.8, 0.99))
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(5, 3)).sum().backward()
        opt.step()
    with snapsvc.SnapshotWriter(tmp_path) as w:
        w.submit(model, "with.fdl", optimizer=opt).result(timeout=60)
        w.submit(model, "without.fdl").result(timeout=60)
    snapsvc.snapshot_cpu(model).save_file(tmp_path / "flodl.fdl")
    for name in ("without.fdl", "flodl.fdl"):
        got = snapsvc.load(tmp_path / name)
        assert list(got) == ["model"], name
        assert got["model"].keys() == model.state_dict().keys()
        assert all(torch.equal(got["model"][k], v) for k, v in model.state_dict().items())
    got = snapsvc.load(tmp_path / "with.fdl")
    assert list(got) == ["model", "optimizer"]
    # what a torch.load user does with it
    torch.manual_seed(1)
    fresh = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    fresh_opt = torch.optim.Adam(fresh.parameters())
    fresh.load_state_dict(got["model"])
    fresh_opt.load_state_dict(got["optimizer"])
    want, have = opt.state_dict(), fresh_opt.state_dict()
    assert _tuples_as_lists(have["param_groups"]) == _tuples_as_lists(want["param_groups"])
    assert have["state"].keys() == want["state"].keys()
    for i, s in want["state"].items():
        assert have["state"][i].keys() == s.keys()
        assert all(torch.equal(have["state"][i][k], v) for k, v in s.items())
    # the mapping form of restore takes it too
    target_model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    target_opt = torch.optim.Adam(target_model.parameters())
    snapsvc.restore(tmp_path / "with.fdl", {"model": target_model, "optimizer": target_opt})
    assert all(torch.equal(a, b) for a, b in zip(target_model.state_dict().values(),
                                                 model.state_dict().values()))
    assert torch.equal(target_opt.state_dict()["state"][0]["exp_avg"],
                       want["state"][0]["exp_avg"])

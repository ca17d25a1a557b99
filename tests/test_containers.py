"""Standard containers (Counter, OrderedDict, defaultdict) through the state tree, and every
LR scheduler of torch.optim.lr_scheduler resumed mid-schedule against torch.save (issue 21, 4).

``MultiStepLR.milestones`` is a ``Counter``: loaded back as a plain dict, a
``SequentialLR([LinearLR, MultiStepLR])`` resumed mid-warmup crashes when it switches
(``'dict' object has no attribute 'elements'``).
"""

from __future__ import annotations

import inspect
import io
from collections import Counter, OrderedDict, defaultdict

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as L

import snapsvc
from snapsvc.errors import UnsupportedStateError

pytestmark = [pytest.mark.timeout(180)]

STEPS_BEFORE = 2   # the save: mid-schedule (SequentialLR: mid-warmup, it switches at 3)
STEPS_AFTER = 9


def _sgd(model: nn.Module) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


# name -> a factory (optimizer -> scheduler); the names must cover the whole module
SCHEDULERS = {
    "LambdaLR": lambda o: L.LambdaLR(o, lambda e: 0.9 ** e),
    "MultiplicativeLR": lambda o: L.MultiplicativeLR(o, lambda e: 0.95),
    "StepLR": lambda o: L.StepLR(o, step_size=2, gamma=0.5),
    "MultiStepLR": lambda o: L.MultiStepLR(o, milestones=[3, 5, 5], gamma=0.5),
    "ConstantLR": lambda o: L.ConstantLR(o, factor=0.5, total_iters=4),
    "LinearLR": lambda o: L.LinearLR(o, start_factor=0.1, total_iters=5),
    "ExponentialLR": lambda o: L.ExponentialLR(o, gamma=0.8),
    "SequentialLR": lambda o: L.SequentialLR(
        o, [L.LinearLR(o, start_factor=0.1, total_iters=3),
            L.MultiStepLR(o, milestones=[2, 4], gamma=0.5)], milestones=[3]),
    "PolynomialLR": lambda o: L.PolynomialLR(o, total_iters=8, power=2.0),
    "CosineAnnealingLR": lambda o: L.CosineAnnealingLR(o, T_max=6),
    "ChainedScheduler": lambda o: L.ChainedScheduler(
        [L.ConstantLR(o, factor=0.5, total_iters=3), L.MultiStepLR(o, milestones=[4])]),
    "ReduceLROnPlateau": lambda o: L.ReduceLROnPlateau(o, patience=1, factor=0.5),
    "CyclicLR": lambda o: L.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=3),
    "CosineAnnealingWarmRestarts": lambda o: L.CosineAnnealingWarmRestarts(o, T_0=3, T_mult=2),
    "OneCycleLR": lambda o: L.OneCycleLR(o, max_lr=0.1, total_steps=STEPS_BEFORE + STEPS_AFTER),
}


def test_every_scheduler_of_torch_is_covered():
    found = {n for n, c in vars(L).items() if inspect.isclass(c) and c.__module__ == L.__name__
             and (issubclass(c, L.LRScheduler) or c is L.ReduceLROnPlateau)
             and not n.startswith("_") and n != "LRScheduler"}
    assert found == set(SCHEDULERS)


def _build(name: str, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    opt = _sgd(model)
    return model, opt, SCHEDULERS[name](opt)


def _step(model, opt, sched, i: int) -> float:
    loss = model(torch.full((4, 3), 0.1 * (i + 1))).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if isinstance(sched, L.ReduceLROnPlateau):
        sched.step(1.0)   # never improves: it reduces every patience + 1 steps
    else:
        sched.step()
    return opt.param_groups[0]["lr"]


def _same(a, b, where: str = "") -> None:
    """Equal values of the same types, all the way down (Counter == dict is True in Python)."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        assert list(a) == list(b), where
        if isinstance(a, defaultdict):
            assert a.default_factory is b.default_factory, where
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif not callable(a):
        assert a == b or (a != a and b != b), where


@pytest.fixture(scope="module")
def writer(tmp_path_factory):
    with snapsvc.SnapshotWriter(tmp_path_factory.mktemp("sched")) as w:
        yield w


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
@pytest.mark.parametrize("route", ["restore", "load"])
def test_scheduler_resumed_mid_schedule_matches_torch_save(writer, name, route):
    """Save at step 2, restore into fresh objects (snapsvc.restore, or snapsvc.load +
    load_state_dict), go on 9 steps: the same learning rates and state as the torch.save
    control, and load() gives back the very state_dict() torch.save keeps."""
    model, opt, sched = _build(name)
    for i in range(STEPS_BEFORE):
        _step(model, opt, sched, i)
    saved = sched.state_dict()
    control_bytes = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": saved},
               control_bytes)
    writer.submit({"model": model, "opt": opt, "sched": sched}, f"{name}-{route}.fdl"
                  ).result(timeout=60)
    path = f"{writer.directory}/{name}-{route}.fdl"

    runs = {}
    for kind in ("control", "snapsvc"):
        m, o, s = _build(name, seed=1)
        if kind == "control":
            control_bytes.seek(0)
            sd = torch.load(control_bytes, weights_only=False)
            m.load_state_dict(sd["model"])
            o.load_state_dict(sd["opt"])
            s.load_state_dict(sd["sched"])
        elif route == "restore":
            snapsvc.restore(path, {"model": m, "opt": o, "sched": s})
        else:
            sd = snapsvc.load(path)
            m.load_state_dict(sd["model"])
            o.load_state_dict(sd["opt"])
            s.load_state_dict(sd["sched"])
        lrs = [_step(m, o, s, STEPS_BEFORE + i) for i in range(STEPS_AFTER)]
        runs[kind] = (lrs, s.state_dict(), m.weight.detach().clone())
    assert runs["snapsvc"][0] == runs["control"][0]
    _same(runs["snapsvc"][1], runs["control"][1], "state after resume")
    assert torch.equal(runs["snapsvc"][2], runs["control"][2])
    _same(snapsvc.load(path)["sched"], torch.load(io.BytesIO(control_bytes.getvalue()),
                                                  weights_only=False)["sched"], "sched")


def test_containers_come_back_as_their_own_kind(writer):
    state = {
        "counter": Counter({3: 2, "a": 1}),
        "ordered": OrderedDict([("b", 1), ("a", torch.ones(2))]),
        "default": defaultdict(list, {"x": [1, 2]}),
        "nested": [OrderedDict(z=Counter()), (defaultdict(int),)],
        "empty_default": defaultdict(None),
        "plain": {"k": 1},
    }
    state["default_dict"] = defaultdict(dict, {1: {"q": 2}})
    writer.submit(state, "containers.fdl").result(timeout=60)
    path = f"{writer.directory}/containers.fdl"
    back = snapsvc.load(path)
    _same(back, state, "state")
    # restore() hands the same kinds to load_state_dict and in report.state
    live = nn.Linear(2, 2)
    got = {}

    class Holder:
        def state_dict(self):
            return {}

        def load_state_dict(self, sd):
            got["sd"] = sd

    report = snapsvc.restore(path, {"counter": Holder(), "ordered": {"a": live.bias}})
    _same(got["sd"], state["counter"], "load_state_dict's argument")
    _same(report.state["nested"], state["nested"], "report.state")
    assert torch.equal(live.bias, torch.ones(2))


def test_a_defaultdict_whose_factory_cannot_be_stored_is_refused_at_submit(writer):
    with pytest.raises(UnsupportedStateError, match=r"state\['d'\]\[1\].*default_factory"):
        writer.submit({"d": {1: defaultdict(lambda: 7)}}, "refused.fdl")


def test_extra_of_a_model_submit_keeps_its_containers(writer):
    model = nn.Linear(2, 2)
    extra = {"seen": Counter({"x": 3}), "order": OrderedDict(b=2, a=1)}
    writer.submit(model, "extra.fdl", extra=extra).result(timeout=60)
    report = snapsvc.restore(f"{writer.directory}/extra.fdl", nn.Linear(2, 2))
    _same(report.extra, extra, "extra")


def _fields(path: str) -> tuple[dict, dict]:
    import msgpack
    with open(path + ".meta", "rb") as f:
        outer = msgpack.unpackb(f.read(), strict_map_key=False)
    return outer, msgpack.unpackb(outer["fields"], strict_map_key=False)


def _rewrite(path: str, outer: dict, fields: dict) -> None:
    import zlib

    import msgpack
    outer["fields"] = msgpack.packb(fields, use_bin_type=True)
    outer["crc32"] = zlib.crc32(outer["fields"])
    with open(path + ".meta", "wb") as f:
        f.write(msgpack.packb(outer, use_bin_type=True))


def test_the_kinds_are_a_field_of_their_own_and_the_tree_stays_plain(writer):
    """A reader that does not know the kinds (an older snapsvc) reads plain dicts; a file
    without the field reads as before."""
    writer.submit({"c": Counter({5: 2}), "l": [OrderedDict(a=1)]}, "plain.fdl").result(timeout=60)
    path = f"{writer.directory}/plain.fdl"
    outer, fields = _fields(path)
    assert fields["state"]["c"] == {5: 2} and fields["state"]["l"] == [{"a": 1}]
    assert fields["kinds"] == [["state", ["c"], "Counter", None],
                               ["state", ["l", 0], "OrderedDict", None]]
    del fields["kinds"]   # as an older snapsvc wrote it
    _rewrite(path, outer, fields)
    _same(snapsvc.load(path), {"c": {5: 2}, "l": [{"a": 1}]}, "state")
    writer.submit({"c": {1: 2}}, "nokinds.fdl").result(timeout=60)
    assert "kinds" not in _fields(f"{writer.directory}/nokinds.fdl")[1]


@pytest.mark.parametrize("kinds", [
    [["state", ["missing"], "Counter", None]],        # names no map of the tree
    [["state", ["c"], "set", None]],                  # not a kind snapsvc builds
    [["state", ["c"], "defaultdict", "os.system"]],   # not a factory snapsvc builds
    [["state", ["c"], "Counter", "list"]],            # a factory for a Counter
    [["other", ["c"], "Counter", None]],              # not a field of the metadata
    [["state", [1.5], "Counter", None]],              # a key of another type
    {"state": "c"},                                   # not a list
], ids=["no-such-map", "kind", "factory", "counter-factory", "root", "key", "shape"])
def test_a_hostile_kinds_table_is_a_format_error(writer, kinds):
    writer.submit({"c": Counter({5: 2})}, "hostile.fdl").result(timeout=60)
    path = f"{writer.directory}/hostile.fdl"
    outer, fields = _fields(path)
    fields["kinds"] = kinds
    _rewrite(path, outer, fields)
    with pytest.raises(snapsvc.FormatError, match="kinds"):
        snapsvc.load(path)

"""A kept plan (a model's, a state's walk memo) must notice every change that
``state_dict()`` would show: names, persistence, shapes, dtypes (issue 30 item 1).

Each test changes the model's structure between two submits of the same
objects, through a model submit, a state submit and a nested state, and
checks that the file holds ``state_dict()`` at submit: by ``load()`` or
``read_checkpoint``, and by ``restore`` into a fresh model of the new
architecture (a stale name or structural hash fails it).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import snapsvc
from snapsvc.engine import pools
from snapsvc.state import memo as memo_mod, tree

pytestmark = pytest.mark.timeout(120)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seq = nn.Sequential(nn.Linear(3, 4), nn.Dropout(), nn.Linear(4, 4))
        self.heads = nn.ModuleDict({"a": nn.Linear(4, 2), "c": nn.Linear(4, 2)})
        # each alone in its module: re-registering it keeps the walk's order
        self.kept, self.temp = nn.Module(), nn.Module()
        self.kept.register_buffer("stat", torch.arange(3.0))
        self.temp.register_buffer("scratch", torch.ones(2), persistent=False)


def _delete(m: Net) -> None:
    del m.seq[1]  # the second Linear becomes seq.1: same tensors, new names


def _insert(m: Net) -> None:
    m.seq.insert(1, nn.ReLU())


def _rename(m: Net) -> None:
    m.heads["b"] = m.heads.pop("c")  # the last: the walk's order is kept


def _to_non_persistent(m: Net) -> None:
    buf = m.kept.stat
    del m.kept.stat
    m.kept.register_buffer("stat", buf, persistent=False)


def _to_persistent(m: Net) -> None:
    buf = m.temp.scratch
    del m.temp.scratch
    m.temp.register_buffer("scratch", buf)


def _swap_tensors(m: Net) -> None:
    a, c = m.heads["a"], m.heads["c"]
    a.weight, c.weight = c.weight, a.weight


def _replace_submodule(m: Net) -> None:
    m.heads["c"] = nn.Linear(4, 2)


def _cast(m: Net) -> None:
    m.seq[0].double()


def _reshape(m: Net) -> None:
    m.heads["c"] = nn.Linear(4, 5)


CHANGES = [_delete, _insert, _rename, _to_non_persistent, _to_persistent, _swap_tensors,
           _replace_submodule, _cast, _reshape]


def _clone(sd: dict) -> dict:
    return {k: v.clone() for k, v in sd.items()}


def _fresh(m: nn.Module) -> nn.Module:
    """A model of ``m``'s architecture, with other values."""
    fresh = copy.deepcopy(m)
    with torch.no_grad():
        for t in fresh.state_dict().values():
            t.fill_(-7)
    return fresh


def _equal(got: dict, want: dict, what: str) -> None:
    # a model file lists parameters, then buffers; state_dict() module by module
    assert sorted(got) == sorted(want), (what, list(got), list(want))
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), (what, k)


ROUTES = {
    "model": (lambda m: m, lambda loaded: None, lambda fresh: fresh),
    "state": (lambda m: {"model": m, "step": 1}, lambda loaded: loaded["model"],
              lambda fresh: {"model": fresh}),
    # not the state's model: its entries are named by key path
    "nested": (lambda m: {"run": {"net": m}, "ema": nn.Linear(2, 2)},
               lambda loaded: loaded["run"]["net"], lambda fresh: {"run": {"net": fresh}}),
}


@pytest.mark.parametrize("change", CHANGES, ids=lambda f: f.__name__.strip("_"))
def test_a_structural_change_reaches_the_file(tmp_path, change):
    with snapsvc.SnapshotWriter(tmp_path, slots=1) as w:
        for route, (wrap, pick, target) in ROUTES.items():
            torch.manual_seed(0)
            m = Net()
            for i in range(2):  # the second submit takes the kept plan
                w.submit(wrap(m), tmp_path / f"{route}-before{i}.fdl").result(timeout=60)
            change(m)
            want = _clone(m.state_dict())
            path = tmp_path / f"{route}.fdl"
            w.submit(wrap(m), path).result(timeout=60)
            got = (snapsvc.read_checkpoint(path).entries if route == "model"
                   else pick(snapsvc.load(path)))
            _equal(dict(got), want, f"{route}: file")
            fresh = _fresh(m)
            if route == "model":
                snapsvc.restore(path, fresh, strict=True)
            else:
                snapsvc.restore(path, target(fresh))
            _equal(fresh.state_dict(), want, f"{route}: restored")


@pytest.mark.parametrize("change", CHANGES, ids=lambda f: f.__name__.strip("_"))
def test_a_structural_change_is_walked_again(change):
    """Without the sidecar: the memo's walk equals a walk without a memo, and
    the model's plan no longer matches."""
    m = Net()
    memo = memo_mod.WalkMemo(pools.tensor_guard)
    for state in ({"model": m}, {"model": m}):
        tree.flatten(state, memo)
    layout = snapsvc.format.layout.Layout.of(list(m.named_parameters()), [], "")
    plan = pools.Plan.make(pools.walk(m), [p for _, p in m.named_parameters()],
                           pools.Pool([pools.Slot(1, layout, False)]))
    assert plan.matches(pools.walk(m))
    change(m)
    assert not plan.matches(pools.walk(m))
    got, want = tree.flatten({"model": m}, memo), tree.flatten({"model": m})
    assert [n for n, _ in got.params] == [n for n, _ in want.params]
    assert [n for n, _ in got.buffers] == [n for n, _ in want.buffers]
    assert got.structural_hash == want.structural_hash

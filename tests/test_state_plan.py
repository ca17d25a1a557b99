"""A state mapping's plan: its modules and optimizer states are walked once.

Like a model's cached plan (tests/test_plan.py), the parts of a nested state
that still hold (same module tensors, same optimizer per-parameter state
objects with the same shapes, strides, dtypes and devices) are not walked
again; every change (a replaced, resized, cast, moved or swapped tensor, in
the model or in the optimizer state) is noticed, and the file equals the
state at submit, with torch's C++ tensor check and the Python fallback alike.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import snapsvc
from snapsvc.engine import pools
from snapsvc.state import memo as memo_mod, tree
from test_plan import GUARDS, MUTATIONS
from test_state import assert_same

pytestmark = pytest.mark.timeout(120)


def _exp_avg(opt: torch.optim.Optimizer, i: int = 0) -> dict:
    return opt.state[opt.param_groups[0]["params"][i]]


def _replaced(st: dict) -> None:
    st["exp_avg"] = torch.full_like(st["exp_avg"], 3.0)


def _resized(st: dict) -> None:
    st["exp_avg"].data = torch.full((st["exp_avg"].numel() + 2,), 4.0)


def _resized_in_place(st: dict) -> None:
    st["exp_avg"].resize_(st["exp_avg"].numel() + 5).fill_(4.5)


def _cast(st: dict) -> None:
    st["exp_avg"].data = st["exp_avg"].data.double()


def _to_bool(st: dict) -> None:  # a dtype .fdl lacks: it goes to the data file
    st["exp_avg"].data = st["exp_avg"].data > 0


def _other_memory(st: dict) -> None:
    st["exp_avg"].set_(torch.full(st["exp_avg"].shape, 5, dtype=st["exp_avg"].dtype))


def _key_added(st: dict) -> None:
    st["extra"] = torch.ones(3)


def _key_removed(st: dict) -> None:
    del st["exp_avg_sq"]


def _plain_value(st: dict) -> None:
    st["note"] = 1.5


OPT_MUTATIONS = [_replaced, _resized, _resized_in_place, _cast, _to_bool, _other_memory,
                 _key_added, _key_removed, _plain_value]


# Module changes that the walk must see (the entries' shapes, strides, dtypes).
_RESHAPED = {"_new_shape", "_cast", "_transpose_same_memory", "_view_same_memory", "_strided",
             "_swap"}


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 3)).square().mean().backward()
    opt.step()
    return model, opt


def _state(model, opt, i):
    return {"model": model, "opt": opt, "aux": {"head": model[2]}, "step": i,
            "best_k": {f"epoch={i}.ckpt": torch.tensor(float(i))}}


def _detached(model: nn.Module, opt: torch.optim.Optimizer, i: int) -> dict:
    """A checkpoint as Lightning's holds the model: ``state_dict()``, whose tensors are
    detached anew at every call."""
    return {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()],
            "loops": {"step": i}}


def _same_flat(a: tree.Flat, b: tree.Flat, by_address: bool = False) -> None:
    """``b`` walked afresh: ``a`` has the same tree and entries, over the same tensors
    (``by_address``: over the same memory, as a memo keeps a detached state_dict's)."""
    assert a.tree == b.tree and a.structural_hash == b.structural_hash
    assert a.kinds == b.kinds and _kinds(a.tree) == _kinds(b.tree)
    for x, y in ((a.params, b.params), (a.buffers, b.buffers), (a.rest, b.rest)):
        assert [e[:-1] for e in x] == [e[:-1] for e in y]
        if by_address:
            assert [e[-1].data_ptr() for e in x] == [f[-1].data_ptr() for f in y]
        else:
            assert all(e[-1] is f[-1] for e, f in zip(x, y))


def _kinds(node) -> list:
    """Every container's type in ``node``, depth first (== ignores OrderedDict vs dict)."""
    if isinstance(node, dict):
        return [type(node), *(x for k, v in node.items() for x in [k, *_kinds(v)])]
    if isinstance(node, (list, tuple)):
        return [type(node), *(x for v in node for x in _kinds(v))]
    return [_kinds(node.value)] if hasattr(node, "value") else []


# Changes to an optimizer's whole per-parameter state (one memo part, a dict of dicts).
def _param_state_dropped(opt) -> None:
    del opt.state[opt.param_groups[0]["params"][1]]


def _param_state_ordered(opt) -> None:
    import collections
    p = opt.param_groups[0]["params"][1]
    opt.state[p] = collections.OrderedDict(opt.state[p])


def _param_state_added(opt) -> None:
    opt.add_param_group({"params": [nn.Parameter(torch.ones(3))]})
    opt.state[opt.param_groups[1]["params"][0]] = {"step": torch.tensor(1.0),
                                                   "exp_avg": torch.ones(3)}


def _param_state_same_tensors_new_dict(opt) -> None:
    p = opt.param_groups[0]["params"][1]
    opt.state[p] = dict(opt.state[p])


@pytest.mark.parametrize("mutate", [_param_state_dropped, _param_state_ordered,
                                    _param_state_added, _param_state_same_tensors_new_dict],
                         ids=lambda f: f.__name__)
def test_a_changed_optimizer_state_table_is_noticed(mutate):
    model, opt = _setup()
    memo = memo_mod.WalkMemo(pools.tensor_guard)
    for _ in range(2):
        tree.flatten(_state(model, opt, 0), memo)
    mutate(opt)
    state = _state(model, opt, 1)
    _same_flat(tree.flatten(state, memo), tree.flatten(state))


@pytest.fixture
def walked(monkeypatch) -> list[tuple]:
    """The key paths of the tensors walked (not taken from the memo)."""
    out: list[tuple] = []
    real = tree._Walker.tensor
    monkeypatch.setattr(tree._Walker, "tensor",
                        lambda self, t, path, *a, **k: out.append(path) or real(self, t, path,
                                                                                *a, **k))
    return out


@pytest.mark.parametrize("make, new", [(_state, [("best_k", "epoch=1.ckpt")]), (_detached, [])],
                         ids=["modules", "a state_dict detached anew"])
def test_unchanged_modules_and_optimizer_state_are_not_walked_again(walked, make, new):
    model, opt = _setup()
    memo = memo_mod.WalkMemo(pools.tensor_guard)
    tree.flatten(make(model, opt, 0), memo)
    model(torch.randn(5, 3)).square().mean().backward()
    opt.step()  # values change in place: the plan holds
    walked.clear()
    state = make(model, opt, 1)
    flat = tree.flatten(state, memo)
    assert walked == new, walked  # only what is new
    _same_flat(flat, tree.flatten(state), by_address=make is _detached)


@pytest.mark.parametrize("guard", GUARDS)
@pytest.mark.parametrize("mutate", OPT_MUTATIONS, ids=lambda f: f.__name__)
def test_a_changed_optimizer_state_is_noticed(guard, mutate, monkeypatch, walked):
    monkeypatch.setattr(pools, "tensor_guard", GUARDS[guard])
    model, opt = _setup()
    memo = memo_mod.WalkMemo(lambda ts: pools.tensor_guard(ts))
    tree.flatten(_state(model, opt, 0), memo)
    tree.flatten(_state(model, opt, 0), memo)  # the whole optimizer state reused as one part
    assert ("map", ("opt", "state"), True) in memo.parts
    mutate(_exp_avg(opt, 1))
    state = _state(model, opt, 1)
    walked.clear()
    flat = tree.flatten(state, memo)
    if mutate is not _other_memory:  # same object, shape, dtype: copied live, nothing to redo
        assert ("opt", "state", 1, "exp_avg") in walked, walked  # walked again
    assert ("opt", "state", 0, "exp_avg") not in walked, walked  # the others were not
    _same_flat(flat, tree.flatten(state))


@pytest.mark.parametrize("guard", GUARDS)
@pytest.mark.parametrize("mutate", MUTATIONS, ids=lambda f: f.__name__)
def test_a_changed_module_tensor_in_a_mapping_is_noticed(guard, mutate, monkeypatch, walked):
    monkeypatch.setattr(pools, "tensor_guard", GUARDS[guard])
    model, opt = _setup()
    memo = memo_mod.WalkMemo(lambda ts: pools.tensor_guard(ts))
    tree.flatten(_state(model, opt, 0), memo)
    mutate(model[2].weight)  # in "model" and in "aux"
    state = _state(model, opt, 1)
    walked.clear()
    flat = tree.flatten(state, memo)
    if mutate.__name__ in _RESHAPED:  # the others leave shape, strides and dtype: copied live
        assert ("model", "2.weight") in walked and ("aux", "head", "weight") in walked, walked
    _same_flat(flat, tree.flatten(state))


def _expected(state: dict) -> dict:
    import copy
    return {"model": {k: v.clone() for k, v in state["model"].state_dict().items()},
            "opt": copy.deepcopy(state["opt"].state_dict()),
            "aux": {"head": {k: v.clone() for k, v in state["aux"]["head"].state_dict().items()}},
            "step": state["step"], "best_k": copy.deepcopy(state["best_k"])}


@pytest.mark.parametrize("guard", GUARDS)
def test_every_change_reaches_the_file(tmp_path, guard, monkeypatch):
    """Through the sidecar: after each change the file equals the state at its submit."""
    monkeypatch.setattr(pools, "tensor_guard", GUARDS[guard])
    model, opt = _setup()
    changes = [(m, lambda: model[2].weight) for m in MUTATIONS] + \
        [(m, lambda: _exp_avg(opt, 1)) for m in OPT_MUTATIONS]
    with snapsvc.SnapshotWriter(tmp_path, slots=1) as w:
        w.submit(_state(model, opt, 0), "p0.fdl").result(timeout=60)
        for i, (mutate, target) in enumerate(changes, 1):
            mutate(target())
            state = _state(model, opt, i)
            want = _expected(state)
            w.submit(state, f"p{i}.fdl").result(timeout=60)
            assert_same(snapsvc.load(tmp_path / f"p{i}.fdl"), want, mutate.__name__)


class _Counted(nn.Linear):
    """A module with extra state: a value of this moment, not a tensor."""

    seen = 0

    def get_extra_state(self) -> dict:
        return {"seen": self.seen}

    def set_extra_state(self, state: dict) -> None:
        self.seen = state["seen"]


def test_values_of_this_moment_are_read_again_through_a_memo():
    """Extra states and container kinds are not tensors a guard can check: a
    module with extra state and a mapping whose kind changed are walked again."""
    model = _Counted(2, 2)
    memo = memo_mod.WalkMemo(pools.tensor_guard)
    tree.flatten({"model": model, "counts": {"a": 1}}, memo)
    model.seen = 7
    counts = __import__("collections").Counter(a=1)
    flat = tree.flatten({"model": model, "counts": counts}, memo)
    assert flat.tree["model"].value["_extra_state"] == {"seen": 7}
    assert type(flat.tree["counts"]) is type(counts)


@pytest.mark.parametrize("guard", GUARDS)
def test_every_change_reaches_the_file_through_a_detached_state_dict(tmp_path, guard,
                                                                      monkeypatch):
    """Through the sidecar, each module change (other memory, freed and reused
    memory, a cast, a view...) made between saves of a detached ``state_dict()``:
    the file equals the state at its submit."""
    import copy
    monkeypatch.setattr(pools, "tensor_guard", GUARDS[guard])
    model, opt = _setup()
    with snapsvc.SnapshotWriter(tmp_path, slots=1) as w:
        w.submit(_detached(model, opt, 0), "d0.fdl").result(timeout=60)
        for i, mutate in enumerate(MUTATIONS, 1):
            mutate(model[2].weight)
            state = _detached(model, opt, i)
            want = {"state_dict": type(state["state_dict"])(
                        (k, v.clone()) for k, v in state["state_dict"].items()),
                    "optimizer_states": copy.deepcopy(state["optimizer_states"]),
                    "loops": {"step": i}}
            w.submit(state, f"d{i}.fdl").result(timeout=60)
            assert_same(snapsvc.load(tmp_path / f"d{i}.fdl"), want, mutate.__name__)


def test_a_module_that_stops_keeping_its_own_names_is_walked_again():
    """The only module of a state keeps its own names; beside a second one it
    does not (its entries are then named by key path): its part is not reused."""
    model, _ = _setup()
    memo = memo_mod.WalkMemo(pools.tensor_guard)
    tree.flatten({"net": model}, memo)
    state = {"net": model, "ema": nn.Linear(2, 2)}
    flat = tree.flatten(state, memo)
    assert flat.params == [] and flat.rest[0][1] == "net/0.weight", flat.rest[0]
    _same_flat(flat, tree.flatten(state))


def test_param_names_are_named_parameters_names():
    # param_names reads _parameters directly (issue 34): the same names as
    # named_parameters(), a shared parameter under its first name, a None one left out
    from snapsvc.state.paths import param_names
    inner = nn.Linear(2, 2)
    model = nn.Sequential(inner, nn.Sequential(inner, nn.Linear(2, 3)), nn.Linear(3, 1))
    model[1][1].bias = None
    model[2].register_parameter("tied", model[0].weight)
    other = nn.Linear(1, 1)
    state = {"model": model, "aux": {"head": other}, "also": [model]}
    names = param_names(state)
    want: dict[int, str] = {}
    for n, p in model.named_parameters():
        want.setdefault(id(p), n)
    for n, p in other.named_parameters():
        want.setdefault(id(p), f"aux/head/{n}")
    assert names == want
    assert names[id(model[0].weight)] == "0.weight" and id(model[1][1].weight) in names

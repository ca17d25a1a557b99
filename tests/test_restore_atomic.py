"""Restore (issue 20, section 6): every optimizer torch resumes, all-or-nothing, extra state, bool buffers.

* Adafactor (factored ``row_var``/``col_var``) and LBFGS (flat history) come
  back through ``restore(path, mapping)``: torch's ``load_state_dict`` accepts
  state tensors of any shape, and so does snapsvc.
* A nested restore checks everything (shapes, the saved class of each
  optimizer, scheduler and stateful object, that each live tensor can be
  written) before it changes anything; a failure while applying rolls every
  object back.
* ``get_extra_state()`` is saved and given back through ``set_extra_state``.
* A ``"model"`` with a bool buffer loads with ``load_checkpoint`` and
  ``restore`` (its header hash is the model's own).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import snapsvc
from snapsvc.errors import SnapsvcError

pytestmark = pytest.mark.timeout(180)


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5), nn.Linear(5, 2))


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 2, seed: int = 1) -> None:
    torch.manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 3)

        def closure():
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            return loss
        opt.step(closure)


def same(a, b, path="") -> None:
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def frozen(obj) -> dict:
    """A deep copy of ``obj``'s state_dict, to compare with later."""
    return copy.deepcopy(obj.state_dict())


@pytest.fixture(scope="module")
def writer(tmp_path_factory):
    with snapsvc.SnapshotWriter(tmp_path_factory.mktemp("ra")) as w:
        yield w


def save(writer, state, name: str) -> str:
    return writer.submit(state, name).result(timeout=60).path


# ----------------------------------------------------------------------------------
# optimizers whose state does not have the parameter's shape
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [torch.optim.Adafactor, torch.optim.LBFGS])
def test_optimizer_state_of_other_shapes_resumes_bit_identically(writer, cls):
    model = make_model()
    opt = cls(model.parameters())
    train(model, opt)
    path = save(writer, {"model": model, "opt": opt}, f"{cls.__name__}.fdl")
    fresh = make_model(seed=9)
    fresh_opt = cls(fresh.parameters())
    report = snapsvc.restore(path, {"model": fresh, "opt": fresh_opt}, strict=True)
    assert "opt" in report.restored
    same(fresh_opt.state_dict(), opt.state_dict())
    train(model, opt, seed=3)
    train(fresh, fresh_opt, seed=3)
    same(fresh.state_dict(), model.state_dict())


# ----------------------------------------------------------------------------------
# classes are checked first
# ----------------------------------------------------------------------------------
def sgd_state():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    train(model, opt)
    sched.step()
    return {"model": model, "opt": opt, "sched": sched}


def live_with(opt_cls, sched_cls):
    model = make_model(seed=5)
    opt = opt_cls(model.parameters(), lr=0.5)
    sched = sched_cls(opt, 10) if sched_cls is torch.optim.lr_scheduler.CosineAnnealingLR \
        else sched_cls(opt, step_size=3)
    return {"model": model, "opt": opt, "sched": sched}


@pytest.mark.parametrize("opt_cls, sched_cls, saved, live", [
    (torch.optim.Adam, torch.optim.lr_scheduler.StepLR, "SGD", "Adam"),
    (torch.optim.SGD, torch.optim.lr_scheduler.CosineAnnealingLR, "StepLR", "CosineAnnealingLR"),
], ids=["sgd-into-adam", "steplr-into-cosine"])
def test_another_class_is_refused_naming_both_and_nothing_changes(writer, opt_cls, sched_cls,
                                                                  saved, live):
    path = save(writer, sgd_state(), "sgd.fdl")
    target = live_with(opt_cls, sched_cls)
    before = {k: frozen(v) for k, v in target.items()}
    with pytest.raises(SnapsvcError) as info:
        snapsvc.restore(path, target)
    assert saved in str(info.value) and live in str(info.value), str(info.value)
    for k, v in target.items():
        same(v.state_dict(), before[k], k)


# ----------------------------------------------------------------------------------
# writability checked first; a failure while applying rolls everything back
# ----------------------------------------------------------------------------------
def unwritable(kind: str) -> torch.Tensor:
    if kind == "expanded":  # one element seen three times: copy_ refuses to write it
        return torch.zeros(1).expand(3)
    with torch.inference_mode():  # written outside inference mode: refused
        return torch.zeros(3)


@pytest.mark.parametrize("kind", ["expanded", "inference"])
def test_an_unwritable_tensor_is_refused_before_anything_changes(writer, kind):
    state = sgd_state()
    state["w"] = torch.arange(3.0)
    path = save(writer, state, "w.fdl")
    target = live_with(torch.optim.SGD, torch.optim.lr_scheduler.StepLR)
    before = {k: frozen(v) for k, v in target.items()}
    target["w"] = unwritable(kind)
    with pytest.raises(SnapsvcError, match=r"\['w'\]"):
        snapsvc.restore(path, target)
    for k in before:
        same(target[k].state_dict(), before[k], k)


class Boom(torch.Tensor):
    """A tensor whose in-place copy fails: nothing can tell in advance."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            raise RuntimeError("boom")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_failure_while_applying_rolls_every_object_back(writer):
    state = sgd_state()
    state["w"] = torch.arange(3.0)
    path = save(writer, state, "w2.fdl")
    target = live_with(torch.optim.SGD, torch.optim.lr_scheduler.StepLR)
    train(target["model"], target["opt"], steps=1)  # live optimizer state to roll back to
    before = {k: frozen(v) for k, v in target.items()}
    target["w"] = torch.zeros(3).as_subclass(Boom)
    with pytest.raises(RuntimeError, match="boom"):
        snapsvc.restore(path, target)
    for k in before:
        same(target[k].state_dict(), before[k], k)
    # and the rolled-back optimizer still steps its own parameters
    train(target["model"], target["opt"], steps=1)


# ----------------------------------------------------------------------------------
# extra state
# ----------------------------------------------------------------------------------
class WithExtra(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.inner = Counted()
        self.k = 0

    def get_extra_state(self):
        return {"k": self.k, "seen": (1, 2)}

    def set_extra_state(self, state) -> None:
        self.k = state["k"]


class Counted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = torch.zeros(2)

    def get_extra_state(self):
        return self.calls

    def set_extra_state(self, state) -> None:
        self.calls = state.clone()


def test_extra_state_is_saved_and_restored(writer):
    m = WithExtra()
    m.k = 5
    m.inner.calls = torch.tensor([3.0, 4.0])
    for key in ("model", "other"):
        path = save(writer, {key: m}, f"extra-{key}.fdl")
        loaded = snapsvc.load(path)[key]
        assert loaded["_extra_state"] == {"k": 5, "seen": (1, 2)}
        assert torch.equal(loaded["inner._extra_state"], torch.tensor([3.0, 4.0]))
        fresh = WithExtra()
        report = snapsvc.restore(path, {key: fresh}, strict=True)
        assert fresh.k == 5 and torch.equal(fresh.inner.calls, m.inner.calls), report
        assert not report.skipped and not report.missing


class PlainExtra(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(2, 2), WithPlain())

    def get_extra_state(self):
        return {"k": self.k}

    def set_extra_state(self, state) -> None:
        self.k = state["k"]

    k = 0


class WithPlain(nn.Module):
    scale = 1.0

    def get_extra_state(self):
        return self.scale

    def set_extra_state(self, state) -> None:
        self.scale = state


def test_extra_state_through_a_model_submit(writer, tmp_path):
    """Kept as plain data in the metadata; a tensor there needs a state mapping."""
    m = PlainExtra()
    m.k, m.body[1].scale = 7, 0.5
    path = writer.submit(m, tmp_path / "xm.fdl").result(timeout=60).path
    fresh = PlainExtra()
    report = snapsvc.restore(path, fresh, strict=True)
    assert fresh.k == 7 and fresh.body[1].scale == 0.5
    assert {"_extra_state", "body.1._extra_state"} <= set(report.loaded)
    with pytest.raises(snapsvc.UnsupportedStateError, match=r"inner\._extra_state"):
        writer.submit(WithExtra(), tmp_path / "xt.fdl")


# ----------------------------------------------------------------------------------
# a bool buffer in "model"
# ----------------------------------------------------------------------------------
class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("mask", torch.tensor([True, False]))


def test_a_model_with_a_bool_buffer_loads_by_its_own_hash(writer):
    # first a model with the same .fdl entries and no mask: its pool must not be reused
    plain = nn.Module()
    plain.lin = nn.Linear(2, 2)
    save(writer, {"model": plain}, "plain.fdl")
    torch.manual_seed(0)
    m = Masked()
    m.mask.logical_not_()
    path = save(writer, {"model": m, "step": 3}, "masked.fdl")
    fresh = Masked()
    report = snapsvc.load_checkpoint(path, fresh)  # flodl's rules: the header hash is checked
    assert torch.equal(fresh.lin.weight, m.lin.weight)
    assert "mask" in report.missing or torch.equal(fresh.mask, m.mask)  # never silent
    fresh = Masked()
    report = snapsvc.restore(path, fresh)
    assert torch.equal(fresh.lin.weight, m.lin.weight)
    assert "mask" in report.missing or torch.equal(fresh.mask, m.mask)
    fresh = Masked()
    snapsvc.restore(path, {"model": fresh, "step": 0}, strict=True)
    assert torch.equal(fresh.mask, m.mask) and torch.equal(fresh.lin.bias, m.lin.bias)

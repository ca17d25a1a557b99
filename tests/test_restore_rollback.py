"""Restore is all or nothing (issue 30, items 6 and 7).

* The model form (``restore(path, model)``, and ``load_checkpoint``) checks
  every target (names, shapes, writability, strict extra states) before the
  first tensor changes, and undoes what it did when a ``set_extra_state``
  raises while applying: the model's state_dict is bit-identical to before.
* A rollback whose undo step raises still undoes every other object, then
  raises one :class:`snapsvc.RollbackError` naming each object it could not
  put back, chained to the original error.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from bitwise import assert_bit_identical
import snapsvc

pytestmark = pytest.mark.timeout(120)


def snapshot(obj) -> dict:
    return copy.deepcopy(obj.state_dict())


class Net(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc = nn.Linear(3, 2)
        self.register_buffer("buf", torch.rand(3))
        self.k = seed

    def get_extra_state(self):
        return {"k": self.k}

    def set_extra_state(self, state) -> None:
        self.k = state["k"]  # changed before it fails: the undo must put it back
        if state["k"] == getattr(self, "refuse", None):  # the checkpoint's; the undo's works
            raise ValueError("refused extra state")


@pytest.fixture
def saved(tmp_path):
    model = Net(seed=1)
    opt = torch.optim.Adam(model.parameters())
    model.fc(torch.rand(4, 3)).sum().backward()
    opt.step()
    with snapsvc.SnapshotWriter(tmp_path) as w:
        path = w.submit(model, "m.fdl", optimizer=opt).result(timeout=60).path
    return path


def fresh() -> tuple[Net, torch.optim.Optimizer]:
    model = Net(seed=2)
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    model.fc(torch.rand(4, 3)).sum().backward()
    opt.step()  # live optimizer state to keep
    return model, opt


# ----------------------------------------------------------------------------------
# item 6: the model form
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["restore", "restore+optimizer", "load_checkpoint"])
def test_an_expanded_buffer_is_refused_before_any_tensor_changes(saved, how):
    model, opt = fresh()
    model.buf = torch.zeros(1).expand(3)  # copy_ cannot write it; it comes after fc.*
    before, opt_before = snapshot(model), snapshot(opt)
    with pytest.raises(snapsvc.TargetNotWritableError, match=r"entry 'buf'.*expand"):
        if how == "load_checkpoint":
            snapsvc.load_checkpoint(saved, model)
        else:
            snapsvc.restore(saved, model, opt if how.endswith("optimizer") else None)
    assert_bit_identical(before, model.state_dict())
    assert_bit_identical(opt_before, opt.state_dict())


def test_a_meta_device_target_is_refused_not_skipped(saved):
    with torch.device("meta"):
        model = Net()
    with pytest.raises(snapsvc.TargetNotWritableError, match=r"entry 'fc.weight'.*meta"):
        snapsvc.restore(saved, model)


def test_a_raising_set_extra_state_undoes_every_change(saved):
    model, opt = fresh()
    model.refuse = 1  # the saved model's k
    before, opt_before = snapshot(model), snapshot(opt)
    with pytest.raises(ValueError, match="refused extra state") as info:
        snapsvc.restore(saved, model, opt)
    assert any("'_extra_state'" in n for n in getattr(info.value, "__notes__", ["'_extra_state'"]))
    assert_bit_identical(before, model.state_dict())  # fc.*, buf and the extra state
    assert_bit_identical(opt_before, opt.state_dict())
    assert opt.param_groups[0]["lr"] == 0.5
    model.refuse = None  # the same restore then works
    snapsvc.restore(saved, model, opt)
    assert model.k == 1 and opt.param_groups[0]["lr"] == 0.001


def test_strict_checks_extra_states_before_anything_changes(saved):
    class Plain(nn.Module):  # the same tensors, no extra state
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 2)
            self.register_buffer("buf", torch.zeros(3))

    model = Plain()
    before = snapshot(model)
    with pytest.raises(snapsvc.StrictLoadError, match="_extra_state"):
        snapsvc.restore(saved, model, strict=True)
    assert_bit_identical(before, model.state_dict())


# ----------------------------------------------------------------------------------
# item 7: the rollback undoes every object, even past an undo step that raises
# ----------------------------------------------------------------------------------
class Boom(torch.Tensor):
    """A tensor whose in-place copy fails: nothing can tell in advance."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            raise RuntimeError("boom")
        return super().__torch_function__(func, types, args, kwargs or {})


class Counter:
    """A stateful object whose load_state_dict works once: the undo call raises."""

    def __init__(self, n: int) -> None:
        self.n, self.loads = n, 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.loads += 1
        if self.loads > 1:
            raise OSError("cannot load twice")
        self.n = sd["n"]


def state(seed: int) -> dict:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    torch.manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (seed + 1), momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    model(torch.rand(5, 3)).sum().backward()
    opt.step()
    sched.step()
    return {"model": model, "opt": opt, "sched": sched, "custom": Counter(seed),
            "w": torch.rand(3)}


def test_an_undo_that_raises_does_not_stop_the_rollback(tmp_path):
    with snapsvc.SnapshotWriter(tmp_path) as w:
        path = w.submit(state(1), "s.fdl").result(timeout=60).path
    live = state(2)
    live["w"] = torch.zeros(3).as_subclass(Boom)  # fails last, after every object changed
    before = {k: snapshot(live[k]) for k in ("model", "opt", "sched")}
    with pytest.raises(snapsvc.RollbackError) as info:
        snapsvc.restore(path, live)
    err = info.value
    assert err.failed == ["custom"] and "'custom'" in str(err) and "cannot load twice" in str(err)
    assert isinstance(err.__cause__, RuntimeError) and "boom" in str(err.__cause__)
    assert isinstance(err, snapsvc.SnapsvcError)
    for k, sd in before.items():  # restored before "custom" in order, undone after it
        assert_bit_identical(sd, live[k].state_dict(), k)
    assert live["custom"].n == 1  # the one not put back holds the checkpoint's state, as named


def test_a_failing_copy_into_a_model_leaves_its_plain_tensors_untouched(saved):
    """Plain CPU tensors are copied last without an undo copy (issue 34): a
    target whose copy can fail (a subclass) goes first, so when it fails
    no plain tensor has changed yet, whatever its place in the model."""
    model, opt = fresh()
    with torch.no_grad():
        model.fc.bias = nn.Parameter(model.fc.bias.detach().clone().as_subclass(Boom))

    def plain() -> dict:  # Boom's deepcopy fails: its bytes as a plain tensor
        return {k: v.as_subclass(torch.Tensor).clone() if torch.is_tensor(v) else v
                for k, v in model.state_dict().items()}

    before = plain()
    with pytest.raises(RuntimeError, match="boom"):
        snapsvc.restore(saved, model)
    assert_bit_identical(before, plain())  # fc.weight comes before fc.bias, buf after it

"""The writer lets go of what it was given (issue 30 item 5): once a submit's
write is booked, ``del`` and ``gc.collect()`` free the model, its weights and
the optimizer's moments, as they would without snapsvc (on CUDA this is GPU
memory)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import snapsvc

pytestmark = pytest.mark.timeout(120)


def _trained():
    m = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    m(torch.randn(3, 4)).sum().backward()
    opt.step()
    return m, opt


def _refs(m: nn.Module, opt: torch.optim.Optimizer) -> list[weakref.ref]:
    moments = [t for st in opt.state.values() for t in st.values()]
    return [weakref.ref(x) for x in (m, opt, *m.parameters(), *moments)]


def _alive(refs: list[weakref.ref]) -> list:
    gc.collect()
    return [r() for r in refs if r() is not None]


SUBMITS = {
    "model": lambda m, opt: m,
    "model+optimizer": lambda m, opt: m,
    "state": lambda m, opt: {"model": m, "opt": opt, "step": 3},
    "nested": lambda m, opt: {"run": {"net": m, "opt": opt}, "ema": {"w": torch.ones(2)}},
}


@pytest.mark.parametrize("kind", SUBMITS)
def test_a_submitted_state_is_freed_after_its_write(tmp_path, kind):
    with snapsvc.SnapshotWriter(tmp_path, slots=1) as w:
        for i in range(2):   # the second submit takes the kept plan
            m, opt = _trained()
            extra = {"optimizer": opt} if kind == "model+optimizer" else {}
            refs = _refs(m, opt)
            w.submit(SUBMITS[kind](m, opt), f"a{i}.fdl", **extra).result(timeout=60)
            del m, opt, extra
            assert not _alive(refs), [type(x).__name__ for x in _alive(refs)]
        # and the kept plan still serves a model that lives on
        m, opt = _trained()
        for i in range(2):
            w.submit(SUBMITS[kind](m, opt), f"b{i}.fdl").result(timeout=60)
        assert snapsvc.read_checkpoint(tmp_path / "b1.fdl").entries


def test_a_submit_refused_after_close_keeps_nothing(tmp_path):
    w = snapsvc.SnapshotWriter(tmp_path, slots=1)
    w.close()
    m, opt = _trained()
    refs = _refs(m, opt)
    with pytest.raises(RuntimeError):
        w.submit({"model": m, "opt": opt}, "late.fdl")
    del m, opt
    assert not _alive(refs), [type(x).__name__ for x in _alive(refs)]


def _extra_tensor(m, opt, state):
    state["extra"] = {"t": torch.randn(64)}
    return state["extra"]["t"]


def _moment(m, opt, state):
    return opt.state[next(iter(m.parameters()))]["exp_avg"]


def _detached_state_dict(m, opt, state):
    state["sd"] = m.state_dict()   # Lightning's checkpoint: tensors detached anew each save
    return state["sd"]["0.weight"]


def _replace_moment(m, opt):
    st = opt.state[next(iter(m.parameters()))]
    st["exp_avg"] = st["exp_avg"].clone()   # a new object: the old one is the user's to drop


@pytest.mark.parametrize("make, after", [(_extra_tensor, None), (_moment, _replace_moment),
                                         (_detached_state_dict, None)])
def test_a_detached_tensor_is_freed_while_its_model_lives_on(tmp_path, make, after):
    """Item 5's sibling: the model and optimizer live on (the memo's parts for
    them stay), but a tensor the state lets go of after a submit (an ``extra``
    value, an optimizer moment replaced by a new object, a ``state_dict()``'s
    detached tensor) is freed then, before the next submit."""
    m, opt = _trained()
    with snapsvc.SnapshotWriter(tmp_path, slots=1) as w:
        for i in range(2):   # the second submit takes the kept parts
            state = {"model": m, "opt": opt}
            ref = weakref.ref(make(m, opt, state))
            w.submit(state, f"s{i}.fdl").result(timeout=60)
            if after is not None:
                after(m, opt)
            del state
            assert not _alive([ref]), f"submit {i}: the memo still holds the tensor"
        # the parts kept for the live model and optimizer still serve, and write what is there now
        moment = opt.state[next(iter(m.parameters()))]["exp_avg"]
        moment.fill_(7.0)
        w.submit({"model": m, "opt": opt}, "last.fdl").result(timeout=60)
    back = snapsvc.load(tmp_path / "last.fdl")
    assert torch.equal(back["opt"]["state"][0]["exp_avg"], torch.full_like(moment, 7.0))


def _sharded_trained():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    m = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    fully_shard(m, mesh=init_device_mesh("cpu", (1,)))
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    m(torch.randn(3, 4)).sum().backward()
    opt.step()
    return m, opt


@pytest.mark.usefixtures("world1")
@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "fsdp2"])
def test_a_distributed_submit_is_freed_after_its_write(tmp_path, sharded):
    """The same for DistributedSnapshotWriter's kept pieces (ShardMemo): a state
    submitted and dropped is freed while the writer lives, and a tensor replaced in a
    live state (a new Adam moment) is freed too."""
    make = _sharded_trained if sharded else _trained
    with snapsvc.DistributedSnapshotWriter(tmp_path / "ckpt", slots=1) as w:
        for step in (1, 2):   # the second submit takes the kept pieces
            m, opt = make()
            refs = _refs(m, opt)
            w.submit({"model": m, "opt": opt}, step).result(timeout=60)
            del m, opt
            assert not _alive(refs), [type(x).__name__ for x in _alive(refs)]
        m, opt = make()
        state = {"model": m, "opt": opt}
        w.submit(state, 3).result(timeout=60)
        w.submit(state, 4).result(timeout=60)
        p = next(iter(m.parameters()))
        old = weakref.ref(opt.state[p]["exp_avg"])
        opt.state[p]["exp_avg"] = opt.state[p]["exp_avg"].clone()
        assert not _alive([old])
        w.submit(state, 5).result(timeout=60)

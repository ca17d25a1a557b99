"""The cached copy plan of a model, the grouped slot layout and the
precompiled encoder: the fast paths of submit() and of the sidecar.

Every change to a model's tensors between two submits (replaced, resized,
cast, moved, given other memory, made non-contiguous) must reach the file,
with torch's C++ tensor check and with the Python fallback alike; the slot's
grouped layout and the sidecar's encoder must write the very bytes
``fdl.encode`` writes.
"""

from __future__ import annotations

import contextlib
import io
import os

import pytest
import torch
from torch import nn

import snapsvc
from snapsvc.format import fdl
from snapsvc.engine import pools
from snapsvc.engine import staging
from snapsvc.format import layout as layout_mod
from snapsvc.files.checkpoint import layout_hash, persistent_buffers

pytestmark = pytest.mark.timeout(120)

GUARDS = {"torch": pools.tensor_guard, "python": pools.python_guard}


def _same_shape_other_memory(p: torch.Tensor) -> None:
    p.data = torch.full_like(p, 5.0)


def _new_shape(p: torch.Tensor) -> None:
    p.data = torch.full((p.numel() + 3,), 2.0)


def _cast(p: torch.Tensor) -> None:
    p.data = p.data.double()


def _transpose_same_memory(p: torch.Tensor) -> None:
    p.data = p.data.t()  # same storage pointer, other shape and strides


def _view_same_memory(p: torch.Tensor) -> None:
    p.data = p.data.reshape(-1)  # same storage pointer and numel, other shape


def _strided(p: torch.Tensor) -> None:
    p.data = torch.arange(2 * p.numel(), dtype=p.dtype)[::2].reshape(p.shape)


def _swap(p: torch.Tensor) -> None:
    torch.utils.swap_tensors(p, nn.Parameter(torch.full((7,), 4.0)))


def _storage_freed_and_reused(p: torch.Tensor) -> None:
    p.untyped_storage().resize_(0)  # as FSDP frees a parameter
    p.data = torch.full(p.shape, 6.0)  # may well land at the freed address


def _moved_to_shared_memory_then_replaced(p: torch.Tensor) -> None:
    p.share_memory_()  # same object, its memory moved: the plan still holds
    p.data = torch.full(p.shape, 8.0)  # may land where p was before the move


def _frozen(p: torch.Tensor) -> None:
    p.requires_grad_(False)


def _in_place(p: torch.Tensor) -> None:
    with torch.no_grad():
        p.add_(1.5)


MUTATIONS = [_same_shape_other_memory, _new_shape, _cast, _transpose_same_memory,
             _view_same_memory, _strided, _swap, _storage_freed_and_reused,
             _moved_to_shared_memory_then_replaced, _frozen, _in_place]


@pytest.mark.parametrize("guard", GUARDS)
@pytest.mark.parametrize("mutate", MUTATIONS[:-2], ids=lambda f: f.__name__)
def test_a_changed_tensor_fails_the_plan(guard, mutate, monkeypatch):
    monkeypatch.setattr(pools, "tensor_guard", GUARDS[guard])
    model = nn.Linear(3, 4)
    walked = pools.walk(model)
    sources = [model.weight, model.bias]
    layout = layout_mod.Layout.of(list(model.named_parameters()), [], "")
    pool = pools.Pool([pools.Slot(1, layout, False)])
    plan = pools.Plan.make(walked, sources, pool)
    assert plan.matches(pools.walk(model))
    mutate(model.weight)
    assert not plan.matches(pools.walk(model))


@pytest.mark.parametrize("guard", GUARDS)
@pytest.mark.parametrize("mutate", [_new_shape, _cast, _strided, _swap], ids=lambda f: f.__name__)
def test_a_1d_tensor_changed_in_layout_fails_the_plan(guard, mutate, monkeypatch):
    """A small 1-D source has no alias to check (issue 34); its shape, dtype,
    strides and identity are still checked: what would change the slot's layout."""
    monkeypatch.setattr(pools, "tensor_guard", GUARDS[guard])
    model = nn.Linear(3, 4)
    layout = layout_mod.Layout.of(list(model.named_parameters()), [], "")
    plan = pools.Plan.make(pools.walk(model), [model.weight, model.bias],
                           pools.Pool([pools.Slot(1, layout, False)]))
    mutate(model.bias)
    assert not plan.matches(pools.walk(model))


@pytest.mark.parametrize("guard", GUARDS)
def test_values_changed_in_place_keep_the_plan(guard, monkeypatch):
    monkeypatch.setattr(pools, "tensor_guard", GUARDS[guard])
    model = nn.Linear(3, 4)
    layout = layout_mod.Layout.of(list(model.named_parameters()), [], "")
    plan = pools.Plan.make(pools.walk(model), [model.weight, model.bias],
                           pools.Pool([pools.Slot(1, layout, False)]))
    _in_place(model.weight)
    assert plan.matches(pools.walk(model))


@pytest.mark.parametrize("guard", GUARDS)
@pytest.mark.parametrize("which", ["weight", "bias"])
def test_every_change_reaches_the_file(tmp_path, guard, which, monkeypatch):
    """Through the sidecar: after each change the file equals the model at its
    submit, for a 2-D tensor (copied through an alias the plan checks) and a
    1-D one (copied as itself, wherever its memory is now: issue 34)."""
    monkeypatch.setattr(pools, "tensor_guard", GUARDS[guard])
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    with snapsvc.SnapshotWriter(tmp_path, slots=1) as w:
        w.submit(model, "p0.fdl").result(timeout=60)
        for i, mutate in enumerate(MUTATIONS, 1):
            mutate(getattr(model[0], which))
            want = {k: v.clone() for k, v in model.state_dict().items()}
            w.submit(model, f"p{i}.fdl").result(timeout=60)
            got = snapsvc.read_checkpoint(tmp_path / f"p{i}.fdl").entries
            assert list(got) == list(want), mutate.__name__
            for k in want:
                assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), \
                    (mutate.__name__, k)


@pytest.mark.parametrize("guard", GUARDS)
def test_guard_made_outside_a_mode_still_holds_inside_it(guard, monkeypatch):
    """torch's C++ check fails under another thread-local mode (inference_mode):
    the Python comparison then decides, so the plan is not remade each submit."""
    monkeypatch.setattr(pools, "tensor_guard", GUARDS[guard])
    model = nn.Linear(3, 4)
    layout = layout_mod.Layout.of(list(model.named_parameters()), [], "")
    plan = pools.Plan.make(pools.walk(model), [model.weight, model.bias],
                           pools.Pool([pools.Slot(1, layout, False)]))
    with torch.inference_mode():
        assert plan.matches(pools.walk(model))


def test_large_tensors_are_copied_live_not_kept_by_the_plan():
    """A plan keeps aliases of small tensors only: after model.half() the old
    float32 storage of a large weight is not held by it. (Small 1-D tensors
    need no alias: they go into the cat as themselves.)"""
    model = nn.Sequential(nn.Linear(1024, 512), nn.Linear(4, 2))  # 2 MiB weight, small rest
    layout = layout_mod.Layout.of(list(model.named_parameters()), [], "")
    sources = [p for _, p in model.named_parameters()]
    plan = pools.Plan.make(pools.walk(model), sources,
                           pools.Pool([pools.Slot(1, layout, False)]))
    assert all(a.numel() * a.element_size() < pools.SMALL for a in plan.aliases)
    assert not any(a.data_ptr() == model[0].weight.data_ptr() for a in plan.aliases)
    assert len(plan.aliases) == 1  # the small weight; the biases are 1-D
    runs = [step[0] for step in plan.steps[0] if not isinstance(step, int)]
    items = [t for run in runs for t in run]  # bias 0, then layer 1's weight and bias
    assert items[0] is model[0].bias and items[1] is plan.aliases[0] and items[2] is model[1].bias


def test_a_duplicate_name_is_refused_at_submit_and_the_sidecar_lives(tmp_path):
    snap = snapsvc.ModelSnapshot(params={"a": torch.ones(2)}, buffers={"a": torch.zeros(2)})
    with snapsvc.SnapshotWriter(tmp_path, slots=1) as w:
        with pytest.raises(snapsvc.EncodeError, match="'a' appears twice"):
            w.submit(snap, "dup.fdl")
        assert not w.submit(nn.Linear(2, 2), "ok.fdl").result(timeout=60).skipped
    assert not (tmp_path / "dup.fdl").exists()


def _mixed_model() -> nn.Module:
    """Every .fdl dtype, parameters and buffers interleaved, a non-contiguous one."""
    m = nn.Module()
    for i, dtype in enumerate(fdl.DTYPE_TO_TAG):
        t = (torch.arange(6) * (i + 1)).to(dtype).reshape(2, 3)
        if dtype.is_floating_point:
            m.register_parameter(f"p{i}", nn.Parameter(t))
        m.register_buffer(f"b{i}", t + 1)
    m.register_buffer("scalar", torch.tensor(3.5))
    m.register_buffer("empty", torch.zeros(0, 4))
    m.register_parameter("tr", nn.Parameter(torch.arange(12.0).reshape(3, 4).t()))
    return m


@pytest.mark.parametrize("dtype", list(fdl.DTYPE_TO_TAG), ids=str)
def test_groups_pack_each_dtype_and_phase(dtype):
    params = [("w", torch.zeros(3, dtype=dtype)), ("x", torch.zeros(5, dtype=torch.float32))]
    buffers = [("b", torch.zeros(2, dtype=dtype)), ("c", torch.zeros((), dtype=dtype))]
    layout = layout_mod.Layout.of(params, buffers, "")
    for g in layout.groups:
        specs = [layout.specs[i] for i in g.indices]
        assert g.offset % layout_mod.ALIGN == 0
        assert {s.dtype for s in specs} == {g.dtype}
        assert len({s.kind in layout_mod.EARLY for s in specs}) == 1
        at = g.offset
        for s in specs:  # back to back, in file order
            assert s.offset == at
            at += s.nbytes
        assert at - g.offset == g.nbytes
    covered = sorted(i for g in layout.groups for i in g.indices)
    assert covered == list(range(len(layout.specs)))
    assert layout.groups == layout_mod.Layout.from_msg(layout.to_msg()).groups


def test_grouped_slot_writes_the_bytes_encode_writes(tmp_path):
    """Mixed dtypes, a scalar, an empty and a transposed tensor, through the
    sidecar twice (the second time from the cached plan): byte for byte what
    fdl.encode makes of the same state."""
    m = _mixed_model()
    with snapsvc.SnapshotWriter(tmp_path, slots=1) as w:
        for i in range(2):
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(1)
            want = io.BytesIO()
            fdl.encode(want, list(m.state_dict().items()),
                       structural_hash=bytes.fromhex(layout_hash(
                           list(m.named_parameters()), list(persistent_buffers(m)))))
            w.submit(m, f"m{i}.fdl").result(timeout=60)
            assert (tmp_path / f"m{i}.fdl").read_bytes() == want.getvalue()


class Keep(io.RawIOBase):
    """A writer that keeps what it is handed (as some do), copying nothing."""

    def __init__(self) -> None:
        self.parts: list[memoryview] = []

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.parts.append(memoryview(b))
        return memoryview(b).nbytes

    def value(self) -> bytes:
        return b"".join(bytes(p.cast("B")) for p in self.parts)


def _entries() -> list[tuple[str, torch.Tensor]]:
    big = torch.arange(1 << 15, dtype=torch.float32)  # 128 KiB: written uncopied
    return [("e0", torch.zeros(0)), ("a", torch.ones(3)), ("z", torch.zeros(0, 2)),
            ("big", big), ("big2", big + 1), ("s", torch.tensor(2.0, dtype=torch.float64)),
            ("t", torch.arange(6).reshape(2, 3).t()), *((f"n{i}", torch.full((40,), i * 1.0))
                                                         for i in range(30_000)),
            ("last", torch.zeros(0))]


@pytest.mark.parametrize("reuse", [False, True])
def test_encoder_writes_current_values_every_time(reuse):
    entries = _entries()
    enc = fdl.Encoder(entries)
    first = io.BytesIO()
    assert enc.write(first, reuse=reuse) == enc.nbytes == fdl.encoded_size(entries)
    for _, t in entries:
        t.add_(1) if t.dtype.is_floating_point else t.mul_(2)
    second = io.BytesIO()
    enc.write(second, reuse=reuse)
    want = io.BytesIO()
    fdl.encode(want, entries)
    assert second.getvalue() == want.getvalue() != first.getvalue()
    got = list(fdl.Decoder(io.BytesIO(want.getvalue()), size=enc.nbytes).entries())
    assert [e.name for e in got] == [n for n, _ in entries]
    assert all(torch.equal(e.tensor, t) for e, (_, t) in zip(got, entries))


def test_encoder_never_reuses_a_buffer_a_writer_keeps():
    entries = _entries()
    keep = Keep()
    enc = fdl.Encoder(entries)
    enc.write(keep)
    enc.write(io.BytesIO())  # a second write must not change what the first handed over
    want = io.BytesIO()
    fdl.encode(want, entries)
    assert keep.value() == want.getvalue()


def test_without_torchs_tensor_check_the_python_one_is_used(monkeypatch):
    """A torch without dynamo's TensorGuards (a private API) still gets a complete check."""
    import sys

    monkeypatch.setitem(sys.modules, "torch._C._dynamo.guards", None)  # import fails
    t = torch.zeros(3)
    check = pools.tensor_guard([t])
    assert check([t])
    t.data = torch.zeros(3, dtype=torch.float64)
    assert not check([t])


@contextlib.contextmanager
def _sidecar_with_slot(layout: "layout_mod.Layout"):
    """The sidecar's loop in this process, holding slot 1 laid out as ``layout``:
    (the loop, the slot's memory, the report pipe's reading end)."""
    import multiprocessing.connection as mpc
    import socket

    from snapsvc.format import protocol
    from snapsvc.format.claims import ClaimLock
    from snapsvc.sidecar import worker, writes
    req_w, req_sock = socket.socketpair()
    req_r = mpc.Connection(os.dup(req_sock.fileno()))
    rep_r, rep_w = mpc.Pipe(duplex=False)
    lock = ClaimLock.create()
    try:
        side = worker._Sidecar(req_r, req_sock, rep_w, lock)
        side.later = worker._Later(lambda: writes.Files(None, None))
        flat = staging.allocate(layout)
        socket.send_fds(req_w, [b"\0"], [staging.slot_fd(flat)])  # what follows a SLOT message
        assert side.handle({"op": protocol.SLOT, "slot": 1, "layout": layout.to_msg()})
        assert protocol.unpack(rep_r.recv_bytes())["op"] == protocol.SLOT_OK
        yield side, flat, rep_r
    finally:
        lock.close()
        for c in (req_r, req_sock, req_w, rep_r, rep_w):
            c.close()


def _write(side, flat, rep_r, seq: int, path: str, **extra) -> dict:
    """One WRITE of slot 1 through the loop; its DONE report."""
    from snapsvc.engine.plan import pack_body
    from snapsvc.format import protocol
    staging.claim_word(flat).fill_(seq)
    body = pack_body(path, 0, True, epoch=0, metrics={})
    assert side.handle({"op": protocol.WRITE, "seq": seq, "slot": 1, "sent_at": 0.0,
                        "path": path, "body": body, **extra})
    done = protocol.unpack(rep_r.recv_bytes())
    assert done["op"] == protocol.DONE
    return done


def test_a_slot_the_sidecar_cannot_write_fails_its_writes_not_the_sidecar(tmp_path):
    """Defence in depth behind submit's checks: a layout whose encoder cannot
    be built (a name twice) fails the writes to that slot; the loop goes on."""
    a = torch.ones(2)
    with _sidecar_with_slot(layout_mod.Layout.of([("a", a)], [("a", a)], "")) as harness:
        done = _write(*harness, 5, str(tmp_path / "x.fdl"))
        assert not done["ok"]
        assert "cannot be written" in done["error"] and "appears twice" in done["error"]
        assert os.listdir(tmp_path) == []


def test_a_renamed_write_gets_new_headers_over_the_same_bytes(tmp_path):
    """Names that change over one placement travel alone (``renamed``): the file
    has the new names over the slot's bytes; names that do not match the slot's
    entries fail that write, and the loop goes on."""
    a, b = torch.full((2, 3), 1.5), torch.arange(4.0)
    layout = layout_mod.Layout.of([("a", a), ("b", b)], [], "")
    with _sidecar_with_slot(layout) as (side, flat, rep_r):
        for view, t in zip(staging.views(flat, layout), (a, b)):
            view.copy_(t)
        renamed = layout_mod.Layout.placed(["c", "d"], tuple((s.kind, s.shape, s.dtype)
                                                              for s in layout.specs), "")
        assert renamed.placed_like(layout)
        done = _write(side, flat, rep_r, 5, str(tmp_path / "x.fdl"),
                      renamed=renamed.renamed_msg())
        assert done["ok"], done
        got = snapsvc.read_checkpoint(tmp_path / "x.fdl").entries
        assert list(got) == ["c", "d"] and torch.equal(got["c"], a) and torch.equal(got["d"], b)
        done = _write(side, flat, rep_r, 6, str(tmp_path / "y.fdl"),
                      renamed={"hash": "", "names": ["only"]})
        assert not done["ok"] and "1 names for 2 entries" in done["error"], done
        assert _write(side, flat, rep_r, 7, str(tmp_path / "z.fdl"), layout=layout.to_msg())["ok"]
        assert list(snapsvc.read_checkpoint(tmp_path / "z.fdl").entries) == ["a", "b"]


# -- one tensor of 20,000 (issue 34: the check is one C pass, not a loop per tensor) --------

def _set_other_storage(p: torch.Tensor) -> None:
    with torch.no_grad():
        p.set_(torch.full((p.numel() + 1,), 3.0, dtype=p.dtype))


def _storage_grown_under_it(p: torch.Tensor) -> None:
    # the same storage object, moved to new memory, p's shape as it was: an alias
    # shares the storage, so it moves too (the plan may hold or be remade)
    p.data.resize_(1 << 14)


MANY = 20_000
ONE_OF_MANY = [_same_shape_other_memory, _new_shape, _cast, _set_other_storage,
               _storage_grown_under_it, _swap, _strided]


def _many(shape: tuple[int, ...]) -> nn.Module:
    model = nn.Module()
    for i in range(MANY):
        model.register_parameter(f"p{i}", nn.Parameter(torch.full(shape, float(i % 7))))
    return model


@pytest.mark.parametrize("shape", [(16,), (4, 4)], ids=["1d", "2d"])
def test_one_tensor_of_20000_changed_fails_the_plan(shape):
    """Every change of one parameter among 20,000 that state_dict() shows, or
    that gives a source read through an alias other memory, fails the plan."""
    model = _many(shape)
    sources = list(model.parameters())
    layout = layout_mod.Layout.of(list(model.named_parameters()), [], "")
    plan = pools.Plan.make(pools.walk(model), sources, pools.Pool([pools.Slot(1, layout, False)]))
    assert plan.matches(pools.walk(model))
    p = sources[MANY // 2 + 1]
    old = p.data
    # a 1-D source goes into the cat as itself, read where it is now: its memory may move
    fail = [_new_shape, _cast, _set_other_storage, _strided] + (
        [_same_shape_other_memory] if len(shape) > 1 else [])
    for mutate in fail:
        mutate(p)
        held = plan.matches(pools.walk(model))  # (no pytest repr of 20,000 tensors)
        assert not held, mutate.__name__
        p.data = old
        held = plan.matches(pools.walk(model))
        assert held, mutate.__name__
    _swap(p)  # another object in the model
    held = plan.matches(pools.walk(model))
    assert not held


def test_one_tensor_of_many_changed_reaches_the_file(tmp_path):
    """Through the sidecar, 2,000 parameters (1-D and 2-D in turn; fewer than
    above to keep the test short: the plan's paths are the same): after each
    change of one of them the file equals the model at its submit."""
    model = nn.Module()
    many = MANY // 10
    for i in range(many):
        model.register_parameter(f"p{i}", nn.Parameter(
            torch.full((16,) if i % 2 else (4, 4), float(i % 7))))
    with snapsvc.SnapshotWriter(tmp_path, slots=1) as w:
        w.submit(model, "m0.fdl").result(timeout=60)
        for i, mutate in enumerate(ONE_OF_MANY, 1):
            for name in (f"p{many // 2}", f"p{many // 2 + 1}"):  # a 2-D one and a 1-D one
                mutate(getattr(model, name))
            want = model.state_dict()
            w.submit(model, f"m{i}.fdl").result(timeout=60)
            got = snapsvc.read_checkpoint(tmp_path / f"m{i}.fdl").entries
            assert list(got) == list(want), mutate.__name__
            for k in (f"p{many // 2}", f"p{many // 2 + 1}", f"p{many - 1}"):
                assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), \
                    (mutate.__name__, k)
            same = all(torch.equal(got[k], v) for k, v in want.items())
            assert same, mutate.__name__

"""The writer sidecar: round trips, policies, slot reuse, metadata, keep_last."""

from __future__ import annotations

import errno
import functools
import os
import time
import zlib

import pytest
import torch
from torch import nn

import snapsvc
import snapsvc.files.checkpoint
import snapsvc.engine.pools
import snapsvc.engine.snapshot
import snapsvc.engine.staging
from snapsvc.files.meta import meta_path, read_meta
from conftest import Net, sidecar_children
import hooks

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("no_leaks")]


def model_state(m: nn.Module) -> dict[str, torch.Tensor]:
    """Clones in file order: parameters, then persistent buffers."""
    return {k: v.detach().clone() for k, v in snapsvc.files.checkpoint.model_tensors(m)}


def file_state(path) -> dict[str, torch.Tensor]:
    return snapsvc.read_checkpoint(path).entries


def assert_equal_state(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("name", ["rt.fdl", "rt.fdl.gz"])
def test_roundtrip_bit_exact_with_metrics_and_epoch(tmp_path, net, name):
    with snapsvc.SnapshotWriter(tmp_path, compress_level=2) as w:
        assert w.pid is not None
        report = w.submit(net, name, metrics={"loss": 0.125}, epoch=3).result(timeout=60)
    path = tmp_path / name
    assert report.path == str(path) and not report.skipped
    assert report.bytes == os.path.getsize(path) and report.entries == 9
    assert_equal_state(file_state(path), model_state(net))
    snap = snapsvc.load_snapshot(path)
    assert snap.epoch == 3 and snap.metrics == {"loss": 0.125}
    assert list(snap.buffers) == ["norm.running_mean", "norm.running_var",
                                  "norm.num_batches_tracked"]
    fresh = Net()
    snapsvc.load_checkpoint(path, fresh, strict=True)  # the model's own hash was written
    assert_equal_state(model_state(fresh), model_state(net))


def test_report_timings_and_order(tmp_path, net):
    with snapsvc.SnapshotWriter(tmp_path) as w:
        handles = [w.submit(net, f"o{i}.fdl", epoch=i) for i in range(6)]
        done_order = []
        for h in handles:
            h.add_done_callback(lambda h: done_order.append(h.seq))
        reports = [h.result(timeout=60) for h in handles]
        assert w.is_idle()
        stats = w.stats()
    assert [r.seq for r in reports] == sorted(r.seq for r in reports) == done_order
    for r in reports:
        assert r.stage_s > 0 and r.queue_s >= 0 and r.encode_s > 0 and r.fsync_s > 0
        assert r.total_s >= r.stage_s
    assert stats["written"] == 6 and stats["submitted"] == 6 and stats["pending"] == 0
    assert stats["stall_p50_s"] > 0 and stats["stall_p99_s"] >= stats["stall_p50_s"]


def test_metadata_contents(tmp_path, net):
    with snapsvc.SnapshotWriter(tmp_path) as w:
        w.submit(net, "m.fdl", metrics={"acc": 0.5}, epoch=9).result(timeout=60)
    data = (tmp_path / "m.fdl").read_bytes()
    meta = read_meta(tmp_path / "m.fdl")
    assert meta.size == len(data) and meta.crc32 == zlib.crc32(data)
    assert meta.format_version == 2 and meta.entries == 9 and meta.epoch == 9
    assert meta.metrics == {"acc": 0.5} and meta.structural_hash == snapsvc.structural_hash(net)
    assert meta.buffers == ["norm.running_mean", "norm.running_var", "norm.num_batches_tracked"]
    assert abs(meta.created - os.path.getmtime(tmp_path / "m.fdl")) < 60


def test_torn_snapshot_impossible(tmp_path, net):
    """Change the parameters in place right after submit: files hold the submit-time state."""
    expected = []
    with snapsvc.SnapshotWriter(tmp_path, slots=2) as w:
        handles = []
        for i in range(20):
            expected.append(model_state(net))
            handles.append(w.submit(net, f"t{i}.fdl"))
            with torch.no_grad():
                for p in net.parameters():
                    p.add_(1.0)
                net.norm.num_batches_tracked += 1
        for h in handles:
            h.result(timeout=60)
    for i, state in enumerate(expected):
        assert_equal_state(file_state(tmp_path / f"t{i}.fdl"), state)


def test_policy_block_waits_for_a_slot(tmp_path, net):
    with snapsvc.SnapshotWriter(tmp_path, slots=1, fault_hook=functools.partial(hooks.sleep, 1.0)) as w:
        first = w.submit(net, "b0.fdl")
        second = w.submit(net, "b1.fdl")  # must wait until the only slot is free
        assert first.result(timeout=0.5).path.endswith("b0.fdl")  # done already, not in 1 s
        r1, r2 = first.result(), second.result(timeout=60)
        assert not r2.skipped
    # the report tells the wait for a slot (backpressure) apart from the copy
    assert r2.slot_wait_s > r1.slot_wait_s >= 0 and r2.slot_wait_s <= r2.stage_s
    assert (tmp_path / "b1.fdl").exists()


def test_policy_skip(tmp_path, net):
    with snapsvc.SnapshotWriter(tmp_path, slots=1, policy="skip",
                                fault_hook=functools.partial(hooks.sleep, 1.0)) as w:
        first = w.submit(net, "s0.fdl")
        second = w.submit(net, "s1.fdl")
        assert second.done() and second.result().skipped and second.result().bytes == 0
        assert not first.result(timeout=60).skipped
        assert w.stats()["skipped"] == 1
    assert (tmp_path / "s0.fdl").exists() and not (tmp_path / "s1.fdl").exists()


def test_policy_latest_replaces_newest_queued(tmp_path, net):
    with snapsvc.SnapshotWriter(tmp_path, slots=2, policy="latest",
                                fault_hook=functools.partial(hooks.sleep, 1.0)) as w:
        a = w.submit(net, "a.fdl", epoch=1)
        b = w.submit(net, "b.fdl", epoch=2)  # queued behind a
        with torch.no_grad():
            net.head.bias.fill_(42.0)
        c = w.submit(net, "c.fdl", epoch=3)  # no free slot: replaces b
        assert b.done() and b.result().skipped
        assert not a.result(timeout=60).skipped and not c.result(timeout=60).skipped
    assert not (tmp_path / "b.fdl").exists()
    assert torch.equal(file_state(tmp_path / "c.fdl")["head.bias"], torch.full((2,), 42.0))
    assert snapsvc.load_snapshot(tmp_path / "c.fdl").epoch == 3


def test_slot_reuse_allocates_nothing_after_warmup(tmp_path, net):
    def footprint(w):
        return (len(os.listdir("/proc/self/fd")), len(os.listdir("/dev/shm")),
                len(os.listdir(f"/proc/{w.pid}/fd")), w.stats()["slot_bytes"])

    with snapsvc.SnapshotWriter(tmp_path, slots=2) as w:
        for i in range(4):  # warm-up: both slots allocated and mapped
            w.submit(net, f"w{i}.fdl").result(timeout=60)
        before = footprint(w)
        handles = [w.submit(net, f"r{i % 3}.fdl") for i in range(20)]
        for h in handles:
            h.result(timeout=60)
        after = footprint(w)
    assert after == before
    layout = snapsvc.format.layout.Layout.of(*snapsvc.engine.snapshot.model_sources(net), "")
    # two slots (arenas: a page and some room beyond the layout), nothing per snapshot
    assert before[3] == 2 * snapsvc.engine.pools.arena_bytes(layout)


def test_sidecar_is_a_fresh_interpreter_at_lower_priority(tmp_path, net):
    """Not a multiprocessing child (which imports __main__): see test_sidecar_start.py."""
    with snapsvc.SnapshotWriter(tmp_path, nice=7) as w:
        assert sidecar_children() == [w.pid]
        assert b"multiprocessing" not in open(f"/proc/{w.pid}/cmdline", "rb").read()
        assert os.getpriority(os.PRIO_PROCESS, w.pid) == os.getpriority(os.PRIO_PROCESS, 0) + 7


@pytest.mark.parametrize("cuda", [False, True])
def test_default_nice_yields_the_cpu_only_beside_a_cuda_job(tmp_path, monkeypatch, cuda):
    """nice=None: a CPU run's sidecar shares the CPU at training's priority (niced, it
    falls behind a loop that keeps every core busy); beside a process that has
    initialized CUDA, whose CPU is spare, it yields at nice +10. Either way a batch
    task: the WRITE that wakes it never preempts the trainer's returning submit."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: cuda)
    with snapsvc.SnapshotWriter(tmp_path) as w:
        w.start()
        assert os.getpriority(os.PRIO_PROCESS, w.pid) == \
            min(19, os.getpriority(os.PRIO_PROCESS, 0) + (10 if cuda else 0))
        assert os.sched_getscheduler(w.pid) == os.SCHED_BATCH


def test_pid_none_before_start_and_autostart(tmp_path, net):
    w = snapsvc.SnapshotWriter(tmp_path)
    assert w.pid is None and w.is_idle()
    try:
        w.submit(net, "auto.fdl").result(timeout=60)
        assert w.pid is not None
    finally:
        w.close()
    assert (tmp_path / "auto.fdl").exists()
    with pytest.raises(RuntimeError, match="closed"):
        w.submit(net, "again.fdl")


def test_submit_a_model_snapshot(tmp_path, net):
    snap = snapsvc.snapshot_cpu(net, metrics={"loss": 1.5}, epoch=4)
    with snapsvc.SnapshotWriter(tmp_path) as w:
        w.submit(snap, "snap.fdl").result(timeout=60)
        w.submit(snap, "snap5.fdl", epoch=5).result(timeout=60)
    back = snapsvc.load_snapshot(tmp_path / "snap.fdl")
    assert back.epoch == 4 and back.metrics == {"loss": 1.5}
    assert snapsvc.load_snapshot(tmp_path / "snap5.fdl").epoch == 5
    assert_equal_state(file_state(tmp_path / "snap.fdl"), model_state(net))


def test_two_layouts_get_their_own_slots(tmp_path, net):
    with snapsvc.SnapshotWriter(tmp_path, slots=1) as w:
        w.submit(net, "n.fdl").result(timeout=60)
        w.submit(nn.Linear(3, 3), "l.fdl").result(timeout=60)
        w.submit(net, "n2.fdl").result(timeout=60)
    assert snapsvc.checkpoint_keys(tmp_path / "l.fdl") == ["weight", "bias"]
    assert_equal_state(file_state(tmp_path / "n2.fdl"), model_state(net))


def test_keep_last(tmp_path, net):
    (tmp_path / "not-mine.fdl").write_bytes(b"x")
    with snapsvc.SnapshotWriter(tmp_path, keep_last=2) as w:
        for i in range(5):
            w.submit(net, f"k{i}.fdl").result(timeout=60)
            kept = sorted(p for p in os.listdir(tmp_path) if p.startswith("k"))
            newest = [f"k{j}.fdl" for j in range(max(0, i - 1), i + 1)]
            assert kept == sorted(newest + [n + ".meta" for n in newest])
    assert (tmp_path / "not-mine.fdl").exists()


def test_overwritten_and_rotated_files_are_freed_after_the_report(tmp_path, net):
    """Old data is set aside under a temp name, freed once the report is out:
    at close nothing but the kept checkpoints remains."""
    with snapsvc.SnapshotWriter(tmp_path, keep_last=2) as w:
        for i in range(6):
            with torch.no_grad():
                net.head.bias.fill_(i)
            w.submit(net, f"s{i % 3}.fdl").result(timeout=60)
            assert (tmp_path / f"s{i % 3}.fdl").exists()
    assert sorted(os.listdir(tmp_path)) == ["s1.fdl", "s1.fdl.meta", "s2.fdl", "s2.fdl.meta"]
    assert torch.equal(file_state(tmp_path / "s2.fdl")["head.bias"], torch.full((2,), 5.0))


def test_write_error_is_reported_and_sidecar_keeps_serving(tmp_path, net):
    gone = tmp_path / "gone"
    with snapsvc.SnapshotWriter(tmp_path) as w:
        w.submit(net, gone / "a.fdl").result(timeout=60)  # creates the directory
        for name in os.listdir(gone):
            os.unlink(gone / name)
        gone.rmdir()
        bad = w.submit(net, gone / "x.fdl")  # created once per writer: now it fails there
        with pytest.raises(snapsvc.WriteFailedError) as ei:
            bad.result(timeout=60)
        assert ei.value.errno == errno.ENOENT
        assert ei.value.filename == str(gone / "x.fdl")
        assert isinstance(ei.value, OSError)
        assert not w.submit(net, "fine.fdl").result(timeout=60).skipped
        assert w.stats()["failed"] == 1
    assert not os.path.exists(meta_path(gone / "x.fdl"))


def test_nested_directories_in_a_path_are_created(tmp_path, net):
    with snapsvc.SnapshotWriter(tmp_path) as w:
        w.submit(net, "a/b/c.fdl").result(timeout=60)
    assert snapsvc.verify(tmp_path / "a" / "b" / "c.fdl").ok


@pytest.mark.parametrize("path", ["", ".", "sub/", "sub/..", "existing"])
def test_a_path_naming_a_directory_is_refused_at_submit(tmp_path, net, path):
    (tmp_path / "existing").mkdir()
    with snapsvc.SnapshotWriter(tmp_path) as w:
        with pytest.raises(ValueError, match="directory"):
            w.submit(net, path)
        assert w.is_idle() and w.stats()["submitted"] == 0


def test_unsupported_dtype_refused_at_submit(tmp_path, net):
    # neither the .fdl nor the data file takes it (a bool buffer goes to the data file)
    net.register_buffer("mask", torch.zeros(3, dtype=torch.float8_e4m3fnuz))
    with snapsvc.SnapshotWriter(tmp_path) as w:
        with pytest.raises(snapsvc.EncodeError, match="'mask'"):
            w.submit(net, "bad.fdl")
        assert w.is_idle()
    assert not (tmp_path / "bad.fdl").exists()


@pytest.mark.parametrize("kwargs,match", [
    ({"slots": 0}, "slots"), ({"policy": "newest"}, "policy"),
    ({"keep_last": 0}, "keep_last"), ({"compress_level": 9}, "compress_level"),
    ({"nice": 20}, "nice")])
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        snapsvc.SnapshotWriter(**kwargs)


def test_replaced_resized_or_cast_tensors_are_seen(tmp_path, net):
    """submit() caches a model's plan; any change to its tensors must invalidate it."""
    with snapsvc.SnapshotWriter(tmp_path, slots=1) as w:
        w.submit(net, "p0.fdl").result(timeout=60)
        net.head.bias = nn.Parameter(torch.full((2,), 7.0))           # replaced object
        w.submit(net, "p1.fdl").result(timeout=60)
        net.head.bias.data = torch.full((5,), 3.0)                    # same object, new shape
        w.submit(net, "p2.fdl").result(timeout=60)
        net.norm.running_mean.data = net.norm.running_mean.double()   # same object, new dtype
        w.submit(net, "p3.fdl").result(timeout=60)
        net.register_buffer("step", torch.tensor(11))                 # a new buffer
        w.submit(net, "p4.fdl").result(timeout=60)
    assert torch.equal(file_state(tmp_path / "p1.fdl")["head.bias"], torch.full((2,), 7.0))
    assert torch.equal(file_state(tmp_path / "p2.fdl")["head.bias"], torch.full((5,), 3.0))
    assert file_state(tmp_path / "p3.fdl")["norm.running_mean"].dtype == torch.float64
    assert file_state(tmp_path / "p4.fdl")["step"].item() == 11


def test_bad_message_fields_take_no_slot(tmp_path, net):
    with snapsvc.SnapshotWriter(tmp_path, slots=1) as w:
        with pytest.raises(ValueError):
            w.submit(net, "bad.fdl", metrics={"loss": "not a number"})
        # the only slot is still free: this would block forever otherwise
        assert not w.submit(net, "good.fdl").result(timeout=60).skipped


def test_submit_from_a_done_callback_is_refused_not_deadlocked(tmp_path, net):
    errors = []

    def callback(handle):
        try:
            w.submit(net, "from-callback.fdl")
        except RuntimeError as e:
            errors.append(str(e))

    with snapsvc.SnapshotWriter(tmp_path, fault_hook=functools.partial(hooks.sleep, 0.5)) as w:
        h = w.submit(net, "a.fdl")
        h.add_done_callback(callback)  # pending: it will run on the reader thread
        h.result(timeout=60)
        deadline = time.monotonic() + 10
        while not errors and time.monotonic() < deadline:
            time.sleep(0.01)
    assert errors and "deadlock" in errors[0]

"""snapsvc.lightning.SnapsvcCheckpointIO with real Lightning Trainers (CPU)."""

from __future__ import annotations

import argparse
import copy
import errno
import functools
import importlib.util
import json
import os
import subprocess
import sys
import threading
from collections import OrderedDict

import pytest
import torch

import snapsvc
from snapsvc.errors import WriteFailedError

import hooks
import lightning_script
from conftest import leak_checked

HERE = os.path.dirname(os.path.abspath(__file__))
FLAVOURS = [f for f in ("pytorch_lightning", "lightning.pytorch") if importlib.util.find_spec(f.split(".")[0])]
if not FLAVOURS:
    pytest.skip("Lightning is not installed: pip install 'snapsvc[lightning]'", allow_module_level=True)

from snapsvc.lightning import SnapsvcCheckpointIO  # noqa: E402  (needs one flavour)


CASES = [("pytorch_lightning", "snapsvc"), ("lightning.pytorch", "snapsvc"), (FLAVOURS[0], "default")]


@pytest.fixture(scope="module")
def resumed_in_a_new_process(tmp_path_factory, _warm_sidecar) -> dict:
    """Each case (flavour, io) of the test below fitted 2 epochs here, then all resumed with
    fit(ckpt_path=epoch 1) to 4 in one new process (a Lightning import each would be most of
    the cost): {case: (its directory, the JSON line of its resume)}."""
    top = tmp_path_factory.mktemp("resume")
    cases, argv = [], []
    with leak_checked(str(top)):
        for flavour, io in CASES:
            if importlib.util.find_spec(flavour.split(".")[0]) is None:
                continue
            d = top / f"{flavour}-{io}"
            lightning_script.fit(flavour, io, str(d / "first"), 2)
            ckpt = d / "first" / f"epoch=1-step={2 * lightning_script.BATCHES}.ckpt"
            cases.append((flavour, io))
            argv += [flavour, io, str(d / "resumed"), "4", str(ckpt), str(d / "resumed.pt")]
        proc = subprocess.run([sys.executable, os.path.join(HERE, "lightning_script.py"), *argv],
                              capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(line) for line in proc.stdout.strip().splitlines() if line.startswith("{")]
    assert len(lines) == len(cases), proc.stdout[-4000:]
    return {case: (top / f"{case[0]}-{case[1]}", line) for case, line in zip(cases, lines)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("flavour, io", CASES)
def test_resume_in_a_new_process_is_bit_identical(tmp_path, flavour, io, no_leaks, request):
    """4 epochs in one go == 2 epochs, then fit(ckpt_path=epoch 1) to 4 in a new process.
    io="default" is the control: Lightning's own torch.save checkpoints."""
    pytest.importorskip(flavour)
    d, got = request.getfixturevalue("resumed_in_a_new_process")[flavour, io]
    _, full, _ = lightning_script.fit(flavour, io, str(tmp_path / "full"), 4)
    ckpt = d / "first" / f"epoch=1-step={2 * lightning_script.BATCHES}.ckpt"
    if io == "snapsvc":  # written by the sidecar, not by torch.save
        assert snapsvc.verify(ckpt).ok
    # it resumed at epoch 2: trained only the last two epochs
    assert got == {"global_step": 4 * lightning_script.BATCHES, "batches": 2 * lightning_script.BATCHES}
    want, resumed = full.state_dict(), torch.load(d / "resumed.pt")
    assert list(resumed) == list(want)
    for k in want:
        assert torch.equal(resumed[k], want[k]), k


@pytest.mark.timeout(180)
def test_save_top_k_1_leaves_one_checkpoint_and_no_companion_files(tmp_path, no_leaks):
    # epoch 0's write is held 3 s, so Lightning removes it (after saving epoch 1) while it is pending
    d = tmp_path / "ckpts"
    lightning_script.fit(FLAVOURS[0], "snapsvc", str(d), 4,
                         checkpoint={"every_n_epochs": 1, "save_top_k": 1},
                         fault_hook=functools.partial(hooks.pause, "open", "epoch=0", 3.0))
    last = d / f"epoch=3-step={4 * lightning_script.BATCHES}.ckpt"
    assert sorted(os.listdir(d)) == sorted(os.path.basename(f) for f in snapsvc.checkpoint_files(str(last)))
    assert [f for f in os.listdir(d) if f.endswith(".ckpt")] == [last.name]
    assert snapsvc.verify(last).ok


@pytest.mark.timeout(180)
def test_failed_write_fails_the_fit(tmp_path, no_leaks):
    d = tmp_path / "ckpts"
    d.mkdir()
    (d / hooks.FLAG).touch()
    with pytest.raises(WriteFailedError) as info:
        lightning_script.fit(FLAVOURS[0], "snapsvc", str(d), 3,
                             fault_hook=functools.partial(hooks.raise_errno, "open", errno.ENOSPC))
    assert info.value.errno == errno.ENOSPC
    assert not [f for f in os.listdir(d) if f.endswith(".ckpt")]


def lightning_like() -> dict:
    """What Lightning's checkpoint dict holds: int keys, OrderedDict, tuples, 0-dim tensors, inf."""
    return {
        "epoch": 1, "global_step": 12, "pytorch-lightning_version": "2.6.6",
        "state_dict": OrderedDict([("net.0.weight", torch.randn(4, 3)),
                                   ("net.1.num_batches_tracked", torch.tensor(12))]),
        "optimizer_states": [{"state": {0: {"step": torch.tensor(12.0), "exp_avg": torch.randn(4, 3)}},
                              "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "params": [0]}]}],
        "lr_schedulers": [{"step_size": 1, "_last_lr": [0.005], "last_epoch": 2}],
        "callbacks": {"ModelCheckpoint{'monitor': None}": {"kth_value": torch.tensor(float("inf")),
                                                            "best_model_score": None, "dirpath": "/x"}},
        "hyper_parameters": {"lr": 0.01, "cfg": {"layers": [1, 2]}},
    }


def assert_same(got, want, where="checkpoint"):
    if isinstance(want, dict):  # OrderedDict comes back as OrderedDict, as torch.load gives it
        assert type(got) is type(want) and list(got) == list(want), where
        for k in want:
            assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want), where
    elif isinstance(want, (list, tuple)):  # tuple stays tuple
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    else:
        assert type(got) is type(want) and got == want, where


@pytest.mark.timeout(120)
def test_load_waits_for_the_pending_write_and_returns_the_dict(tmp_path, no_leaks):
    io = SnapsvcCheckpointIO(fault_hook=functools.partial(hooks.sleep, 1.0))
    state = lightning_like()
    want = copy.deepcopy(state)
    try:
        io.save_checkpoint(state, tmp_path / "a.ckpt")
        state["state_dict"]["net.0.weight"].add_(1)  # after save returns: must not reach the file
        got = io.load_checkpoint(tmp_path / "a.ckpt")  # the write is still held by the hook here
        moved = io.load_checkpoint(tmp_path / "a.ckpt", map_location="meta")
        assert moved["optimizer_states"][0]["state"][0]["step"].device.type == "meta"
        with pytest.raises(TypeError, match="map_location"):
            io.load_checkpoint(tmp_path / "a.ckpt", map_location=lambda storage, loc: storage)
    finally:
        io.teardown()
    assert_same(got, want)


@pytest.mark.timeout(120)
def test_failed_write_raises_once_at_next_save_and_at_teardown(tmp_path, no_leaks):
    (tmp_path / hooks.FLAG).touch()
    io = SnapsvcCheckpointIO(fault_hook=functools.partial(hooks.raise_errno, "open", errno.ENOSPC))
    try:
        io.save_checkpoint(lightning_like(), tmp_path / "a.ckpt")
        io.writer.wait_path(str(tmp_path / "a.ckpt"), timeout=60)
        with pytest.raises(WriteFailedError, match="a.ckpt"):
            io.save_checkpoint(lightning_like(), tmp_path / "b.ckpt")
        io.save_checkpoint(lightning_like(), tmp_path / "c.ckpt")  # a is reported once; c fails in turn
        with pytest.raises(WriteFailedError, match="c.ckpt"):
            io.teardown()
        assert io.writer is None
    finally:
        io.teardown()  # nothing left to report
    assert not list(tmp_path.glob("*.ckpt"))


@pytest.mark.timeout(120)
def test_hyper_parameters_the_state_api_refuses_name_their_key(tmp_path, no_leaks):
    state = lightning_like()
    state["hyper_parameters"]["args"] = argparse.Namespace(lr=0.1, cb=print)  # a Namespace is stored, print not
    io = SnapsvcCheckpointIO()
    try:
        with pytest.raises(TypeError, match=r"hyper_parameters.*args.*cb.*builtin_function"):
            io.save_checkpoint(state, tmp_path / "a.ckpt")
    finally:
        io.teardown()
    assert not os.listdir(tmp_path)


def test_options_that_would_lose_checkpoints_are_refused():
    with pytest.raises(ValueError, match="policy='block'"):
        SnapsvcCheckpointIO(policy="skip")
    with pytest.raises(ValueError, match="slots"):  # writer options are checked at once
        SnapsvcCheckpointIO(slots=0)
    with pytest.raises(TypeError, match="storage_options"):
        SnapsvcCheckpointIO().save_checkpoint({}, "x.ckpt", storage_options={"a": 1})


@pytest.mark.timeout(60)
def test_import_snapsvc_does_not_import_lightning():
    code = ("import sys, snapsvc; bad = [m for m in sys.modules if m.split('.')[0] in "
            "('lightning', 'pytorch_lightning', 'lightning_fabric')]; assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.timeout(120)
def test_removing_a_checkpoint_still_being_written_does_not_wait_for_it(tmp_path, no_leaks):
    """ModelCheckpoint removes a top-k file right after the next save, often while the
    sidecar still writes it: the removal returns at once, the path exists for no one from
    then on, its files go once written; a save of the same path afterwards stands."""
    io = SnapsvcCheckpointIO(fault_hook=functools.partial(hooks.pause, "open", "held", 3.0))
    held, again = tmp_path / "held.ckpt", tmp_path / "again.ckpt"
    try:
        io.save_checkpoint(lightning_like(), held)
        io.save_checkpoint(lightning_like(), again)   # queued behind the held write
        assert io.pending(held)
        io.remove_checkpoint(held)
        assert io.removing(held) and not io.pending(held)
        assert io.writer.stats()["written"] == 0   # returned without waiting for the write
        io.remove_checkpoint(again)
        io.save_checkpoint(lightning_like(), again)   # the removal behind the old write first
        assert not io.removing(again) and io.pending(again)
        with pytest.raises(FileNotFoundError):
            io.load_checkpoint(held)   # as Lightning's own IO: a removed file is not there
    finally:
        io.teardown()
    assert sorted(os.listdir(tmp_path)) == sorted(
        os.path.basename(f) for f in snapsvc.checkpoint_files(str(again)))
    assert snapsvc.verify(again).ok


@pytest.mark.timeout(120)
def test_removing_a_written_checkpoint_does_not_wait_for_the_unlink(tmp_path, monkeypatch, no_leaks):
    """Unlinking a large file written durably can take as long as copying it (a file system
    that discards the freed blocks): remove_checkpoint returns before the files are gone, the
    path exists for no one from then on, and a save of it, a load and teardown finish the
    removal first; a removal that fails is raised there, once."""
    import snapsvc.integrations.lightning.plugin as plugin
    unlinking, go = threading.Event(), threading.Event()
    remove = os.remove

    def held_remove(name):
        if os.path.dirname(name) == str(tmp_path):
            unlinking.set()
            go.wait(10)   # released below; with an unlink on the caller's thread the asserts fail
        if os.path.basename(name).startswith("bad"):
            raise PermissionError(errno.EACCES, "denied", name)
        remove(name)

    monkeypatch.setattr(plugin.os, "remove", held_remove)
    io = SnapsvcCheckpointIO()
    done, bad = tmp_path / "done.ckpt", tmp_path / "bad.ckpt"
    try:
        for path in (done, bad):
            io.save_checkpoint(lightning_like(), path)
            io.writer.wait_path(path, timeout=60)
        io.remove_checkpoint(done)
        assert unlinking.wait(10) and not go.is_set()   # returned while the unlink is held
        assert io.removing(done) and not io.pending(done)
        io.remove_checkpoint(done)   # again, as Lightning may: nothing more to do
        go.set()
        io.save_checkpoint(lightning_like(), done)   # the removal first, then this save stands
        assert not io.removing(done)
        io.remove_checkpoint(bad)
        with pytest.raises(PermissionError):
            io.load_checkpoint(bad)   # the failed removal, raised where the path is used
        assert not io.removing(bad)
    finally:
        go.set()
        io.teardown()
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(f) for f in
                                                  snapsvc.checkpoint_files(str(done)) +
                                                  snapsvc.checkpoint_files(str(bad)))
    assert snapsvc.verify(done).ok

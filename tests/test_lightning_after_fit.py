"""SnapsvcCheckpointIO after ``fit`` and across processes, against stock Lightning (issue 30, items 10-16).

Each test runs the stock trainer (Lightning's own torch.save IO) as the control in the same test.
"""

from __future__ import annotations

import gc
import os
import pickle

import numpy as np

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from conftest import _open_fds, _shm_entries, sidecar_children  # noqa: E402
from snapsvc.errors import UnsupportedStateError  # noqa: E402
from snapsvc.lightning import SnapsvcCheckpointIO  # noqa: E402
from test_lightning_overlap import slow_copy  # noqa: E402,F401  (a fixture)
from test_lightning_stock import Lit, data, read, trainer  # noqa: E402


def _children() -> set[int]:
    """Live child processes of this process (the sidecars among them)."""
    pids: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            pids |= {int(p) for p in f.read().split()}
    return {p for p in pids if os.path.exists(f"/proc/{p}") and
            open(f"/proc/{p}/stat").read().split(")")[-1].split()[0] != "Z"}


# -- items 10, 14: a save after fit is whole when it returns, and its sidecar stops ------------------

@pytest.mark.timeout(240)
def test_a_save_after_fit_is_readable_at_once_and_leaves_no_sidecar(tmp_path, no_leaks):
    before = _children()
    for io in ("default", "snapsvc"):
        torch.manual_seed(0)
        t = trainer(io, [], max_steps=2, limit_val_batches=1)
        model = Lit()
        t.fit(model, data(2), data(1))
        p = str(tmp_path / f"{io}.ckpt")
        t.save_checkpoint(p)
        # read at once, by another reader in the process: stock's file is complete
        loaded = Lit.load_from_checkpoint(p)
        assert torch.equal(loaded.net.weight, model.net.weight), io
        other = trainer(io, [], limit_val_batches=1)
        other.validate(Lit(), data(1), ckpt_path=p)
        assert _children() == before, f"{io}: a sidecar still runs after the save returned"
        del t, other
    # no_leaks: no /dev/shm entry is left behind


# -- item 16: overlap=True, a save after fit copies everything before returning ---------------------

class AdamLit(Lit):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


@pytest.mark.timeout(240)
@pytest.mark.usefixtures("slow_copy")
def test_an_overlap_save_after_fit_holds_the_state_at_the_save(tmp_path, no_leaks):
    """A deferred copy would run only at the load, after the zeroing (slow_copy)."""
    saved = {}
    for io in ("default", "snapsvc"):
        torch.manual_seed(0)
        options = {"io_options": {"overlap": True}} if io == "snapsvc" else {}
        t = trainer(io, [], max_steps=2, limit_val_batches=0, **options)
        t.fit(AdamLit(), data(2))
        p = str(tmp_path / f"{io}.ckpt")
        t.save_checkpoint(p)
        want = t.optimizers[0].state_dict()["state"][0]["exp_avg"].clone()
        for s in t.optimizers[0].state.values():  # a change right after the save
            s["exp_avg"].zero_()
        state = t.strategy.checkpoint_io.load_checkpoint(p)
        saved[io] = state["optimizer_states"][0]["state"][0]["exp_avg"]
        assert torch.equal(saved[io], want) and want.abs().sum() > 0, io


# -- item 11: the plugin pickles as stock's IO does (ddp_spawn) ------------------------------------

def test_the_plugin_pickles_as_stocks_io_does(tmp_path, no_leaks):
    stock = pl.plugins.TorchCheckpointIO()
    pickle.loads(pickle.dumps(stock))  # the control
    io = SnapsvcCheckpointIO(timeout=7.0)
    io.save_checkpoint({"x": torch.ones(2)}, str(tmp_path / "a.ckpt"))  # a sidecar, locks, threads
    copy = pickle.loads(pickle.dumps(io))
    assert copy.timeout == 7.0 and copy.writer is None
    io.teardown()  # written: the copy (another process under ddp_spawn) reads it
    assert torch.equal(copy.load_checkpoint(str(tmp_path / "a.ckpt"))["x"], torch.ones(2))
    copy.teardown()


def _spawn_fit_and_resume(io: str, d) -> dict:
    """A ddp_spawn fit, its checkpoint read, and a resume from it: what each gave (private copies:
    spawning shares the parent's tensors through memory that lives as long as they do)."""
    torch.manual_seed(0)
    model = Lit()
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=d, filename="c")
    plugins = [SnapsvcCheckpointIO()] if io == "snapsvc" else []
    pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", plugins=plugins, callbacks=[ckpt],
               max_steps=2, limit_val_batches=0, logger=False, enable_progress_bar=False,
               enable_model_summary=False, default_root_dir=d).fit(model, data(4))
    saved = read(io, ckpt.best_model_path)
    resumed = trainer(io, [], max_steps=3, limit_val_batches=0)
    again = Lit()
    resumed.fit(again, data(4), ckpt_path=ckpt.best_model_path)
    def copy(sd): return {k: v.clone() for k, v in sd.items()}
    return {"model": copy(model.state_dict()), "saved": copy(saved["state_dict"]),
            "step": saved["global_step"], "groups": saved["optimizer_states"][0]["param_groups"],
            "resumed": copy(again.state_dict()), "resumed_step": resumed.global_step}


@pytest.mark.timeout(240)
def test_a_ddp_spawn_fit_saves_loads_and_resumes_as_with_stock(tmp_path, _warm_sidecar):
    """Item 11 in a real fit: two spawned gloo ranks pickle the plugin, rank 0 saves through its
    copy, the parent gets the trained weights back through Lightning's temp checkpoint, and the
    file loads and resumes exactly as stock's, leaving behind no more than stock."""
    def shm() -> set[str]:   # not the RAM tier's root: every writer of this user shares it
        return {e for e in _shm_entries() if "/" not in e}
    got, left = {}, {}
    for io in ("default", "snapsvc"):
        gc.collect()
        before, fds = shm(), _open_fds()
        got[io] = _spawn_fit_and_resume(io, tmp_path / io)
        gc.collect()
        assert not shm() - before and not sidecar_children(), io
        left[io] = sorted(os.readlink(f"/proc/self/fd/{fd}").split("_")[0] for fd in _open_fds() - fds
                          if os.path.exists(f"/proc/self/fd/{fd}"))
    stock, ours = got["default"], got["snapsvc"]
    assert ours["step"] == stock["step"] == 2 and ours["resumed_step"] == stock["resumed_step"] == 3
    assert ours["groups"] == stock["groups"]
    for part in ("saved", "model", "resumed"):   # the file, the parent's model, the resumed one
        assert ours[part].keys() == stock[part].keys(), part
        for k, v in stock[part].items():
            assert torch.equal(ours[part][k], v), (part, k)
    assert not torch.equal(stock["resumed"]["net.weight"], stock["model"]["net.weight"])  # trained on
    # the first spawn opens multiprocessing's own helpers, which live on: nothing more than stock
    assert len(left["snapsvc"]) <= len(left["default"]), left


# -- item 19: snapsvc.verify on a save_last="link" checkpoint -------------------------------------

@pytest.mark.timeout(180)
def test_verify_accepts_a_last_link_that_loads_as_with_stock(tmp_path, no_leaks):
    import snapsvc
    for io in ("default", "snapsvc"):
        d = tmp_path / io
        ckpt = pl.callbacks.ModelCheckpoint(dirpath=d, save_last="link")
        trainer(io, [ckpt], max_steps=2, limit_val_batches=0).fit(Lit(), data(2))
        last = d / "last.ckpt"
        assert os.path.islink(last), io
        Lit.load_from_checkpoint(last)  # the link loads, with either IO
    report = snapsvc.verify(tmp_path / "snapsvc" / "last.ckpt")
    assert report.ok, report.problems


# -- item 13: values stock pickles, added in on_save_checkpoint ------------------------------------

class Extra(Lit):
    def on_save_checkpoint(self, checkpoint):
        checkpoint["seen"] = {1, 2}
        checkpoint["np_rng"] = np.random.get_state()


@pytest.mark.timeout(180)
def test_values_added_in_on_save_checkpoint_round_trip_as_with_stock(tmp_path, no_leaks):
    got = {}
    for io in ("default", "snapsvc"):
        ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / io, filename="c")
        trainer(io, [ckpt], max_steps=2, limit_val_batches=0).fit(Extra(), data(2))
        got[io] = read(io, ckpt.best_model_path)
    assert got["snapsvc"]["seen"] == got["default"]["seen"] == {1, 2}
    want, ours = got["default"]["np_rng"], got["snapsvc"]["np_rng"]
    assert type(ours) is tuple and ours[0] == want[0] and np.array_equal(ours[1], want[1])
    assert tuple(ours[2:]) == tuple(want[2:])


class Tracker:
    """A plain object: stock's pickle stores it, snapsvc (which never pickles) cannot."""

    def __init__(self) -> None:
        self.seen = 3


class Steps(Lit):
    steps = 0

    def training_step(self, batch, idx):
        type(self).steps += 1
        return super().training_step(batch, idx)


class TrackedByModel(Steps):
    def on_save_checkpoint(self, checkpoint):
        checkpoint["tracker"] = Tracker()


class TrackerState(pl.Callback):
    def state_dict(self):
        return {"tracker": Tracker()}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("where", ["on_save_checkpoint", "callback state_dict"])
def test_what_cannot_come_back_is_refused_at_fit_start(tmp_path, where, no_leaks):
    """Item 13: stock pickles the object at each save; the plugin cannot store it and says so
    when fit starts, before a training step, not at the first save an epoch in."""
    for io in ("default", "snapsvc"):
        model_cls = TrackedByModel if where == "on_save_checkpoint" else Steps
        model_cls.steps = 0
        ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / io, filename="c")
        callbacks = [ckpt] + ([TrackerState()] if where == "callback state_dict" else [])
        t = trainer(io, callbacks, max_steps=2, limit_val_batches=0)
        if io == "default":   # the control: trained, and the object is in its file
            t.fit(model_cls(), data(2))
            got = torch.load(ckpt.best_model_path, weights_only=False)
            assert isinstance(got["tracker"] if where == "on_save_checkpoint" else
                              got["callbacks"]["TrackerState"]["tracker"], Tracker)
            assert model_cls.steps == 2
            continue
        with pytest.raises(UnsupportedStateError, match=r"(?s)fit start.*tracker.*Tracker"):
            t.fit(model_cls(), data(2))
        assert model_cls.steps == 0, "refused only after training started"
        assert not os.path.exists(tmp_path / io) or os.listdir(tmp_path / io) == []

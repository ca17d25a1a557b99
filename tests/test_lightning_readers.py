"""SnapsvcCheckpointIO's readers against stock Lightning (issue 30, items 10, 12, 14; item 15,
a rank-0-only load under DDP, is in test_lightning_stock.py: one DDP launch runs both).

Each test runs the stock trainer (Lightning's own torch.save IO) as the control in the same test.
"""

from __future__ import annotations

import functools
import gc
import os
import time

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from snapsvc.lightning import SnapsvcCheckpointIO  # noqa: E402

import hooks  # noqa: E402
from test_lightning_after_fit import _children  # noqa: E402
from test_lightning_stock import Lit, data, trainer  # noqa: E402


# -- item 10: a reader waits for a pending write of its path, whichever plugin owns it -----------

@pytest.mark.timeout(120)
def test_another_plugin_loads_a_checkpoint_still_being_written(tmp_path, no_leaks):
    p = str(tmp_path / "a.ckpt")
    writer = SnapsvcCheckpointIO(fault_hook=functools.partial(hooks.sleep, 1.5))
    reader = SnapsvcCheckpointIO()
    try:
        writer.save_checkpoint({"x": torch.arange(1000.0)}, p)
        assert writer.pending(p)
        assert torch.equal(reader.load_checkpoint(p)["x"], torch.arange(1000.0))
        writer.save_checkpoint({"x": torch.ones(3)}, p)  # a removal waits for it too, then removes
        reader.remove_checkpoint(p)
        reader.teardown()
        writer.teardown()
        assert not os.path.exists(p)
    finally:
        writer.teardown()
        reader.teardown()


class WithTestStep(Lit):
    def test_step(self, batch, idx):
        return self.validation_step(batch, idx)


@pytest.mark.timeout(240)
def test_test_and_resume_from_a_save_after_fit_as_with_stock(tmp_path, no_leaks):
    for io in ("default", "snapsvc"):
        torch.manual_seed(0)
        model = Lit()
        t = trainer(io, [], max_steps=2, limit_val_batches=0)
        t.fit(model, data(2))
        p = str(tmp_path / f"{io}.ckpt")
        t.save_checkpoint(p)
        tested = WithTestStep()
        trainer(io, [], limit_test_batches=1).test(tested, data(1), ckpt_path=p, verbose=False)
        assert torch.equal(tested.net.weight, model.net.weight), io
        resumed = trainer(io, [], max_steps=3, limit_val_batches=0)
        resumed.fit(Lit(), data(2), ckpt_path=p)
        assert resumed.global_step == 3, io


# -- item 12: ddp_fork, the parent loads what the rank-0 child saved -------------------------------

@pytest.mark.timeout(240)
def test_ddp_fork_fit_returns_the_trained_model(tmp_path, no_leaks):
    for io in ("default", "snapsvc"):
        torch.manual_seed(0)
        model = Lit()
        before = model.net.weight.detach().clone()
        plugins = [SnapsvcCheckpointIO()] if io == "snapsvc" else []
        t = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_fork", plugins=plugins, max_steps=2,
                       limit_val_batches=0, logger=False, enable_progress_bar=False,
                       enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path / io)
        t.fit(model, data(4))
        assert not torch.equal(model.net.weight, before), f"{io}: the parent's model was not trained"


# -- item 14: a plugin dropped without teardown stops its sidecar ----------------------------------

@pytest.mark.timeout(60)
def test_a_dropped_plugin_stops_its_sidecar(tmp_path, no_leaks):
    before = _children()
    io = SnapsvcCheckpointIO(fault_hook=functools.partial(hooks.sleep, 0.5))
    io.save_checkpoint({"x": torch.ones(4)}, str(tmp_path / "a.ckpt"))  # no trainer, no teardown
    assert _children() != before
    del io
    gc.collect()
    deadline = time.monotonic() + 20
    while _children() != before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _children() == before, "the sidecar still runs"
    reader = SnapsvcCheckpointIO()  # its write landed first
    assert torch.equal(reader.load_checkpoint(str(tmp_path / "a.ckpt"))["x"], torch.ones(4))
    # no_leaks: no /dev/shm entry is left behind

"""SnapsvcCheckpointIO(overlap=True): every checkpoint is its step's state, as stock Lightning's is.

The copy left to the copier thread (each optimizer's per-parameter state) is
held back until the next optimizer step has finished or something waits for
it (``slow_copy``). Without the wait in that step, the copy would then read
the state the step wrote, and the file would differ from stock Lightning's;
with it, the step waits and the copy reads the state of the save.
"""

from __future__ import annotations

import importlib
import importlib.util
import threading
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

import snapsvc
from snapsvc.engine import copier
from snapsvc.engine.life import Life
from snapsvc.engine.writer import SnapshotWriter

import lightning_script
from test_lightning import assert_same

FLAVOUR = next((f for f in ("pytorch_lightning", "lightning.pytorch")
                if importlib.util.find_spec(f.split(".")[0])), None)
if FLAVOUR is None:
    pytest.skip("Lightning is not installed: pip install 'snapsvc[lightning]'", allow_module_level=True)
pl = importlib.import_module(FLAVOUR)

from snapsvc.lightning import SnapsvcCheckpointIO  # noqa: E402

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("no_leaks")]


class SlowCopy:
    """Each copy handed to the copier thread starts only once the next optimizer
    step (of any optimizer) has finished, or something waits for the copy: the
    step's guard, a load, the teardown."""

    def __init__(self, monkeypatch: Any) -> None:
        self.events = 0    # steps finished, waits started
        self.copied: list[int] = []  # self.events when each copy ran
        self.cond = threading.Condition()
        later = copier.Copier.later

        def slow_later(copier_: copier.Copier, fn: Any, *args: Any) -> None:
            with self.cond:
                seen = self.events

            def after_next_event(*a: Any) -> None:
                with self.cond:  # 60 s: never, unless a wait was missed
                    self.cond.wait_for(lambda: self.events > seen, timeout=60)
                fn(*a)
                self.copied.append(self.events)

            later(copier_, after_next_event, *args)

        monkeypatch.setattr(copier.Copier, "later", slow_later)
        for owner, name in ((copier.Copier, "hold"), (copier.Copier, "wait"),
                            (SnapshotWriter, "wait_path"), (Life, "stop")):
            monkeypatch.setattr(owner, name, self.signalling(getattr(owner, name)))

    def signalling(self, method: Any) -> Any:
        def waits(*args: Any, **kwargs: Any) -> Any:
            self.event()
            return method(*args, **kwargs)
        return waits

    def event(self, *_: Any) -> None:
        with self.cond:
            self.events += 1
            self.cond.notify_all()


@pytest.fixture
def slow_copy(monkeypatch):
    slow = SlowCopy(monkeypatch)
    hook = register_optimizer_step_post_hook(slow.event)
    yield slow
    hook.remove()


class StateFirst(torch.optim.SGD):
    """An SGD whose own step writes its state before it runs the closure (as SAM's does)."""

    def step(self, closure: Any = None) -> Any:
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p].setdefault("calls", torch.zeros(()))
                    self.state[p]["calls"].add_(1)
        return super().step(closure)


class Lit(pl.LightningModule):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.automatic_optimization = mode != "manual"
        self.net = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch: Any, _idx: int) -> Any:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.mode != "manual":
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return None

    def configure_optimizers(self) -> Any:
        if self.mode == "state_first":
            return StateFirst(self.parameters(), lr=1e-2, momentum=0.9)
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]


def fit(mode: str, dirpath: str, io: Any, epochs: int = 1) -> Lit:
    torch.manual_seed(0)
    model = Lit(mode)
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=dirpath, filename="{step}", every_n_train_steps=1,
                                        save_top_k=-1)
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, callbacks=[ckpt],
                         plugins=[io] if io is not None else [], logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         accumulate_grad_batches=2 if mode == "accumulate" else 1)
    trainer.fit(model, lightning_script.data())
    return model


def assert_same_checkpoints(ours, stock) -> None:
    names = sorted(p.name for p in stock.iterdir())
    assert names and sorted(p.name for p in ours.iterdir() if p.suffix == ".ckpt") == names
    reader = SnapsvcCheckpointIO()
    for name in names:
        want = torch.load(stock / name, weights_only=False)
        got = reader.load_checkpoint(ours / name)
        for key in ("state_dict", "optimizer_states", "lr_schedulers", "global_step", "epoch"):
            assert_same(got[key], want[key], f"{name}[{key!r}]")


@pytest.mark.parametrize("mode", ["auto", "accumulate", "manual", "state_first"])
def test_every_checkpoint_equals_stock_lightnings(tmp_path, mode, slow_copy):
    """ModelCheckpoint every step; stock Lightning's torch.save files are the control.
    ``state_first``: an optimizer of its own class waits before its step, not after
    the closure (its step writes first)."""
    fit(mode, str(tmp_path / "stock"), None)
    fit(mode, str(tmp_path / "ours"), SnapsvcCheckpointIO(overlap=True))
    assert slow_copy.copied  # the copies were overlapped
    assert_same_checkpoints(tmp_path / "ours", tmp_path / "stock")


def test_resume_from_an_overlap_checkpoint_is_bit_identical(tmp_path, slow_copy):
    """4 epochs in one stock fit == 4 overlap epochs == fit(ckpt_path=the overlap run's
    epoch 1, two epochs of steps after it) to 4."""
    _, full, _ = lightning_script.fit(FLAVOUR, "default", str(tmp_path / "full"), 4)
    _, ours, _ = lightning_script.fit(FLAVOUR, "snapsvc", str(tmp_path / "ours"), 4, overlap=True)
    ckpt = tmp_path / "ours" / f"epoch=1-step={2 * lightning_script.BATCHES}.ckpt"
    assert snapsvc.verify(ckpt).ok
    _, resumed, batches = lightning_script.fit(FLAVOUR, "snapsvc", str(tmp_path / "resumed"), 4,
                                               str(ckpt), overlap=True)
    assert batches == 2 * lightning_script.BATCHES
    assert_same(ours.state_dict(), full.state_dict(), "overlap run")
    assert_same(resumed.state_dict(), full.state_dict(), "resumed")


def test_a_step_with_a_closure_waits_at_its_end(tmp_path, slow_copy):
    """SnapshotWriter.guard: torch's step(closure) runs the closure (the forward and
    backward) while the copy is in flight, and updates only once it is done."""
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    want = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    ran = []

    def closure() -> torch.Tensor:
        ran.append(len(slow_copy.copied))
        opt.zero_grad()
        loss = model(torch.randn(4, 64)).sum()
        loss.backward()
        return loss

    with snapsvc.SnapshotWriter(tmp_path, overlap=True) as writer:
        writer.guard(opt)
        writer.submit({"opt": opt}, "a.fdl")
        opt.step(closure)
    assert ran == [0] and len(slow_copy.copied) == 1  # the closure ran before the copy
    assert_same(snapsvc.load(tmp_path / "a.fdl")["opt"]["state"][0], want, "opt state")

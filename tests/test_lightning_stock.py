"""SnapsvcCheckpointIO against stock Lightning (issue 21): same files, same resumes, same loads.

Each test runs the stock trainer (Lightning's own torch.save IO) as the control
in the same test, where a stock behaviour exists.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import types
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

import snapsvc  # noqa: E402
from snapsvc.errors import SnapsvcError, UnsupportedStateError  # noqa: E402
from snapsvc.lightning import SnapsvcCheckpointIO  # noqa: E402

import hooks  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


class Lit(pl.LightningModule):
    """A tiny regression model; its init arguments are its hyper-parameters."""

    def __init__(self, lr: float = 0.05, **extra: Any) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch: Any, _idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def validation_step(self, batch: Any, _idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=float(self.hparams.lr))


def data(batches: int = 6) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4 * batches, 4, generator=g)
    ds = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
    return torch.utils.data.DataLoader(ds, batch_size=4, shuffle=False)


def trainer(io: str, callbacks: list, **kwargs: Any) -> Any:
    plugins = [SnapsvcCheckpointIO(**kwargs.pop("io_options", {}))] if io == "snapsvc" else []
    return pl.Trainer(accelerator="cpu", devices=1, plugins=plugins, callbacks=callbacks, logger=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=any(isinstance(c, pl.callbacks.ModelCheckpoint)
                                               for c in callbacks), **kwargs)


def read(io: str, path: str) -> dict:
    """A checkpoint as its own IO reads it."""
    if io == "snapsvc":
        reader = SnapsvcCheckpointIO()
        try:
            return reader.load_checkpoint(path)
        finally:
            reader.teardown()
    return torch.load(path, weights_only=False)


# -- item 1: -vN version suffixes ---------------------------------------------------------------

@pytest.mark.timeout(180)
def test_version_suffix_counts_pending_writes_as_existing(tmp_path, no_leaks):
    """filename="{epoch}" every step: stock writes epoch=0.ckpt, epoch=0-v1 .. v5; so must the
    plugin while each write is still held in the sidecar, and best_k_models must match."""
    got = {}
    for io in ("default", "snapsvc"):
        torch.manual_seed(0)
        d = tmp_path / io
        ckpt = pl.callbacks.ModelCheckpoint(dirpath=d, filename="{epoch}", monitor="loss",
                                            save_top_k=-1, every_n_train_steps=1)
        opts = {"io_options": {"fault_hook": functools.partial(hooks.sleep, 0.3)}} if io == "snapsvc" else {}
        trainer(io, [ckpt], max_steps=6, **opts).fit(Lit(), data())
        files = sorted(f for f in os.listdir(d) if f.endswith(".ckpt"))
        steps = {f: read(io, str(d / f))["global_step"] for f in files}
        best = {os.path.basename(k): v.item() for k, v in ckpt.best_k_models.items()}
        got[io] = (files, steps, best, os.path.basename(ckpt.best_model_path))
    assert got["default"][0] == ["epoch=0-v1.ckpt", "epoch=0-v2.ckpt", "epoch=0-v3.ckpt",
                                 "epoch=0-v4.ckpt", "epoch=0-v5.ckpt", "epoch=0.ckpt"]  # the control
    assert got["snapsvc"] == got["default"]


# -- item 3: keep_last ----------------------------------------------------------------------------

def test_keep_last_is_refused_because_modelcheckpoint_owns_retention():
    with pytest.raises(ValueError, match="keep_last.*ModelCheckpoint.*save_top_k"):
        SnapsvcCheckpointIO(keep_last=2)


# -- item 2: URLs ---------------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_a_url_is_refused_at_save_and_never_written_to_a_local_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    io = SnapsvcCheckpointIO()
    try:
        for url in ("s3://bucket/run/epoch=0.ckpt", "gs://b/epoch=0.ckpt", "memory://run/epoch=0.ckpt"):
            with pytest.raises(SnapsvcError, match=r"(?s)" + re.escape(url) + ".*remote=") as info:
                io.save_checkpoint({"epoch": 0, "w": torch.zeros(2)}, url)
            assert isinstance(info.value, ValueError)
            assert io.writer is None  # refused before a sidecar started
    finally:
        io.teardown()
    assert os.listdir(tmp_path) == []


@pytest.mark.timeout(60)
def test_a_file_url_is_the_local_path_as_with_stock(tmp_path, monkeypatch, no_leaks):
    monkeypatch.chdir(tmp_path)  # where a file:// URL taken as a relative path would land
    io = SnapsvcCheckpointIO()
    try:
        io.save_checkpoint({"epoch": 0, "w": torch.ones(2)}, f"file://{tmp_path}/a.ckpt")
        got = io.load_checkpoint(f"file://{tmp_path}/a.ckpt")
    finally:
        io.teardown()
    assert torch.equal(got["w"], torch.ones(2))
    assert snapsvc.verify(tmp_path / "a.ckpt").ok
    assert sorted(os.listdir(tmp_path)) == ["a.ckpt", "a.ckpt.meta"]


@pytest.mark.timeout(120)
def test_a_url_dirpath_is_refused_at_fit_start(tmp_path, monkeypatch):
    """memory:// is fsspec's, so stock writes there; the plugin refuses before training."""
    monkeypatch.chdir(tmp_path)
    ckpt = pl.callbacks.ModelCheckpoint(dirpath="memory://run")
    with pytest.raises(SnapsvcError, match="memory://run.*remote="):
        trainer("snapsvc", [ckpt], max_epochs=1).fit(Lit(), data())
    assert os.listdir(tmp_path) == []


# -- item 10: hyper-parameters --------------------------------------------------------------------

class Mode(enum.Enum):
    FAST = "fast"
    SLOW = "slow"


@dataclasses.dataclass
class Cfg:
    depth: int
    name: str
    scale: float = 1.5


def hparams() -> dict:
    """What Optuna, Hydra and argparse users hand to save_hyperparameters()."""
    return {"lr": np.float64(0.05), "steps": np.int64(3), "frac": np.float32(0.25), "flag": np.bool_(True),
            "root": pathlib.Path("/data/run"), "mode": Mode.SLOW, "cfg": Cfg(2, "x"),
            "dtype": torch.bfloat16, "device": torch.device("cpu"), "tags": {"a", "b"},
            "frozen": frozenset({1, 2}), "table": np.arange(6, dtype=np.int16).reshape(2, 3),
            "nested": {"paths": [pathlib.Path("a"), pathlib.Path("b")], "modes": (Mode.FAST,)}}


def same(got: Any, want: Any, where: str) -> None:
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and np.array_equal(got, want), where
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for k in want:
            same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            same(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


@pytest.mark.timeout(180)
def test_hyper_parameters_round_trip_as_with_stock(tmp_path, no_leaks):
    """numpy scalars and arrays, Path, Enum, dataclass, torch.dtype/device, set and frozenset: stock
    pickles them; the plugin stores them so that they come back as the same types and values."""
    loaded = {}
    for io in ("default", "snapsvc"):
        torch.manual_seed(0)
        ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / io, filename="last")
        trainer(io, [ckpt], max_epochs=1).fit(Lit(**hparams()), data())
        loaded[io] = read(io, ckpt.best_model_path)["hyper_parameters"]
    same(dict(loaded["default"]), {"lr": np.float64(0.05), **hparams()}, "stock")  # the control
    same(dict(loaded["snapsvc"]), dict(loaded["default"]), "hyper_parameters")


@pytest.mark.timeout(120)
def test_an_enum_is_found_only_in_a_module_already_imported(tmp_path, monkeypatch, no_leaks):
    """Loading never imports a module a checkpoint names: it says which one to import."""
    module = types.ModuleType("snapsvc_test_hparam_enums")
    module.Colour = enum.Enum("Colour", {"RED": 1}, module=module.__name__)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    io = SnapsvcCheckpointIO()
    try:
        io.save_checkpoint({"hyper_parameters": {"colour": module.Colour.RED}}, tmp_path / "a.ckpt")
        assert io.load_checkpoint(tmp_path / "a.ckpt")["hyper_parameters"] == {"colour": module.Colour.RED}
        monkeypatch.delitem(sys.modules, module.__name__)
        with pytest.raises(UnsupportedStateError, match=r"colour.*import snapsvc_test_hparam_enums"):
            io.load_checkpoint(tmp_path / "a.ckpt")
    finally:
        io.teardown()


class Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)


def local_enum() -> enum.Enum:
    class Local(enum.Enum):  # pickle cannot find it either: stock fails at the first save
        A = 1
    return Local.A


@pytest.mark.timeout(180)
@pytest.mark.parametrize("value, match", [(Backbone(), r"backbone.*nn\.Module.*ignore=\['backbone'\]"),
                                          (torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1),
                                           r"backbone.*state_dict"),
                                          (object(), r"backbone.*object"),
                                          (local_enum(), r"backbone.*Local.*top level")])
def test_hyper_parameters_that_cannot_be_stored_are_refused_at_fit_start(tmp_path, value, match,
                                                                         no_leaks):
    """Refused before the first batch, not at the first checkpoint after an epoch."""
    batches = []

    class Count(pl.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            batches.append(1)

    ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path)
    with pytest.raises(UnsupportedStateError, match=match):
        trainer("snapsvc", [ckpt, Count()], max_epochs=1).fit(Lit(backbone=value), data())
    assert batches == []
    assert not list(tmp_path.iterdir())


# -- item 5: save_last="link" ---------------------------------------------------------------------

@pytest.mark.timeout(180)
def test_resume_from_a_last_link_as_with_stock(tmp_path, no_leaks):
    """save_last="link" makes last.ckpt a symlink to the newest checkpoint; fit(ckpt_path="last")
    resumes from it. The resumed weights equal stock's, bit for bit."""
    weights = {}
    for io in ("default", "snapsvc"):
        d = tmp_path / io
        torch.manual_seed(0)
        model = Lit()
        ckpt = pl.callbacks.ModelCheckpoint(dirpath=d, save_last="link", save_top_k=-1)
        trainer(io, [ckpt], max_epochs=2).fit(model, data())
        assert os.path.islink(d / "last.ckpt")
        ckpt = pl.callbacks.ModelCheckpoint(dirpath=d, save_last="link", save_top_k=-1)
        t = trainer(io, [ckpt], max_epochs=3)
        t.fit(model, data(), ckpt_path="last")
        assert t.global_step == 18
        weights[io] = {k: v.clone() for k, v in model.state_dict().items()}
    for k, v in weights["default"].items():
        assert torch.equal(weights["snapsvc"][k], v), k


# -- item 7: LightningModule.load_from_checkpoint -------------------------------------------------

@pytest.mark.timeout(180)
def test_load_from_checkpoint_on_a_plugin_checkpoint_as_with_stock(tmp_path, no_leaks):
    models = {}
    for io in ("default", "snapsvc"):
        torch.manual_seed(0)
        ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / io, filename="last")
        trainer(io, [ckpt], max_epochs=1).fit(Lit(lr=0.02, width=4, names=("a", "b")), data())
        models[io] = Lit.load_from_checkpoint(ckpt.best_model_path)
        models[io + "-meta"] = Lit.load_from_checkpoint(ckpt.best_model_path, map_location="cpu", lr=0.5)
    for io in ("snapsvc", "snapsvc-meta"):
        want = models[io.replace("snapsvc", "default")]
        assert dict(models[io].hparams) == dict(want.hparams)
        assert type(models[io].hparams["names"]) is tuple
        for k, v in want.state_dict().items():
            assert torch.equal(models[io].state_dict()[k], v), k
    assert models["snapsvc-meta"].hparams["lr"] == 0.5


# -- item 6: DDP ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory) -> tuple[pathlib.Path, tuple[str, ...]]:
    """lightning_ddp_script.py's one launch (2 ranks): the validate scenario, then the rank-0
    load one, each for the stock control and the plugin. (Its directory, the IOs).
    Keep the plugin's rank-0 load last: a stray collective in it then has nothing left on
    rank 1 to pair with and hangs, which is what that test checks."""
    top, ios = tmp_path_factory.mktemp("ddp"), ("default", "snapsvc")
    for scenario in ("validate", "rank0"):
        for io in ios:
            (top / scenario / io).mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.path.dirname(HERE),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "lightning_ddp_script.py"), str(top),
                             *ios], cwd=top, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=500)  # four Trainer runs in one launch
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # rank 1 too: a hang in a collective
        out, _ = proc.communicate()
        done = sorted(str(p.relative_to(top)) for p in top.glob("*/*/*.json"))
        pytest.fail(f"hung (results written: {done})\n{out[-3000:]}")
    assert proc.returncode == 0, out[-5000:]
    return top, ios


@pytest.mark.timeout(600)
def test_ddp_validate_right_after_save_checkpoint_as_with_stock(ddp_runs):
    """2 ranks: trainer.save_checkpoint(p) then trainer.validate(ckpt_path=p). Every rank validates the
    weights rank 0 saved, although the plugin's write is held 2 s in the sidecar."""
    top, ios = ddp_runs
    for io in ios:
        ranks = [json.loads((top / "validate" / io / f"rank{r}.json").read_text()) for r in (0, 1)]
        assert ranks[0]["saved"] == ranks[1]["saved"] != 0
        assert [r["validated"] for r in ranks] == [r["saved"] for r in ranks], io


# -- issue 30, item 15: a rank-0-only load under DDP takes no collective ----------------------------

@pytest.mark.timeout(600)
def test_a_rank_zero_only_load_under_ddp_returns_the_checkpoint(ddp_runs):
    top, ios = ddp_runs
    for io in ios:
        for name in ("rank0.json", "after_fit.json"):
            got = json.loads((top / "rank0" / io / name).read_text())
            assert got["loaded"] == got["model"] != 0, (io, name)

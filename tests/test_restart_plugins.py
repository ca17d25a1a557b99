"""Lightning's plugin and SnapsvcTrainer pass the restart tier's options through (issue 31):
a run SIGKILLed after memory-only saves resumes from the sidecar's RAM copy, bit for bit
as the stock trainer resumes from its file (the control)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import snapsvc
from snapsvc.files import ramtier

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _script(log: str, *argv: str) -> tuple[int, str, str]:
    """Run the script; (exit code, stdout, stderr). Its output goes to files, not pipes:
    a lingering sidecar inherits them, and a pipe would be waited for until it exits."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, HERE])}
    with open(log + ".out", "w+") as out, open(log + ".err", "w+") as err:
        code = subprocess.run([sys.executable, os.path.join(HERE, "restart_plugins_script.py"),
                               *argv], env=env, stdout=out, stderr=err, timeout=150).returncode
        out.seek(0)
        err.seek(0)
        return code, out.read(), err.read()


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def _killed_then_resumed(kind: str, directory: str, ckpt: str, out: str,
                         resume_from: str | None = None) -> dict:
    """Kill a run after memory-only saves (``ckpt``, the newest, is held in RAM only),
    resume it from ``resume_from`` (default ``ckpt``); the resumed run's JSON line."""
    code, _, err = _script(out + ".killed", kind, "kill", directory)
    assert code == -signal.SIGKILL, err[-3000:]
    # the newest save is memory-only: in the lingering sidecar's RAM, not on disk
    assert ramtier.held(ckpt) is not None and not os.path.exists(ckpt)
    code, stdout, err = _script(out + ".resumed", kind, "resume", directory,
                                resume_from or ckpt, out)
    assert code == 0, err[-3000:]
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["attached"] is not None   # its writer took the lingering sidecar over
    assert _gone(result["attached"], 30)
    assert ramtier.held(ckpt) is None   # freed at the resumed run's clean close
    return result


@pytest.mark.timeout(240)
def test_lightning_run_killed_after_memory_only_saves_resumes_from_ram(tmp_path):
    import lightning.pytorch as pl  # noqa: F401 - skipped without it? it is a test dependency

    from tests.lightning_script import fit

    d = str(tmp_path / "snapsvc")
    ckpt = os.path.join(d, "epoch=1-step=12.ckpt")
    result = _killed_then_resumed("lightning", d, ckpt, str(tmp_path / "resumed.pt"))
    assert result["global_step"] == 18
    # the control: stock Lightning, its file for epoch 1, resumed to the same end
    stock = str(tmp_path / "stock")
    fit("lightning.pytorch", "default", stock, max_epochs=2)
    _, model, batches = fit("lightning.pytorch", "default", stock, max_epochs=3,
                            ckpt_path=os.path.join(stock, "epoch=1-step=12.ckpt"))
    assert batches == 6
    resumed = torch.load(tmp_path / "resumed.pt")
    for name, tensor in model.state_dict().items():
        assert torch.equal(resumed[name], tensor), f"{name} differs from stock's resume"


@pytest.mark.timeout(240)
def test_hf_run_killed_after_memory_only_saves_resumes_from_ram(tmp_path):
    from tests.hf_script import StopAt, make_trainer, weights

    d = str(tmp_path / "snapsvc")
    ckpt = os.path.join(d, "checkpoint-6", "snapsvc_state.fdl")
    result = _killed_then_resumed("hf", d, ckpt, str(tmp_path / "resumed.pt"),
                                  os.path.dirname(ckpt))
    assert result["global_step"] == 8
    # HF's own files of the memory-only checkpoint are on disk, its state was in RAM only
    assert sorted(os.listdir(os.path.join(d, "checkpoint-6"))) == ["config.json",
                                                                   "trainer_state.json"]
    # the control: the stock Trainer cut after its checkpoint 6, resumed from it
    stock = str(tmp_path / "stock")
    make_trainer("stock", stock, callbacks=[StopAt(6)]).train()
    control = make_trainer("stock", stock)
    control.train(resume_from_checkpoint=os.path.join(stock, "checkpoint-6"))
    resumed = torch.load(tmp_path / "resumed.pt")
    for name, tensor in weights(control.model).items():
        assert torch.equal(resumed[name], tensor), f"{name} differs from stock's resume"


def test_plugins_refuse_bad_restart_options(tmp_path):
    from snapsvc.lightning import SnapsvcCheckpointIO
    from tests.hf_script import make_trainer

    with pytest.raises(ValueError, match="persist_every must be"):
        SnapsvcCheckpointIO(persist_every=0)
    with pytest.raises(ValueError, match="memory_limit must be"):
        SnapsvcCheckpointIO(memory_limit=0)
    with pytest.raises(ValueError, match="persist_every must be an int >= 1"):
        make_trainer("snapsvc", str(tmp_path), snapsvc_options={"persist_every": 0})
    assert snapsvc.SnapshotWriter   # the options the plugins pass are SnapshotWriter's

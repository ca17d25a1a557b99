"""snapsvc.transformers.SnapsvcTrainer against the stock Trainer, on a tiny BERT (CPU)."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")   # the Trainer needs it

from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

import snapsvc  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import hf_script  # noqa: E402
from hf_script import KINDS, StopAt, close as _close, make_dataset, make_trainer, weights  # noqa: E402

from snapsvc.transformers import STAGING_PREFIX, STATE_FILE  # noqa: E402

def _checkpoints(out: str) -> list[str]:
    return sorted(n for n in os.listdir(out) if n.startswith("checkpoint-"))


def _resume_in_a_new_process(jobs: list[tuple[str, str, str]]) -> None:
    """Resume each (kind, run directory, result file) in one new process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
    argv = [a for job in jobs for a in job]
    proc = subprocess.run([sys.executable, os.path.join(HERE, "hf_script.py"), *argv], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.timeout(150)
def test_resume_in_a_new_process_is_bit_exact(tmp_path, no_leaks):
    """8 uninterrupted steps == 6 steps (checkpoints at 3, 6) + a resume mid-epoch in a new
    process, for the stock Trainer (the control) and for SnapsvcTrainer."""
    full = make_trainer("stock", str(tmp_path / "full"), save_strategy="no")
    full.train()   # no checkpoint: a SnapsvcTrainer would run the very same loop
    finals = {kind: weights(full.model) for kind in KINDS}
    jobs = []
    for kind in KINDS:
        out = str(tmp_path / kind / "cut")
        cut = make_trainer(kind, out, callbacks=[StopAt(6)])
        cut.train()
        _close(cut)
        assert _checkpoints(out) == ["checkpoint-3", "checkpoint-6"]
        assert cut.state.global_step == 6
        assert not torch.equal(weights(cut.model)["classifier.weight"],
                               finals[kind]["classifier.weight"])
        jobs.append((kind, out, str(tmp_path / kind / "resumed.safetensors")))
    _resume_in_a_new_process(jobs)
    from safetensors.torch import load_file
    for kind, _, result in jobs:
        resumed = load_file(result)
        assert resumed.keys() == finals[kind].keys()
        for name, tensor in finals[kind].items():
            assert torch.equal(resumed[name], tensor), f"{kind}: {name} differs after resume"
    ckpt = tmp_path / "snapsvc" / "cut" / "checkpoint-6"
    assert sorted(os.listdir(ckpt)) == sorted(
        ["config.json", "trainer_state.json", STATE_FILE, STATE_FILE + ".data",  # RNG: uint8
         STATE_FILE + ".meta"])
    state = snapsvc.load(str(ckpt / STATE_FILE))
    assert {"model", "optimizer", "scheduler", "rng", "trainer_state"} <= set(state)
    assert isinstance(state["rng"]["numpy"][1], bytes)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("best", [False, True], ids=["limit", "limit+best"])
def test_rotation_matches_the_stock_trainer(tmp_path, no_leaks, best):
    """save_total_limit=2 (and load_best_model_at_end) leave the same checkpoint directories
    as the stock Trainer after each run, and the same final model."""
    extra = {}
    if best:
        extra = dict(eval_dataset=make_dataset(8, seed=2), eval_strategy="steps", eval_steps=2,
                     load_best_model_at_end=True, metric_for_best_model="loss",
                     greater_is_better=True)  # "worse is better": keeps an early best
    seen, final = {}, {}
    for kind in KINDS:
        out = str(tmp_path / kind)
        runs = []
        t = make_trainer(kind, out, max_steps=6, save_steps=2, save_total_limit=2, **extra)
        for max_steps, resume in ((6, None), (10, True)):   # the second run resumes the first
            t.args.max_steps = max_steps
            t.train(resume_from_checkpoint=resume)
            runs.append(_checkpoints(out))
            if best:
                runs.append(os.path.basename(t.state.best_model_checkpoint))
        final[kind] = weights(t.model)
        _close(t)
        seen[kind] = runs
        assert not [n for n in os.listdir(out) if n.startswith(STAGING_PREFIX)]
    assert seen["snapsvc"] == seen["stock"]
    if best:  # the best (step 2) is kept beside the newest, then loaded at the end
        assert seen["stock"] == [["checkpoint-2", "checkpoint-6"], "checkpoint-2",
                                 ["checkpoint-10", "checkpoint-2"], "checkpoint-2"]
    else:
        assert seen["stock"] == [["checkpoint-4", "checkpoint-6"],
                                 ["checkpoint-10", "checkpoint-8"]]
    for name, tensor in final["stock"].items():
        assert torch.equal(final["snapsvc"][name], tensor), name


@pytest.mark.timeout(120)
def test_overlap_mode_writes_the_same_checkpoints(tmp_path, no_leaks):
    """overlap=True (the copy runs on behind training, the next optimizer step waits for it)
    writes checkpoints equal to blocking mode's, tensor for tensor. On this CPU run the
    sidecar runs at training's priority (a niced one falls behind a training loop that
    keeps every core busy), unless snapsvc_options set ``nice``."""
    states = {}
    for mode in (False, True):
        out = str(tmp_path / str(mode))
        t = make_trainer("snapsvc", out, max_steps=6, snapsvc_options={
            "overlap": mode, **({"nice": 5} if mode else {})})
        t.train()
        assert t.snapsvc_writer.overlap is mode
        assert os.getpriority(os.PRIO_PROCESS, t.snapsvc_writer.pid) == \
            min(19, os.getpriority(os.PRIO_PROCESS, 0) + (5 if mode else 0))
        t.close()
        states[mode] = [snapsvc.load(os.path.join(out, c, STATE_FILE)) for c in _checkpoints(out)]
    assert len(states[True]) == 2

    def tensors(tree, prefix=""):
        if isinstance(tree, torch.Tensor):
            yield prefix, tree
        elif isinstance(tree, dict):
            for k, v in tree.items():
                yield from tensors(v, f"{prefix}/{k}")

    for block, overlap in zip(states[False], states[True]):
        pairs = dict(tensors({k: block[k] for k in ("model", "optimizer")}))
        got = dict(tensors({k: overlap[k] for k in ("model", "optimizer")}))
        assert pairs.keys() == got.keys() and len(pairs) > 40
        for name, tensor in pairs.items():
            assert torch.equal(got[name], tensor), name


@pytest.mark.timeout(120)
def test_sidecar_killed_during_a_save_leaves_nothing_resume_picks(tmp_path, no_leaks):
    out = str(tmp_path / "run")
    flag = str(tmp_path / "hold")
    open(flag, "w").close()
    trainer = make_trainer("snapsvc", out, max_steps=3, snapsvc_options={
        "fault_hook": functools.partial(hf_script.sleep_while, flag, 30.0)})
    errors = []

    def train() -> None:
        try:
            trainer.train()
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=train)
    thread.start()
    try:
        hidden = os.path.join(out, STAGING_PREFIX + "checkpoint-3")
        deadline = time.monotonic() + 60
        while not (os.path.isdir(hidden) and trainer.snapsvc_writer is not None
                   and trainer.snapsvc_writer.pid):
            assert time.monotonic() < deadline, "the save never started"
            time.sleep(0.05)
        time.sleep(0.5)   # the sidecar is now held inside the write
        assert get_last_checkpoint(out) is None   # still being written: HF does not see it
        os.kill(trainer.snapsvc_writer.pid, signal.SIGKILL)
    finally:
        os.unlink(flag)
        thread.join(60)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], snapsvc.BrokenWriterError), errors
    assert "checkpoint-3" in str(errors[0])
    assert get_last_checkpoint(out) is None
    assert os.listdir(out) == [] or not _checkpoints(out)
    assert not [n for n in os.listdir(out) if n.startswith(STAGING_PREFIX)]
    with pytest.raises(ValueError, match="No valid checkpoint"):
        trainer.train(resume_from_checkpoint=True)

    trainer.train()   # the next save works: a new sidecar writes it
    assert get_last_checkpoint(out) == os.path.join(out, "checkpoint-3")
    again = make_trainer("snapsvc", out, max_steps=4)
    again.train(resume_from_checkpoint=True)
    assert again.state.global_step == 4
    trainer.close()
    again.close()


@pytest.mark.timeout(120)
def test_a_save_that_waits_for_the_sidecar_says_why(tmp_path, no_leaks, caplog):
    """One slot and a write held 3 s: the second save waits for the first write, and the
    run warns (once) that saves wait for the disk, naming the knobs; the checkpoints are
    those the stock Trainer leaves."""
    flag = str(tmp_path / "hold")
    open(flag, "w").close()
    seen = {}
    for kind in KINDS:
        out = str(tmp_path / kind)
        t = make_trainer(kind, out, max_steps=2, save_steps=1, snapsvc_options=None
                         if kind == "stock" else {"slots": 1, "fault_hook": functools.partial(
                             hf_script.sleep_while, flag, 3.0)})
        with caplog.at_level("WARNING", logger="snapsvc"):
            t.train()
        _close(t)
        seen[kind] = _checkpoints(out)
    assert seen["snapsvc"] == seen["stock"] == ["checkpoint-1", "checkpoint-2"]
    waited = [r.getMessage() for r in caplog.records if "waited" in r.getMessage()]
    assert len(waited) == 1 and "checkpoint-2" in waited[0], waited
    assert "free slot" in waited[0] and "'slots'" in waited[0] and "save_steps" in waited[0]


@pytest.mark.timeout(60)
def test_import_snapsvc_does_not_import_transformers():
    code = "import sys, snapsvc; assert 'transformers' not in sys.modules, 'imported'"
    env = {**os.environ, "PYTHONPATH": os.path.dirname(HERE)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=50)

"""SnapsvcTrainer where the stock Trainer's own behaviour is the reference (issue 21, 4 and 9;
Hardening 3, 17 and 18).

Each test runs the stock ``transformers.Trainer`` as the control, in the same test.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import TrainerCallback  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

import snapsvc  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import hf_script  # noqa: E402
from hf_script import KINDS, RaiseAt, close as _close, make_dataset, make_trainer, \
    weights  # noqa: E402

from snapsvc.transformers import STATE_FILE  # noqa: E402

class ReadOnSave(TrainerCallback):
    """What an uploading callback (WandbCallback, MLflowCallback, ...) finds in on_save:
    the files of ``checkpoint-<step>`` and the step its trainer_state.json records."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[list[str] | None, int | None]] = {}

    def on_save(self, args, state, control, **kwargs):
        d = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if not os.path.isdir(d):
            self.seen[state.global_step] = (None, None)
            return
        with open(os.path.join(d, "trainer_state.json")) as f:
            step = json.load(f)["global_step"]
        files = sorted(os.listdir(d))
        if STATE_FILE in files:   # the whole checkpoint, readable now
            assert snapsvc.verify(os.path.join(d, STATE_FILE)).ok
            assert "model" in snapsvc.load(os.path.join(d, STATE_FILE))
        self.seen[state.global_step] = (files, step)


@pytest.mark.timeout(150)
def test_on_save_callbacks_see_the_complete_checkpoint_directory(tmp_path, no_leaks):
    seen = {}
    for kind in KINDS:
        cb = ReadOnSave()
        t = make_trainer(kind, str(tmp_path / kind), max_steps=6, callbacks=[cb])
        t.train()
        _close(t)
        seen[kind] = cb.seen
    assert sorted(seen["stock"]) == [3, 6]
    assert all(files and step == s for s, (files, step) in seen["stock"].items())
    assert sorted(seen["snapsvc"]) == [3, 6]
    for s, (files, step) in seen["snapsvc"].items():
        assert files == sorted(["config.json", "trainer_state.json", STATE_FILE,
                                STATE_FILE + ".data", STATE_FILE + ".meta"]), \
            f"checkpoint-{s} in on_save: {files}"
        assert step == s


def _sequential(trainer_kind: str, out: str, max_steps: int):
    """A trainer with SequentialLR([LinearLR warm-up to step 4, MultiStepLR]): its
    state holds MultiStepLR's milestones Counter."""
    t = make_trainer(trainer_kind, out, max_steps=max_steps, save_steps=2)
    opt = torch.optim.AdamW(t.model.parameters(), lr=1e-3)
    L = torch.optim.lr_scheduler
    t.optimizer = opt
    t.lr_scheduler = L.SequentialLR(opt, [L.LinearLR(opt, start_factor=0.1, total_iters=4),
                                          L.MultiStepLR(opt, milestones=[1, 2], gamma=0.5)],
                                    milestones=[4])
    return t


class Lrs(TrainerCallback):
    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        self.lrs.append(optimizer.param_groups[0]["lr"])


@pytest.mark.timeout(150)
def test_sequential_lr_resumed_mid_warmup_matches_the_stock_trainer(tmp_path, no_leaks):
    """Saved at step 2 (mid-warm-up), resumed in a new trainer to step 8: SequentialLR
    switches to MultiStepLR at step 4; the same learning rates and weights as stock."""
    result = {}
    for kind in KINDS:
        out = str(tmp_path / kind)
        first = _sequential(kind, out, max_steps=2)
        first.train()
        _close(first)
        again = _sequential(kind, out, max_steps=8)
        lrs = Lrs()
        again.add_callback(lrs)
        again.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
        _close(again)
        result[kind] = (lrs.lrs, weights(again.model))
    assert len(result["stock"][0]) == 6
    assert result["snapsvc"][0] == result["stock"][0]
    for name, tensor in result["stock"][1].items():
        assert torch.equal(result["snapsvc"][1][name], tensor), name


@pytest.mark.timeout(150)
def test_a_stock_trainer_given_a_snapsvc_checkpoint_names_the_fix(tmp_path, no_leaks):
    """Issue 21, item 14: the stock Trainer says only "Can't find a valid checkpoint" of a
    directory it cannot read; of a snapsvc one, it now says what reads it. The control: the
    stock Trainer resumes from its own checkpoint, and says its own words of an empty one."""
    runs = {}
    for kind in KINDS:
        t = make_trainer(kind, str(tmp_path / kind), max_steps=3)
        t.train()
        _close(t)
        runs[kind] = os.path.join(str(tmp_path / kind), "checkpoint-3")
    stock = make_trainer("stock", str(tmp_path / "again"), max_steps=4)
    stock.train(resume_from_checkpoint=runs["stock"])
    assert stock.state.global_step == 4
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="Can't find a valid checkpoint") as plain:
        make_trainer("stock", str(tmp_path / "x"), max_steps=4).train(
            resume_from_checkpoint=str(empty))
    assert "snapsvc" not in str(plain.value)
    with pytest.raises(ValueError, match="Can't find a valid checkpoint") as ours:
        make_trainer("stock", str(tmp_path / "y"), max_steps=4).train(
            resume_from_checkpoint=runs["snapsvc"])
    assert "SnapsvcTrainer" in str(ours.value) and STATE_FILE in str(ours.value)
    snap = make_trainer("snapsvc", str(tmp_path / "z"), max_steps=4)
    snap.train(resume_from_checkpoint=runs["snapsvc"])   # what the message says works
    assert snap.state.global_step == 4
    _close(snap)


def _held(kind: str, flag: str) -> dict | None:
    """snapsvc_options that hold each state-file write 1 s while ``flag`` exists."""
    return None if kind == "stock" else {
        "fault_hook": functools.partial(hf_script.sleep_while, flag, 1.0)}


@pytest.mark.timeout(240)
def test_a_failed_train_leaves_its_checkpoints_committed_as_stock_does(tmp_path, no_leaks):
    """Hardening 3, 17: saves at steps 3 and 6 (each write held 1 s), then an exception at
    step 7. Right after train() raises, as with the stock Trainer: user code finds
    checkpoint-6 (get_last_checkpoint), evaluate() runs, save_model() writes, and
    train(resume_from_checkpoint=True) in the same trainer resumes from step 6. Before, the
    writes were still pending: "No valid checkpoint found", or a resume from step 3. The
    same after Ctrl-C, and when the exception ends the interpreter (in a new process)."""
    flag = str(tmp_path / "hold")
    open(flag, "w").close()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
    exits = str(tmp_path / "exits")
    proc = subprocess.Popen(   # runs beside the trainers below
        [sys.executable, os.path.join(HERE, "hf_script.py"), "--raise-at", "7", exits, flag],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        seen = {}
        for kind, error in (("stock", RuntimeError("a callback failed")),
                            ("snapsvc", RuntimeError("a callback failed")),
                            ("snapsvc", KeyboardInterrupt())):
            out = str(tmp_path / f"{kind}-{type(error).__name__}")
            raiser = RaiseAt(7, error)
            t = make_trainer(kind, out, callbacks=[raiser], eval_dataset=make_dataset(8, seed=2),
                             snapsvc_options=_held(kind, flag))
            with pytest.raises(type(error)):
                t.train()
            last = get_last_checkpoint(out)
            assert last == os.path.join(out, "checkpoint-6"), (kind, error, last)
            if isinstance(error, KeyboardInterrupt):   # the rest as after the error
                _close(t)
                continue
            loss = t.evaluate()["eval_loss"]
            t.save_model(os.path.join(out, "saved"))
            t.remove_callback(raiser)
            t.train(resume_from_checkpoint=True)
            _close(t)
            seen[kind] = (loss, sorted(os.listdir(os.path.join(out, "saved"))),
                          t.state.global_step, weights(t.model))
        _, stderr = proc.communicate(timeout=150)
    finally:
        proc.kill()
        proc.wait()
    assert seen["snapsvc"][:3] == seen["stock"][:3]
    assert seen["stock"][2] == 8 and "model.safetensors" in seen["stock"][1]
    for name, tensor in seen["stock"][3].items():
        assert torch.equal(seen["snapsvc"][3][name], tensor), name
    assert proc.returncode != 0 and "raised at step 7" in stderr, stderr[-3000:]
    assert sorted(os.listdir(exits)) == ["checkpoint-3", "checkpoint-6"], stderr[-3000:]
    with open(os.path.join(exits, "checkpoint-6", "trainer_state.json")) as f:
        assert json.load(f)["global_step"] == 6
    assert snapsvc.verify(os.path.join(exits, "checkpoint-6", STATE_FILE)).ok


def _generative(tmp_path) -> dict:
    """A tiny GPT-2 (it has a generation config) with a tokenizer, and its data."""
    from transformers import BertTokenizer, GPT2Config, GPT2LMHeadModel
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
                                *(f"w{i}" for i in range(95))]) + "\n")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2,
                                       n_positions=16, bos_token_id=2, eos_token_id=3))
    data = [{**d, "labels": d["input_ids"]} for d in make_dataset()]
    return {"model": model, "train_dataset": data,
            "processing_class": BertTokenizer(vocab_file=str(vocab))}


# What the stock Trainer writes into checkpoint-<N> that SnapsvcTrainer does not: the
# weights, optimizer, scheduler and RNG states (in its state file instead: the sidecar
# writes them and never pickles), and training_args.bin, a pickle of the TrainingArguments
# that no resume reads.
STOCK_ONLY = {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth",
              "training_args.bin"}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", ["generative+tokenizer", "remote-code"])
def test_a_checkpoint_holds_the_files_the_stock_trainer_writes(tmp_path, no_leaks, case):
    """Hardening 3, 18: every other file the stock Trainer writes into checkpoint-<N> is
    written alike (JSON files equal as JSON, the rest byte for byte): config.json with
    "architectures" and "dtype" (set by save_pretrained), generation_config.json, the
    tokenizer's files, a remote-code model's source. Before: config.json without them,
    and none of the others."""
    dirs = {}
    for kind in KINDS:
        model = (_generative(tmp_path) if case == "generative+tokenizer"
                 else {"model": hf_script.make_custom_model()})
        t = make_trainer(kind, str(tmp_path / kind), max_steps=3, **model)
        t.train()
        _close(t)
        dirs[kind] = tmp_path / kind / "checkpoint-3"
    stock, ours = (set(os.listdir(d)) for d in dirs.values())
    assert stock - ours == STOCK_ONLY
    assert ours - stock == {STATE_FILE, STATE_FILE + ".data", STATE_FILE + ".meta"}
    for name in stock & ours:
        a, b = ((d / name).read_bytes() for d in dirs.values())
        if name.endswith(".json"):
            a, b = json.loads(a), json.loads(b)
        assert a == b, name
    config = json.loads((dirs["snapsvc"] / "config.json").read_text())
    assert config["dtype"] == "float32"
    if case == "generative+tokenizer":
        assert config["architectures"] == ["GPT2LMHeadModel"]
        assert {"generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= ours
    else:
        assert config["architectures"] == ["CustomBert"] and "hf_script.py" in ours
        assert config["auto_map"] == {
            "AutoModelForSequenceClassification": "hf_script.CustomBert"}

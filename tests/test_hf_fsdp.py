"""SnapsvcTrainer under torchrun: accelerate's FSDP2 (issue 23), the whole state through
DistributedSnapshotWriter, and a resume bit-exact at the same world size; and DDP
(tests/hf_script.py's ``dist_main`` and ``dist_second_train``). All run in one torchrun
launch (:func:`torchrun_world`): its start is most of each run's cost.

accelerate 1.15 turns FSDP on only for GPUs and other accelerators: on CPU
(``DistributedType.MULTI_CPU``, gloo) ``AcceleratorState`` drops the FSDP
plugin without a word and the Trainer runs DDP. To run the Trainer's real
FSDP2 path here, the script lifts that one check (:func:`lift_cpu_gate`);
everything else (``fully_shard`` wrapping, the DTensor optimizer, the stock
Trainer's sharded save and load through DCP) is accelerate's and torch's own.
The stock Trainer runs in the same script as the control.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import hf_script  # noqa: E402
from hf_script import KINDS, StopAt, end_world, make_args, weights  # noqa: E402

# FULL_STATE_DICT (the default) gathers the model for safetensors, which fails on CPU
# in the stock Trainer too ("Attempted to access the data pointer on an invalid python
# storage"); the sharded state dict is saved by DCP, which runs on gloo.
FSDP = dict(fsdp=True, fsdp_config={"version": 2, "state_dict_type": "SHARDED_STATE_DICT",
                                     "auto_wrap_policy": "SIZE_BASED_WRAP",
                                     "min_num_params": 64},
            ddp_backend="gloo", max_steps=5, lr_scheduler_type="linear")


class Net(torch.nn.Module):
    """Linear(8, 16), ReLU, dropout (so a resume needs the RNG states), Linear(16, 4) with
    a regression loss: each Linear its own FSDP2 unit (SIZE_BASED_WRAP), the root one more."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        y = self.out(torch.nn.functional.dropout(torch.relu(self.inp(x)), 0.5, self.training))
        return {"loss": torch.nn.functional.mse_loss(y, labels), "logits": y}


def make_trainer(kind: str, out: str, callbacks: list | None = None, **overrides):
    from transformers import Trainer
    g = torch.Generator().manual_seed(1)
    data = [{"x": torch.randn(8, generator=g), "labels": torch.randn(4, generator=g)}
            for _ in range(48)]   # 6 steps per epoch at world size 2: a resume at 3 is mid-epoch
    cls = Trainer
    if kind == "snapsvc":
        from snapsvc.transformers import SnapsvcTrainer as cls
    return cls(model=Net(), args=make_args(out, **FSDP, **overrides), train_dataset=data,
               callbacks=callbacks)


def lift_cpu_gate() -> None:
    """Let accelerate run FSDP on CPU: after ``AcceleratorState`` chose MULTI_CPU, switch
    it to FSDP with the plugin it was given, as it does for MULTI_GPU."""
    import accelerate.state as state
    from accelerate.utils import DistributedType
    init = state.AcceleratorState.__init__

    def patched(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    state.AcceleratorState.__init__ = patched


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's global tensors (a collective: every rank calls it)."""
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v
            for k, v in weights(model).items()}


def files_of(directory: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, n), directory)
                  for d, _, names in os.walk(directory) for n in names)


class Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(record.getMessage())


def main_reads_on_save():
    """test_hf_trainer_behaviour's ReadOnSave on the main process only: under torchrun the
    main process writes and commits checkpoint-<N>, so only its callbacks are sure to find
    it whole, with the stock Trainer too."""
    from test_hf_trainer_behaviour import ReadOnSave

    class MainReadsOnSave(ReadOnSave):
        def on_save(self, args, state, control, **kwargs):
            if args.process_index == 0:
                super().on_save(args, state, control, **kwargs)

    return MainReadsOnSave()


def full_state(trainer) -> dict[str, torch.Tensor]:
    """Global parameters and both Adam moments, by parameter name (a collective)."""
    out = {f"param/{k}": v for k, v in full_weights(trainer.model).items()}
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    for p, st in trainer.optimizer.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            t = st[key]
            out[f"{key}/{names[id(p)]}"] = t.full_tensor() if hasattr(t, "full_tensor") else t
    return out


def dist_fsdp(out: str, result: str) -> None:
    """Under torchrun (2 ranks, gloo, FSDP2): 5 uninterrupted stock steps; then, for each
    kind, a run stopped at 3 and a resume from its checkpoint-3 to 5 (a checkpoint every
    step, save_total_limit=1). Rank 0 saves RESULT.<full|kind>.safetensors (parameters,
    Adam moments) and RESULT.json (learning rates, file lists, warnings, on_save views)."""
    from safetensors.torch import save_file
    lift_cpu_gate()
    messages = Messages()
    logging.getLogger("snapsvc").addHandler(messages)
    full = make_trainer("stock", os.path.join(out, "full"), save_strategy="no")
    full.train()
    tensors = {"full": full_state(full)}
    seen: dict[str, object] = {
        "fsdp": [full.is_fsdp_enabled, type(next(full.model.parameters())).__name__],
        "full": [full.lr_scheduler.last_epoch, full.lr_scheduler.get_last_lr(),
                 [g["lr"] for g in full.optimizer.param_groups]]}
    for kind in KINDS:
        run = os.path.join(out, kind)
        on_save = main_reads_on_save()
        cut = make_trainer(kind, run, callbacks=[StopAt(3), on_save], save_steps=1,
                           save_total_limit=1)
        cut.train()
        if kind == "snapsvc":
            cut.close()
        listed = [sorted(n for n in os.listdir(run) if not n.startswith("."))]
        resumed = make_trainer(kind, run, save_steps=1, save_total_limit=1)
        resumed.train(resume_from_checkpoint=os.path.join(run, "checkpoint-3"))
        if kind == "snapsvc":
            resumed.close()
        listed.append(sorted(n for n in os.listdir(run) if not n.startswith(".")))
        tensors[kind] = full_state(resumed)
        seen[kind] = {
            "lr": [resumed.lr_scheduler.last_epoch, resumed.lr_scheduler.get_last_lr(),
                   [g["lr"] for g in resumed.optimizer.param_groups]],
            "run": listed,
            "files": files_of(os.path.join(run, "checkpoint-5")),
            "on_save": {s: [step, "trainer_state.json" in (files or [])]
                        for s, (files, step) in on_save.seen.items()}}
    seen["warnings"] = messages.seen
    if full.args.process_index == 0:
        for name, t in tensors.items():
            save_file(t, f"{result}.{name}.safetensors")
        with open(result + ".json", "w") as f:
            json.dump(seen, f)


def run_all(out: str) -> None:
    """Under torchrun: the DDP runs in OUT/ddp (results OUT/ddp.safetensors*), then the
    FSDP2 runs in OUT/fsdp (results OUT/fsdp-final*). The DDP runs go first: FSDP2 needs
    :func:`lift_cpu_gate`, and each TrainingArguments resets accelerate's state."""
    ddp = os.path.join(out, "ddp")
    hf_script.dist_main(ddp, ddp + ".safetensors")
    hf_script.dist_second_train(ddp, ddp + ".safetensors")
    dist_fsdp(os.path.join(out, "fsdp"), os.path.join(out, "fsdp-final"))


@pytest.fixture(scope="module")
def torchrun_world(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """One torchrun launch (2 CPU ranks, gloo) of :func:`run_all` for every test here:
    (OUT, the finished process)."""
    out = tmp_path_factory.mktemp("torchrun")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         os.path.abspath(__file__), str(out)],
        env=env, capture_output=True, text=True, timeout=500)  # FSDP2 and 2 DDP scenarios
    return out, proc


@pytest.mark.timeout(600)
def test_fsdp2_trainer_saves_the_whole_state_and_resumes_bit_exact(torchrun_world):
    """Under FSDP2 SnapsvcTrainer writes every rank's shards through
    DistributedSnapshotWriter (no fallback, no warning), with the stock Trainer's
    rotation and on_save view; a resume at the same world size gives the uninterrupted
    stock run's parameters, Adam moments and learning rates bit for bit, as the stock
    Trainer's own resume does."""
    from safetensors.torch import load_file
    out, proc = torchrun_world
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = str(out / "fsdp-final")
    with open(result + ".json") as f:
        seen = json.load(f)
    assert seen["fsdp"] == [True, "DTensor"]   # the Trainer really ran FSDP2
    assert seen["warnings"] == []
    assert "pytorch_model_fsdp_0/.metadata" in seen["stock"]["files"]
    # every rank's RNG states, gathered on rank 0, go to its data file (its CRC in the manifest)
    assert seen["snapsvc"]["files"] == ["manifest.msgpack", "rank0.fdl", "rank0.fdl.data",
                                        "rank0.fdl.meta", "rank1.fdl", "rank1.fdl.meta",
                                        "trainer_state.json"]
    for kind in KINDS:
        assert seen[kind]["run"] == [["checkpoint-3"], ["checkpoint-5"]], kind   # limit 1
        assert seen[kind]["on_save"] == {str(s): [s, True] for s in (1, 2, 3)}, kind
        assert seen[kind]["lr"] == seen["full"], kind
    full = load_file(result + ".full.safetensors")
    assert len([k for k in full if k.startswith("exp_avg_sq/")]) == 4
    for kind in KINDS:
        resumed = load_file(f"{result}.{kind}.safetensors")
        assert resumed.keys() == full.keys()
        for name, tensor in full.items():
            assert torch.equal(resumed[name], tensor), (kind, name)


@pytest.mark.timeout(600)
def test_distributed_world_size_2_on_gloo(torchrun_world, capsys):
    """torchrun, 2 CPU processes: each rank writes its file through its own sidecar, the
    directory appears once the manifest commits both; a mid-epoch resume is bit-exact."""
    from safetensors.torch import load_file
    from test_transformers import _checkpoints

    import snapsvc
    from snapsvc.transformers import STAGING_PREFIX
    out, proc = torchrun_world
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    tmp_path, result = out / "ddp", str(out / "ddp.safetensors")
    full, cut, resumed = (load_file(result + s) for s in (".full", ".cut", ""))
    assert not torch.equal(cut["classifier.weight"], full["classifier.weight"])
    for name, tensor in full.items():
        assert torch.equal(resumed[name], tensor), f"{name} differs after resume"
    out = tmp_path / "cut"
    assert {"checkpoint-3", "checkpoint-6"} <= set(_checkpoints(str(out)))
    assert {"manifest.msgpack", "rank0.fdl", "rank1.fdl", "trainer_state.json"} <= set(
        os.listdir(out / "checkpoint-3"))
    assert not os.listdir(out / (STAGING_PREFIX + "ranks"))   # no step left uncommitted
    assert "rng" in snapsvc.load(str(out / "checkpoint-3" / "rank1.fdl"))
    # snapsvc ls: each checkpoint-<N> once, with its step (Hardening 3, 20)
    from snapsvc.cli import main
    capsys.readouterr()
    assert main(["ls", str(out), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["checkpoints"]
    steps = sorted((int(n.split("-")[1]) for n in _checkpoints(str(out))), reverse=True)
    assert [(c["name"], c["step"]) for c in listed] == [(f"checkpoint-{n}", n) for n in steps]


@pytest.mark.timeout(600)
def test_torchrun_second_train_resuming_an_earlier_checkpoint(torchrun_world):
    """Issue 21: the second train() re-saves checkpoint-6 as the stock Trainer does, instead
    of failing on every rank with "step 6 after step 6: steps must increase"."""
    from safetensors.torch import load_file
    out, proc = torchrun_world
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    tmp_path, result = out / "ddp", str(out / "ddp.safetensors")
    stock, ours = load_file(result + ".stock"), load_file(result + ".snapsvc")
    for name, tensor in stock.items():
        assert torch.equal(ours[name], tensor), name
    for kind in KINDS:
        assert {"checkpoint-3", "checkpoint-6"} <= set(os.listdir(tmp_path / kind))


if __name__ == "__main__":   # torchrun runs this file (the sidecar re-imports it: guarded)
    run_all(sys.argv[1])
    end_world()

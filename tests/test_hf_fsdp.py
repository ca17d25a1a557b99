"""SnapsvcTrainer under accelerate's FSDP2 (issue 23): the stock save, with a warning.

accelerate 1.15 turns FSDP on only for GPUs and other accelerators: on CPU
(``DistributedType.MULTI_CPU``, gloo) ``AcceleratorState`` drops the FSDP
plugin without a word and the Trainer runs DDP. To run the Trainer's real
FSDP2 path here, the script lifts that one check (:func:`lift_cpu_gate`);
everything else (``fully_shard`` wrapping, the DTensor optimizer, accelerate's
sharded save and load through DCP) is accelerate's and torch's own. The
stock Trainer runs in the same script as the control.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from hf_script import StopAt, make_args, weights  # noqa: E402

KINDS = ["stock", "snapsvc"]
# FULL_STATE_DICT (the default) gathers the model for safetensors, which fails on CPU
# in the stock Trainer too ("Attempted to access the data pointer on an invalid python
# storage"); the sharded state dict is saved by DCP, which runs on gloo.
FSDP = dict(fsdp=True, fsdp_config={"version": 2, "state_dict_type": "SHARDED_STATE_DICT",
                                     "auto_wrap_policy": "SIZE_BASED_WRAP",
                                     "min_num_params": 64},
            ddp_backend="gloo", max_steps=6)


class Net(torch.nn.Module):
    """Linear(8, 16), ReLU, Linear(16, 4) with a regression loss: each Linear its own
    FSDP2 unit (SIZE_BASED_WRAP), the root one more."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        y = self.out(torch.relu(self.inp(x)))
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


def dist_fsdp(out: str, result: str) -> None:
    """Under torchrun (2 ranks, gloo, FSDP2): 6 uninterrupted stock steps; each kind
    stopped at 3 (checkpoint-3); SnapsvcTrainer resumed from its checkpoint-3 to 6. Rank 0
    saves the weights (RESULT.full, RESULT.resumed) and RESULT.json: what it saw."""
    from safetensors.torch import save_file
    lift_cpu_gate()
    messages = Messages()
    logging.getLogger("snapsvc").addHandler(messages)
    full = make_trainer("stock", os.path.join(out, "full"), save_strategy="no")
    full.train()
    seen: dict[str, object] = {"fsdp": [full.is_fsdp_enabled,
                                        type(next(full.model.parameters())).__name__]}
    for kind in KINDS:
        cut = make_trainer(kind, os.path.join(out, kind), callbacks=[StopAt(3)])
        cut.train()
        seen[kind] = files_of(os.path.join(out, kind, "checkpoint-3"))
    seen["cut_warnings"] = list(messages.seen)
    resumed = make_trainer("snapsvc", os.path.join(out, "snapsvc"))
    resumed.train(resume_from_checkpoint=os.path.join(out, "snapsvc", "checkpoint-3"))
    resumed.close()
    seen["warnings"] = messages.seen
    final, ours = full_weights(full.model), full_weights(resumed.model)
    if resumed.args.process_index == 0:
        save_file(final, result + ".full")
        save_file(ours, result + ".resumed")
        with open(result + ".json", "w") as f:
            json.dump(seen, f)


@pytest.mark.timeout(300)
def test_fsdp2_trainer_takes_the_stock_save_with_a_warning_and_resumes_bit_exact(tmp_path):
    """Under FSDP2 SnapsvcTrainer warns once per trainer, naming FSDP2, why, and
    DistributedSnapshotWriter; writes the stock Trainer's files; and resumes from them
    to the uninterrupted stock run's weights, bit for bit."""
    from safetensors.torch import load_file
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
    result = str(tmp_path / "final")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         os.path.abspath(__file__), str(tmp_path), result],
        env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    with open(result + ".json") as f:
        seen = json.load(f)
    assert seen["fsdp"] == [True, "DTensor"]   # the Trainer really ran FSDP2
    assert seen["snapsvc"] == seen["stock"]
    assert "pytorch_model_fsdp_0/.metadata" in seen["stock"]
    assert len(seen["cut_warnings"]) == 1 and len(seen["warnings"]) == 2
    warning = seen["warnings"][0]
    for part in ("synchronous stock checkpoints", "FSDP2", "save_fsdp_model",
                 "DistributedSnapshotWriter", "docs/distributed.md"):
        assert part in warning, warning
    full, resumed = load_file(result + ".full"), load_file(result + ".resumed")
    assert full.keys() == resumed.keys()
    for name, tensor in full.items():
        assert torch.equal(resumed[name], tensor), name


if __name__ == "__main__":   # torchrun runs this file (the sidecar re-imports it: guarded)
    dist_fsdp(*sys.argv[1:3])

"""A tiny Hugging Face training run for tests/test_transformers.py (and its resume, as a script).

``python tests/hf_script.py KIND OUT RESULT [KIND OUT RESULT ...]`` resumes
each run in ``OUT`` from its last checkpoint with the stock ``Trainer`` (KIND
``stock``) or ``SnapsvcTrainer`` (``snapsvc``), trains to 8 steps and saves
the final weights to RESULT (safetensors). ``python tests/hf_script.py
--raise-at STEP OUT HOLD``: see :func:`raise_main`. :func:`dist_main` and
:func:`dist_second_train` run under torchrun in tests/test_hf_fsdp.py's launch.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, \
    TrainingArguments

STEPS_PER_EPOCH = 12   # 48 samples, batch 4: a resume at step 6 is mid-epoch


def make_model() -> BertForSequenceClassification:
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=37))


def make_dataset(n: int = 4 * STEPS_PER_EPOCH, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 100, (n, 16), generator=g)
    labels = torch.randint(0, 2, (n,), generator=g)
    return [{"input_ids": ids[i], "attention_mask": torch.ones(16, dtype=torch.long),
             "labels": labels[i]} for i in range(n)]


def make_args(out: str, **overrides: Any) -> TrainingArguments:
    kwargs: dict[str, Any] = dict(
        output_dir=out, per_device_train_batch_size=4, max_steps=8, save_strategy="steps",
        save_steps=3, lr_scheduler_type="constant", learning_rate=1e-3, report_to=[],
        use_cpu=True, seed=42, logging_steps=1000, disable_tqdm=True)
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


class StopAt(TrainerCallback):
    """Stop training after step ``step`` (its checkpoint is still saved): an interruption."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


class RaiseAt(TrainerCallback):
    """Raise ``error`` at the end of step ``step``: a training run that fails (a
    callback's error, Ctrl-C) after the checkpoints of the earlier steps were saved."""

    def __init__(self, step: int, error: BaseException) -> None:
        self.step, self.error = step, error

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step == self.step:
            raise self.error


class CustomBert(BertForSequenceClassification):
    """A remote-code model: registered for an auto class, so ``save_pretrained`` copies
    the file that defines it (this one) beside its config."""


CustomBert.register_for_auto_class("AutoModelForSequenceClassification")


def make_custom_model() -> CustomBert:
    """:func:`make_model`'s model as a remote-code one."""
    config = make_model().config
    torch.manual_seed(0)
    return CustomBert(config)


KINDS = ["stock", "snapsvc"]   # the stock Trainer (the control) and SnapsvcTrainer


def close(trainer: Any) -> None:
    """Stop a SnapsvcTrainer's sidecar; the stock Trainer has none."""
    if hasattr(trainer, "close"):
        trainer.close()


def make_trainer(kind: str, out: str, *, callbacks: list[Any] | None = None,
                 snapsvc_options: dict[str, Any] | None = None, eval_dataset: Any = None,
                 model: Any = None, train_dataset: Any = None, processing_class: Any = None,
                 **overrides: Any) -> Trainer:
    common = dict(model=make_model() if model is None else model,
                  args=make_args(out, **overrides),
                  train_dataset=make_dataset() if train_dataset is None else train_dataset,
                  eval_dataset=eval_dataset, callbacks=callbacks,
                  processing_class=processing_class)
    if kind == "stock":
        return Trainer(**common)
    from snapsvc.transformers import SnapsvcTrainer
    return SnapsvcTrainer(**common, snapsvc_options=snapsvc_options)


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def sleep_while(flag: str, seconds: float, stage: str, path: str) -> None:
    """Sidecar fault hook: hold each state-file write while ``flag`` exists."""
    if stage == "open" and ".meta" not in os.path.basename(path) and os.path.exists(flag):
        time.sleep(seconds)


def dist_main(out: str, result: str) -> None:
    """Under torchrun (gloo, CPU; 6 steps per epoch at world size 2): 8 steps with the
    stock Trainer, then SnapsvcTrainer stopped at step 4 and resumed from its checkpoint
    at step 3, mid-epoch, to 8; rank 0 saves the weights (RESULT.full, .cut, RESULT)."""
    from safetensors.torch import save_file
    full = make_trainer("stock", os.path.join(out, "full"), save_strategy="no",
                        ddp_backend="gloo")
    full.train()
    cut = make_trainer("snapsvc", os.path.join(out, "cut"), callbacks=[StopAt(4)],
                       ddp_backend="gloo")
    cut.train()
    cut.close()
    resumed = make_trainer("snapsvc", os.path.join(out, "cut"), ddp_backend="gloo")
    resumed.train(resume_from_checkpoint=True)
    resumed.close()
    if resumed.args.process_index == 0:
        save_file(weights(full.model), result + ".full")
        save_file(weights(cut.model), result + ".cut")
        save_file(weights(resumed.model), result)


def dist_second_train(out: str, result: str) -> None:
    """Under torchrun (2 ranks, gloo): train to 6 (checkpoints 3, 6), then, in the same
    process and trainer, train(resume_from_checkpoint=checkpoint-3) to 6 again; stock,
    then SnapsvcTrainer. Rank 0 saves each final model as RESULT.<kind>."""
    from safetensors.torch import save_file
    for kind in KINDS:
        run = os.path.join(out, kind)
        t = make_trainer(kind, run, max_steps=6, ddp_backend="gloo")
        t.train()
        t.train(resume_from_checkpoint=os.path.join(run, "checkpoint-3"))
        close(t)
        if t.args.process_index == 0:
            save_file(weights(t.model), f"{result}.{kind}")


def raise_main(step: str, out: str, hold: str) -> None:
    """SnapsvcTrainer saving at steps 3 and 6 (each write held 1 s while the file
    ``hold`` exists), then a RuntimeError at step ``step`` that ends the interpreter."""
    import functools

    import hf_script   # the sidecar unpickles the hook by its module's name, not __main__
    trainer = make_trainer("snapsvc", out, callbacks=[RaiseAt(int(step), RuntimeError(
        f"raised at step {step}"))], snapsvc_options={
            "fault_hook": functools.partial(hf_script.sleep_while, hold, 1.0)})
    trainer.train()


def end_world() -> None:
    """A torchrun script's last step, as torch's docs ask: every rank reaches it, then the
    default group is destroyed. Without it gloo's worker threads may still hold work at
    interpreter teardown, and the process dies with SIGABRT ("terminate called without an
    active exception", pytorch/pytorch#190489) after the run itself succeeded."""
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def main() -> None:
    from safetensors.torch import save_file
    args = sys.argv[1:]
    if args[0] == "--raise-at":
        return raise_main(*args[1:])
    for kind, out, result in zip(args[::3], args[1::3], args[2::3]):
        trainer = make_trainer(kind, out)
        trainer.train(resume_from_checkpoint=True)
        if kind != "stock":
            trainer.close()
        save_file(weights(trainer.model), result)


if __name__ == "__main__":
    main()

"""Training-loop stall per checkpoint: the stock HF Trainer against SnapsvcTrainer, one run.

A BERT of about 100 MiB of float32 parameters (AdamW: about 300 MiB of state
per checkpoint) trains on random token ids on the CPU; a checkpoint every
``--every`` steps. The stall is the time spent inside ``_save_checkpoint``
plus, in overlap mode, the time the next optimizer step waits for the copy.
The stock Trainer returns once its files are in the page cache (it does not
fsync); SnapsvcTrainer returns once the state is copied into shared memory
(with ``overlap=True``, before the parameters and optimizer state are), and
its checkpoint directory appears once the sidecar made it durable. ``drain``
is the wait at the end of training for the last commits. The first snapsvc
save also starts the sidecar and allocates the slots, so it is reported
apart and left out of the median. ``raw`` is ``torch._foreach_copy_`` of
exactly the tensors of that checkpoint (model, optimizer, scheduler, RNG)
into shared memory allocated once, timed right before each save in the same
process (benchmarks/rawcopy.py): right after it the sidecar (or the copier
thread) works on that checkpoint and would slow the raw copy. Each trainer's files are flushed (``os.sync``)
before the next trainer runs: the stock Trainer does not fsync, and its
writeback would slow the next run's sidecar.

Each snapsvc row is followed by what the sidecar did: how many saves waited
for a free slot (``WriteReport.slot_wait_s``: every slot still held a
checkpoint being written, so the save waited for the disk, not for its
copy), and per checkpoint the time queued, encoding and writing, and in
fsync, against the time between saves. A sidecar slower than the saves
turns into stall under the default policy ("block").

    python benchmarks/hf_stall.py [--steps 20 --every 4 --out benchmarks/results/DATE-hf.txt]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import transformers
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

from snapsvc.transformers import SnapsvcTrainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rawcopy import RawCopy  # noqa: E402


def timed(base: type) -> type:
    """``base`` with the time of each ``_save_checkpoint`` call recorded in ``stalls``."""

    class Timed(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.stalls: list[float] = []
            self.raw = RawCopy()
            self.drain = 0.0
            self.saved_at: list[float] = []
            self.handles: list[Any] = []   # SnapsvcTrainer: each save's WriteHandle
            committer = getattr(self, "_snapsvc_committer", None)
            if committer is not None:
                add = committer.add

                def kept_add(item: Any) -> None:
                    self.handles.append(item.handle)
                    add(item)

                committer.add = kept_add

        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            # The raw copy right before the save, not after it: after it, the sidecar
            # (or overlap mode's copier) works on this very checkpoint and slows it.
            self.raw.measure({"model": self.model, "optimizer": self.optimizer,
                              "scheduler": self.lr_scheduler, "rng": torch.get_rng_state()})
            t0 = time.perf_counter()
            self.saved_at.append(t0)
            super()._save_checkpoint(model, trial)
            self.stalls.append(time.perf_counter() - t0)
            writer = getattr(self, "snapsvc_writer", None)
            if writer is not None and "wait_staged" not in vars(writer):
                # overlap mode: the next optimizer step waits here for the copy; it
                # counts in this checkpoint's stall
                wait = writer.wait_staged

                def timed_wait(timeout: float | None = None) -> None:
                    t = time.perf_counter()
                    wait(timeout)
                    self.stalls[-1] += time.perf_counter() - t

                writer.wait_staged = timed_wait

        def _finalize_training(self, *args: Any) -> Any:
            t0 = time.perf_counter()
            if hasattr(self, "_snapsvc_drain"):
                self._snapsvc_drain(self.drain_timeout)
            self.drain = time.perf_counter() - t0
            return super()._finalize_training(*args)

    Timed.__name__ = base.__name__
    return Timed


def model() -> BertForSequenceClassification:
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=8192, hidden_size=512, num_hidden_layers=7, num_attention_heads=8,
        intermediate_size=2048))


def data(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 8192, (n, 16), generator=g)
    return [{"input_ids": ids[i], "labels": torch.tensor(i % 2)} for i in range(n)]


def run(cls: type, out: str, steps: int, every: int, **kwargs: Any) -> Any:
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=steps,
                             save_strategy="steps", save_steps=every, save_total_limit=2,
                             lr_scheduler_type="constant", report_to=[], use_cpu=True,
                             logging_steps=10_000, disable_tqdm=True)
    trainer = timed(cls)(model=model(), args=args, train_dataset=data(2 * steps), **kwargs)
    t0 = time.perf_counter()
    trainer.train()
    trainer.wall = time.perf_counter() - t0
    writer = getattr(trainer, "snapsvc_writer", None)
    if writer is not None:  # the sidecar's priority, relative to training's
        trainer.nice = os.getpriority(os.PRIO_PROCESS, writer.pid) - os.getpriority(
            os.PRIO_PROCESS, 0)
    if hasattr(trainer, "close"):
        trainer.close()
    # The stock Trainer does not fsync: its files would be flushed while the next
    # trainer's sidecar writes, slowing those writes. Flushed here, outside any timing.
    os.sync()
    return trainer


def sidecar_line(t: Any, skip: int) -> str:
    """Why a blocking save stalls past its copy: the saves that waited for a free slot
    (all of them busy: the sidecar was still writing earlier checkpoints), and how
    long the sidecar took per checkpoint, against the time between saves."""
    reports = [h.result() for h in t.handles][skip:]
    waits = [r.slot_wait_s for r in reports]
    gaps = [b - a for a, b in zip(t.saved_at, t.saved_at[1:])]

    def med(xs: list[float]) -> float:
        return statistics.median(xs) if xs else 0.0

    return (f"  sidecar (nice {t.nice}): {sum(w > 0.001 for w in waits)} of {len(waits)} saves "
            f"waited for a free slot (slots={t.snapsvc_options.get('slots', 2)}), p50 "
            f"{med(waits) * 1e3:.0f} "
            f"ms, max {max(waits, default=0) * 1e3:.0f} ms; per checkpoint (p50): queued "
            f"{med([r.queue_s for r in reports]):.2f} s, encode+write "
            f"{med([r.encode_s + r.write_s for r in reports]):.2f} s, fsync "
            f"{med([r.fsync_s for r in reports]):.2f} s; a save every {med(gaps):.2f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--out", help="also write the report to this file")
    p.add_argument("--json", help="also write the figures here")
    a = p.parse_args()
    mib = sum(t.numel() * t.element_size() for t in model().state_dict().values()) / 2**20
    lines = [f"hf_stall: {time.strftime('%Y-%m-%d')}, {platform.machine()}, "
             f"{os.cpu_count()} CPUs, torch {torch.__version__}, transformers "
             f"{transformers.__version__}",
             f"model: BERT, {mib:.0f} MiB float32 parameters, AdamW; {a.steps} steps, "
             f"a checkpoint every {a.every} (save_total_limit=2)",
             f"{'trainer':<16}{'saves':>6}{'stall p50 ms':>14}{'p99 ms':>9}{'raw p50 ms':>12}"
             f"{'stall/raw':>10}{'first ms':>10}{'drain ms':>10}{'train s':>9}"]
    medians, figures = {}, {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        for name, cls, kwargs in (("Trainer", Trainer, {}),
                                  ("SnapsvcTrainer", SnapsvcTrainer, {}),
                                  ("  overlap=True", SnapsvcTrainer,
                                   {"snapsvc_options": {"overlap": True}})):
            t = run(cls, os.path.join(tmp, str(len(medians))), a.steps, a.every, **kwargs)
            skip = 1 if cls is SnapsvcTrainer else 0
            steady, raw = t.stalls[skip:], t.raw.times[skip:]
            medians[name] = statistics.median(steady)
            ratio = statistics.median(s / c for s, c in zip(steady, raw))
            p99 = sorted(steady)[min(len(steady) - 1, int(0.99 * len(steady)))]
            figures[name.strip()] = {"p50": medians[name], "p99": p99, "ratio": ratio,
                                     "raw_p50": statistics.median(raw), "first": t.stalls[0]}
            lines.append(f"{name:<16}{len(t.stalls):>6}{medians[name] * 1e3:>14.1f}"
                         f"{p99 * 1e3:>9.1f}{statistics.median(raw) * 1e3:>12.1f}{ratio:>10.2f}"
                         f"{t.stalls[0] * 1e3:>10.1f}{t.drain * 1e3:>10.1f}{t.wall:>9.1f}")
            if t.handles:
                lines.append(sidecar_line(t, skip))
                figures[name.strip()]["slot_wait"] = [h.result().slot_wait_s
                                                      for h in t.handles]
    for name in ("SnapsvcTrainer", "  overlap=True"):
        lines.append(f"stall ratio stock / {name.strip()} (medians): "
                     f"{medians['Trainer'] / medians[name]:.2f}x")
    text = "\n".join(lines)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(figures, f, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())

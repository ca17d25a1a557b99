"""How long a Lightning checkpoint holds up the training loop, per checkpoint IO, in one run.

IOs (same model, same disk, same run; each in a fresh process):

  default   Lightning's TorchCheckpointIO: torch.save on the training thread
  async     Lightning's AsyncCheckpointIO: clone every tensor on the training
            thread, torch.save on a background thread
  snapsvc   snapsvc.lightning.SnapsvcCheckpointIO: copy into a shared-memory
            slot, the sidecar process writes (and fsyncs) the file
  overlap   SnapsvcCheckpointIO(overlap=True): the save copies the weights;
            AdamW's moments are copied behind the next step, whose optimizer
            step waits for that copy at the end of Lightning's closure

A LightningModule holds ``--mib`` MiB of float32 parameters (16 MiB tensors)
trained by AdamW, so each checkpoint is about 3x that (weights + two moments).
Each step waits ``--ms`` ms, as a host thread waits for its GPU, then AdamW
updates every parameter. ``ModelCheckpoint(every_n_train_steps=--every,
monitor="loss", save_top_k=2)`` checkpoints; the logged loss improves at every
step, so each interval's checkpoint enters the top 2 and the one it pushes out
is removed: ``best_k_models`` changes its keys at every save, and every save
asked for is timed (the script fails otherwise). What is timed per checkpoint:

  stall     Trainer.save_checkpoint as ModelCheckpoint calls it (Lightning's
            dump of the state, then CheckpointIO.save_checkpoint) plus the
            removal of the file pushed out of the top 2: the time the loop is held
  wait      overlap: how long the optimizer steps after that save waited
            for its copy (snapsvc's guard); counted in stall too
  io        CheckpointIO.save_checkpoint alone
  dump      Trainer.save_checkpoint less io: Lightning's own dump of the state
  io+wait   io plus wait, over raw: the copy's share of the stall, without
            Lightning's dump and the removal
  rm        CheckpointIO.remove_checkpoint alone
  raw       torch._foreach_copy_ of exactly the tensors of that checkpoint
            into shared memory allocated once, timed right before each save in
            the same process (benchmarks/rawcopy.py): the floor

The first checkpoint is reported apart (it starts the sidecar, allocates
slots, warms the page cache); medians are over the rest. ``fit`` is the whole
fit's wall time, teardown (draining pending writes) included.

    python benchmarks/lightning_stall.py                  # 64 MiB, 200 steps, every 20: 10 saves
    python benchmarks/lightning_stall.py --mib 256 --steps 80 --out results.txt
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rawcopy import RawCopy  # noqa: E402
from stall import build_model  # noqa: E402

from snapsvc.engine.copier import Copier  # noqa: E402

IOS = ["default", "async", "snapsvc", "overlap"]


def timed(fn: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - t0)
    return wrapper


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One fit with one IO; per-checkpoint times in seconds."""
    from snapsvc.lightning import SnapsvcCheckpointIO

    pl = _pl()
    AsyncCheckpointIO, TorchCheckpointIO = pl.plugins.io.AsyncCheckpointIO, pl.plugins.io.TorchCheckpointIO

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = build_model(f"{args.mib}M")

        def training_step(self, batch: Any, _idx: int) -> torch.Tensor:
            time.sleep(args.ms / 1e3)  # the "GPU" computing: the CPU is free meanwhile
            # a gradient on every parameter, at the cost of one pass over them
            loss = sum(p.sum() for p in self.net.parameters()) * 1e-9 + batch[0].sum() * 0
            # A monitored loss that improves at every step, as a training loss does on the whole:
            # every interval's checkpoint enters the top 2, which drops its worst, so
            # best_k_models changes its keys at every save. (A random value would save only when
            # it beats the top 2, and build_model seeds torch: the same few saves for every IO.)
            self.log("loss", 1.0 / (1 + self.global_step))
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    io = {"default": TorchCheckpointIO, "async": AsyncCheckpointIO, "snapsvc": SnapsvcCheckpointIO,
          "overlap": lambda: SnapsvcCheckpointIO(overlap=True)}[args.io]()
    stall: list[float] = []
    waits: list[float] = []  # per checkpoint: the guard's waits in the steps after it
    hold = Copier.hold

    def timed_hold(self: Copier) -> None:
        t0 = time.perf_counter()
        hold(self)
        if waits:
            waits[-1] += time.perf_counter() - t0

    Copier.hold = timed_hold
    inner: list[float] = []
    removal: list[float] = []  # per checkpoint: removing the file it pushed out of the top k
    raw = RawCopy()
    last: list[Any] = [None]
    save = timed(io.save_checkpoint, inner)

    def save_and_keep(checkpoint: Any, *a: Any, **k: Any) -> Any:
        last[0] = checkpoint
        return save(checkpoint, *a, **k)

    io.save_checkpoint = save_and_keep
    remove = io.remove_checkpoint

    def timed_remove(path: Any) -> None:  # ModelCheckpoint removes right after the save
        t0 = time.perf_counter()
        remove(path)
        removal[-1] += time.perf_counter() - t0

    io.remove_checkpoint = timed_remove
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        ckpt = pl.callbacks.ModelCheckpoint(dirpath=d, every_n_train_steps=args.every,
                                            monitor="loss", save_top_k=2)
        trainer = pl.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, plugins=[io],
                             callbacks=[ckpt], logger=False, enable_progress_bar=False,
                             enable_model_summary=False)
        timed_save = timed(trainer.save_checkpoint, stall)

        def save_then_raw(*a: Any, **k: Any) -> Any:
            # The floor: the same tensors (the last checkpoint's dict holds the live
            # ones), copied right before the save while the sidecar is idle; right
            # after, the copy would compete with the sidecar writing this checkpoint.
            # The first save has no dict before it: its copy follows it.
            if last[0] is not None:
                raw.measure(last[0])
            out = timed_save(*a, **k)
            if len(raw.times) < len(stall):
                raw.measure(last[0])
            waits.append(0.0)
            removal.append(0.0)
            return out

        trainer.save_checkpoint = save_then_raw
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(args.steps, 1)))
        t0 = time.perf_counter()
        trainer.fit(Lit(), data)
        fit_s = time.perf_counter() - t0
        files = sorted(os.listdir(d))
    if len(stall) != args.steps // args.every or len(inner) != len(stall):
        raise RuntimeError(f"{args.io}: {len(stall)} Trainer.save_checkpoint and {len(inner)} "
                           f"CheckpointIO.save_checkpoint calls, {args.steps // args.every} asked for")
    dump = [s - i for s, i in zip(stall, inner)]
    stall = [s + r + w for s, r, w in zip(stall, removal, waits)]
    return {"io": args.io, "stall": stall, "wait": waits, "inner": inner, "dump": dump, "removal": removal,
            "fit_s": fit_s, "raw": raw.times, "files": files}


def run_one(args: argparse.Namespace, io: str) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--io", io, "--mib", str(args.mib),
           "--steps", str(args.steps), "--every", str(args.every), "--ms", str(args.ms)]
    if args.dir:
        cmd += ["--dir", args.dir]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{io} worker failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(args: argparse.Namespace, rows: list[dict[str, Any]]) -> str:
    ms = lambda s: f"{1e3 * s:9.1f}"  # noqa: E731
    lines = [f"# lightning_stall: {time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} CPUs, "
             f"torch {torch.__version__}, {_pl().__name__} {_pl().__version__}",
             f"# model {args.mib} MiB float32 + AdamW (checkpoint ~{3 * args.mib} MiB), {args.steps} steps "
             f"of {args.ms:g} ms, a checkpoint every {args.every} steps (monitor, save_top_k=2)",
             "io        checkpoints  stall p50 ms  stall p99 ms  wait p50 ms  raw p50 ms  stall/raw  "
             "io p50 ms  io p99 ms  io+wait/raw  dump p50 ms  rm p50 ms  first stall ms   fit s  files"]
    for r in rows:
        rest, inner, raw = r["stall"][1:], r["inner"][1:], r["raw"][1:]
        r["p50"], r["raw_p50"] = statistics.median(rest), statistics.median(raw)
        r["ratio"] = ratio = statistics.median(s / c for s, c in zip(rest, raw))
        io_ratio = statistics.median((i + w) / c for i, w, c in zip(inner, r["wait"][1:], raw))
        r["io_p50"] = statistics.median(i + w for i, w in zip(inner, r["wait"][1:]))
        r["io_ratio"] = io_ratio
        lines.append(f"{r['io']:<9} {len(r['stall']):>11} {ms(r['p50']):>13} {ms(p99(rest)):>13} "
                     f"{ms(statistics.median(r['wait'][1:])):>12} {ms(statistics.median(raw)):>11} {ratio:10.2f} "
                     f"{ms(statistics.median(inner)):>10} {ms(p99(inner)):>10} {io_ratio:12.2f} "
                     f"{ms(statistics.median(r['dump'][1:])):>12} {ms(statistics.median(r['removal'][1:])):>10} "
                     f"{ms(r['stall'][0]):>15} {r['fit_s']:7.1f}  {' '.join(r['files'])}")
    by = {r["io"]: r["p50"] for r in rows}
    pairs = [(a, b) for a, b in (("default", "snapsvc"), ("async", "snapsvc"), ("snapsvc", "overlap"))
             if a in by and b in by]
    if pairs:
        lines.append("stall p50 ratio: " + ", ".join(f"{a}/{b} {by[a] / by[b]:.1f}x" for a, b in pairs))
    return "\n".join(lines)


def p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(0.99 * len(s)))]


def _pl() -> Any:
    """pytorch_lightning, or lightning.pytorch where only the ``lightning`` package is installed."""
    try:
        return importlib.import_module("pytorch_lightning")
    except ImportError:
        return importlib.import_module("lightning.pytorch")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=64, help="model size in MiB (multiple of 16)")
    # an interval (2 s or more) longer than a write, as in training; 10 saves: a median and a p99
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=20, help="steps between checkpoints")
    p.add_argument("--ms", type=float, default=30.0, help="simulated GPU compute per step")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    p.add_argument("--out", default=None, help="also write the table here")
    p.add_argument("--json", default=None, help="also write the figures here")
    p.add_argument("--ios", default=",".join(IOS), help=f"which IOs, comma-separated (default: {','.join(IOS)})")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--io", choices=IOS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    ios = args.ios.split(",")
    if not set(ios) <= set(IOS):
        p.error(f"--ios: {','.join(sorted(set(ios) - set(IOS)))} unknown; choose among {','.join(IOS)}")
    rows = [run_one(args, io) for io in ios]
    text = report(args, rows)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"$ python benchmarks/lightning_stall.py {' '.join(argv or sys.argv[1:])}\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How long a checkpoint holds up training: snapsvc next to its peers, in one run.

Methods (same models, same disk, same run):

  torch.save      synchronous torch.save + fsync
  thread-async    clone to CPU on the caller, torch.save in a thread (Lightning-like)
  dcp-process     torch.distributed.checkpoint.async_save, PROCESS checkpointer,
                  reused DefaultStager on shared memory, world size 1 on gloo
  snapsvc-block   SnapshotWriter.submit, blocking staging
  snapsvc-overlap SnapshotWriter(overlap=True) + guard(optimizer)

For every (model, method) a fresh worker process (so peak RSS is its own)
measures: the stall of each save() (p50, p99) with the write awaited outside
the timed region; the time until the file is durable; the time added per
checkpoint to a synthetic training loop (fixed compute plus an SGD update per
step, a checkpoint every ``--every`` steps) against the same loop without
checkpoints, run alternately twice each (medians); and peak RSS of the worker and of its children. snapsvc-block's
worker also times a raw copy of the same tensors into preallocated shared
memory (pinned memory on CUDA): the floor any staging pays.

    python benchmarks/stall.py                         # 64M 256M 1G small, all methods
    python benchmarks/stall.py --models 64M small --reps 20 --json out.json --plot out.png
    python benchmarks/stall.py --device cuda --dtype bfloat16 --models 1G   # on a GPU

Models: ``<N>M`` / ``<N>G`` are N MiB / GiB of 16 MiB tensors; ``small`` is
4096 tensors of 32 KiB (``small:<count>`` sets the count).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402
import snapsvc  # noqa: E402
from snapsvc import staging  # noqa: E402
from snapsvc.snapshot import model_sources  # noqa: E402

METHODS = ["torch.save", "thread-async", "dcp-process", "snapsvc-block", "snapsvc-overlap"]
DEFAULT_MODELS = ["64M", "256M", "1G", "small"]
_LARGE = 16 << 20


# -- models and the training loop ------------------------------------------------
def build_model(spec: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """A module of the named shape, filled with random data."""
    item = torch.empty((), dtype=dtype).element_size()
    if spec.startswith("small"):
        count = int(spec.split(":")[1]) if ":" in spec else 4096
        sizes = [(32 << 10) // item] * count
    else:
        total = int(spec[:-1]) << (20 if spec.endswith("M") else 30)
        sizes = [_LARGE // item] * (total // _LARGE)
    torch.manual_seed(0)
    m = nn.Module()
    for i, n in enumerate(sizes):
        m.register_parameter(f"p{i}", nn.Parameter(torch.randn(n, dtype=dtype, device=device)))
    return m


def model_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class Loop:
    """A training step: fixed compute, then an SGD update of every parameter.

    ``compute="sleep"`` (default) waits ``ms`` as a host thread waits for its
    GPU, leaving the CPU to whoever can use it: the picture of GPU training
    on a CPU-only box. ``compute="matmul"`` burns the CPU instead (``work``
    matmuls), so every CPU cycle a method spends in the background is taken
    from training.
    """

    def __init__(self, model: nn.Module, compute: str, ms: float, work: int,
                 device: str) -> None:
        for p in model.parameters():
            p.grad = torch.full_like(p, 1e-6)
        self.opt = torch.optim.SGD(model.parameters(), lr=1.0)
        self.a = torch.randn(256, 256, device=device)
        self.compute, self.ms, self.work, self.device = compute, ms, work, device

    def step(self) -> None:
        if self.compute == "sleep":
            time.sleep(self.ms / 1e3)
        else:
            x = self.a
            for _ in range(self.work):
                x = torch.tanh(x @ self.a)
        self.opt.step()
        if self.device == "cuda":
            torch.cuda.synchronize()


def calibrate(ms: float) -> int:
    """Matmuls per step that take about ``ms`` on this machine, idle."""
    a = torch.randn(256, 256)
    t0 = time.perf_counter()
    for _ in range(50):
        a = torch.tanh(a @ a)
    per = (time.perf_counter() - t0) / 50
    return max(1, round(ms / 1e3 / per))


# -- snapsvc as a method -------------------------------------------------------------
class Snapsvc:
    """snapsvc behind the peers' interface (benchmarks/peers.py)."""

    def __init__(self, overlap: bool) -> None:
        self.name = "snapsvc-overlap" if overlap else "snapsvc-block"
        self.overlap = overlap
        self.writer: snapsvc.SnapshotWriter | None = None
        self.handle: snapsvc.WriteHandle | None = None

    def setup(self, model: nn.Module, directory: str) -> None:
        self.writer = snapsvc.SnapshotWriter(directory, slots=2, keep_last=2,
                                             overlap=self.overlap).start()

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        assert self.writer is not None
        self.writer.guard(optimizer)

    def save(self, model: nn.Module, step: int) -> None:
        assert self.writer is not None
        self.handle = self.writer.submit(model, f"snap{step % 3}.fdl")

    def wait_durable(self) -> float:
        assert self.handle is not None
        return self.handle.result(timeout=600).total_s

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def make_method(name: str) -> Any:
    if name.startswith("snapsvc"):
        return Snapsvc(overlap=name == "snapsvc-overlap")
    for m in peers.peer_methods():
        if m.name == name:
            return m
    raise SystemExit(f"unknown method {name!r}; choose from {METHODS}")


def raw_copy_fn(model: nn.Module) -> Callable[[], None]:
    """The floor: one fused copy into preallocated shared (CPU) or pinned (CUDA) memory."""
    params, buffers = model_sources(model)
    src = [t for _, t in params + buffers]
    if src[0].is_cuda:
        dst = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in src]

        def copy() -> None:
            torch._foreach_copy_(dst, src, non_blocking=True)
            torch.cuda.synchronize()
        return copy
    layout = staging.Layout.of(params, buffers, "")
    views = staging.views(staging.allocate(layout), layout)
    return lambda: torch._foreach_copy_(views, src)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# -- one worker: one (model, method) -------------------------------------------------
def worker(args: argparse.Namespace) -> dict[str, Any]:
    dtype = getattr(torch, args.dtype)
    model = build_model(args.model, args.device, dtype)
    method = make_method(args.method)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="snapsvc-stall-") as d:
        method.setup(model, d)
        raw = raw_copy_fn(model) if args.method == "snapsvc-block" else None
        if raw is not None:
            raw()  # fault the destination pages in, as a warmed-up slot's are
        method.save(model, 0)
        method.wait_durable()
        stall, durable, raw_s = [], [], []
        with torch.no_grad():
            for i in range(1, args.reps + 1):
                model.p0.add_(1.0)  # the model changes between checkpoints
                if raw is not None:
                    t0 = time.perf_counter()
                    raw()
                    raw_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                method.save(model, i)
                stall.append(time.perf_counter() - t0)
                durable.append(method.wait_durable())

        loop = Loop(model, args.compute, args.compute_ms, args.work, args.device)
        if hasattr(method, "attach"):
            method.attach(loop.opt)
        loop.step()

        def run_loop(checkpoints: bool) -> tuple[float, int]:
            # ``every`` extra steps after the last checkpoint: its background
            # cost lands inside the timed region, as in a run that goes on.
            n = 0
            t0 = time.perf_counter()
            for s in range(1, args.steps + args.every + 1):
                loop.step()
                if checkpoints and s % args.every == 0 and s <= args.steps:
                    method.save(model, 1000 + s)
                    n += 1
            elapsed = time.perf_counter() - t0
            if n:
                method.wait_durable()
            return elapsed, n

        base, ckpt = [], []
        for _ in range(2):  # A B A B: drift on a shared machine hits both alike
            base.append(run_loop(False)[0])
            elapsed, n_ckpt = run_loop(True)
            ckpt.append(elapsed)
        base_s, ckpt_s = statistics.median(base), statistics.median(ckpt)
        method.close()
    self_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    child_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    row = {"model": args.model, "method": args.method, "MiB": model_bytes(model) / 2**20,
           "tensors": len(list(model.parameters())),
           "stall_p50_ms": 1e3 * statistics.median(stall), "stall_p99_ms": 1e3 * pct(stall, .99),
           "durable_p50_ms": 1e3 * statistics.median(durable),
           "added_per_ckpt_ms": 1e3 * (ckpt_s - base_s) / n_ckpt,
           "step_ms": 1e3 * base_s / (args.steps + args.every),
           "rss_MiB": self_rss, "child_rss_MiB": child_rss}
    if raw_s:
        row["raw_p50_ms"] = 1e3 * statistics.median(raw_s)
        row["raw_p99_ms"] = 1e3 * pct(raw_s, .99)
    return row


# -- the parent: runs the workers, prints, writes JSON and a plot ------------------------
def run_one(args: argparse.Namespace, model: str, method: str, work: int) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--model", model,
           "--method", method, "--work", str(work), "--reps", str(args.reps),
           "--compute", args.compute, "--compute-ms", str(args.compute_ms),
           "--steps", str(args.steps), "--every", str(args.every), "--device", args.device,
           "--dtype", args.dtype] + (["--dir", args.dir] if args.dir else [])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.worker_timeout)
    if out.returncode != 0:
        return {"model": model, "method": method, "error": out.stderr.strip().splitlines()[-1:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def ratio(rows: list[dict], model: str, a: str, key_a: str, b: str, key_b: str) -> float | None:
    ra = next((r for r in rows if r["model"] == model and r["method"] == a and key_a in r), None)
    rb = next((r for r in rows if r["model"] == model and r["method"] == b and key_b in r), None)
    if ra is None or rb is None or rb[key_b] <= 0:
        return None
    return ra[key_a] / rb[key_b]


def targets(rows: list[dict], models: list[str]) -> list[str]:
    """The issue's targets, each as a measured ratio and PASS/FAIL."""
    lines = []

    def check(label: str, value: float | None, limit: float) -> None:
        if value is None:
            lines.append(f"  {label}: n/a")
        else:
            lines.append(f"  {label}: {value:.3f} (target <= {limit}) "
                         f"{'PASS' if value <= limit else 'FAIL'}")

    for m in models:
        large = not m.startswith("small")
        check(f"{m}: block stall p50 / raw copy p50", ratio(rows, m, "snapsvc-block", "stall_p50_ms",
                                                           "snapsvc-block", "raw_p50_ms"), 1.2)
        check(f"{m}: block stall p50 / DCP stall p50", ratio(rows, m, "snapsvc-block", "stall_p50_ms",
                                                            "dcp-process", "stall_p50_ms"),
              0.8 if large else 0.2)
        check(f"{m}: overlap added/ckpt / DCP added/ckpt",
              ratio(rows, m, "snapsvc-overlap", "added_per_ckpt_ms", "dcp-process",
                    "added_per_ckpt_ms"), 0.25)
        check(f"{m}: overlap added/ckpt / torch.save added/ckpt",
              ratio(rows, m, "snapsvc-overlap", "added_per_ckpt_ms", "torch.save",
                    "added_per_ckpt_ms"), 0.05)
    return lines


def table(rows: list[dict]) -> str:
    head = (f"{'model':>7} {'method':<16} {'stall p50':>10} {'p99':>9} {'raw p50':>9} "
            f"{'added/ckpt':>11} {'durable p50':>12} {'RSS':>7} {'child RSS':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['model']:>7} {r['method']:<16} ERROR {r['error']}")
            continue
        raw = f"{r['raw_p50_ms']:9.2f}" if "raw_p50_ms" in r else f"{'':>9}"
        lines.append(f"{r['model']:>7} {r['method']:<16} {r['stall_p50_ms']:10.2f} "
                     f"{r['stall_p99_ms']:9.2f} {raw} {r['added_per_ckpt_ms']:11.2f} "
                     f"{r['durable_p50_ms']:12.1f} {r['rss_MiB']:7.0f} {r['child_rss_MiB']:9.0f}")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install -e '.[plot]')"
    models = list(dict.fromkeys(r["model"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, title in ((axes[0], "stall_p50_ms", "stall p50 (ms, log)"),
                           (axes[1], "added_per_ckpt_ms", "time added per checkpoint (ms, log)")):
        width = 0.8 / len(methods)
        for i, meth in enumerate(methods):
            vals = [next((max(r.get(key, 0), 1e-3) for r in rows
                          if r["model"] == m and r["method"] == meth and key in r), 1e-3)
                    for m in models]
            ax.bar([j + i * width for j in range(len(models))], vals, width, label=meth)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(models))], models)
        ax.set_yscale("log")
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return f"plot written to {path}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=DEFAULT_MODELS)
    ap.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    ap.add_argument("--reps", type=int, default=10, help="timed saves per (model, method)")
    ap.add_argument("--steps", type=int, default=30, help="training-loop steps per run")
    ap.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    ap.add_argument("--compute-ms", type=float, default=30.0, help="fixed compute per step")
    ap.add_argument("--compute", default="sleep", choices=["sleep", "matmul"],
                    help="sleep: the CPU is free while the 'GPU' computes (default); "
                    "matmul: training keeps the CPU busy")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--dir", default=None, help="where files go (default: a temp dir here)")
    ap.add_argument("--json", default=None, help="also write the rows as JSON here")
    ap.add_argument("--plot", default=None, help="also write a PNG plot here (needs matplotlib)")
    ap.add_argument("--worker-timeout", type=float, default=900.0)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--method", help=argparse.SUPPRESS)
    ap.add_argument("--work", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)), flush=True)
        return 0
    args.dir = os.path.abspath(args.dir or ".")
    work = calibrate(args.compute_ms)
    machine = (f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, torch "
               f"{torch.__version__}, device {args.device} {args.dtype}")
    if args.device == "cuda":
        machine += f" ({torch.cuda.get_device_name()})"
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} {machine}", flush=True)
    what = "sleep" if args.compute == "sleep" else f"{work} matmuls"
    print(f"# reps={args.reps}, loop {args.steps} steps of {args.compute_ms:.0f} ms compute "
          f"({what}) + SGD update, a checkpoint every {args.every}", flush=True)
    rows = []
    for model in args.models:
        for method in args.methods:
            rows.append(run_one(args, model, method, work))
            print(table([rows[-1]]).splitlines()[-1], flush=True)
    print()
    print(table(rows))
    print("targets:")
    print("\n".join(targets(rows, args.models)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine,
                       "args": {k: v for k, v in vars(args).items() if k != "worker"},
                       "rows": rows}, f, indent=1)
    if args.plot:
        print(plot(rows, args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How long submit() holds the training loop, next to a raw shared-memory copy.

One run, same tensors, same disk: for each model the loop alternates a raw
``torch._foreach_copy_`` into preallocated shared memory (the floor: what any
staging must pay) with ``SnapshotWriter.submit`` (blocking staging), waiting
for each write to be durable outside the timed region so a slot is free.

    python benchmarks/stall.py                      # 64 MiB, 256 MiB, 1 GiB, 4096 x 32 KiB
    python benchmarks/stall.py --models 64M small --reps 30 --json out.json

Models: ``<N>M`` / ``<N>G`` are N MiB / GiB of 16 MiB float32 tensors;
``small`` is 4096 tensors of 32 KiB (real models carry thousands of biases
and norms); ``small:<count>`` sets the count.
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
from typing import Callable

import torch
from torch import nn

import snapsvc
from snapsvc import staging
from snapsvc.snapshot import model_sources

_LARGE = 16 << 20


def build_model(spec: str) -> nn.Module:
    """A module of the named shape, filled with random data."""
    if spec.startswith("small"):
        count = int(spec.split(":")[1]) if ":" in spec else 4096
        sizes = [(32 << 10) // 4] * count
    else:
        total = int(spec[:-1]) << (20 if spec.endswith("M") else 30)
        sizes = [_LARGE // 4] * (total // _LARGE) + ([(total % _LARGE) // 4] if total % _LARGE else [])
    m = nn.Module()
    for i, n in enumerate(sizes):
        m.register_parameter(f"p{i}", nn.Parameter(torch.randn(n)))
    return m


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def raw_copy_fn(model: nn.Module) -> Callable[[], None]:
    """The floor: one fused copy into preallocated shared memory."""
    params, buffers = model_sources(model)
    layout = staging.Layout.of(params, buffers, "")
    dst = staging.views(staging.allocate(layout), layout)
    src = [t for _, t in params + buffers]
    return lambda: torch._foreach_copy_(dst, src)


def bench_model(spec: str, reps: int, directory: str) -> dict:
    model = build_model(spec)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    raw = raw_copy_fn(model)
    raw()  # fault the destination pages in once, as a slot's are after warm-up
    raw_s, submit_s, durable_s = [], [], []
    with snapsvc.SnapshotWriter(directory, slots=2, keep_last=1) as w:
        w.submit(model, f"{spec}.warm.fdl").result(timeout=600)
        for i in range(reps):
            t0 = time.perf_counter()
            raw()
            raw_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            handle = w.submit(model, f"{spec}.fdl")
            submit_s.append(time.perf_counter() - t0)
            report = handle.result(timeout=600)
            durable_s.append(report.total_s)
    row = {
        "model": spec, "tensors": len(list(model.parameters())), "MiB": nbytes / 2**20,
        "raw_p50_ms": 1e3 * statistics.median(raw_s), "raw_p99_ms": 1e3 * percentile(raw_s, .99),
        "stall_p50_ms": 1e3 * statistics.median(submit_s),
        "stall_p99_ms": 1e3 * percentile(submit_s, .99),
        "durable_p50_ms": 1e3 * statistics.median(durable_s),
    }
    row["ratio_p50"] = row["stall_p50_ms"] / row["raw_p50_ms"]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["64M", "256M", "1G", "small"])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir here)")
    ap.add_argument("--json", default=None, help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir or ".", prefix="snapsvc-bench-") as d:
        for spec in args.models:
            rows.append(bench_model(spec, args.reps, d))
            r = rows[-1]
            print(f"{r['model']:>10} {r['tensors']:>6} tensors {r['MiB']:8.1f} MiB | raw copy "
                  f"p50 {r['raw_p50_ms']:8.2f} ms p99 {r['raw_p99_ms']:8.2f} | submit stall p50 "
                  f"{r['stall_p50_ms']:8.2f} ms p99 {r['stall_p99_ms']:8.2f} | "
                  f"x{r['ratio_p50']:.2f} of raw | durable p50 {r['durable_p50_ms']:8.1f} ms",
                  flush=True)
    machine = f"{platform.node()} {platform.machine()} {os.cpu_count()} cpu, torch {torch.__version__}"
    print(f"# {time.strftime('%Y-%m-%d')} {machine}; reps={args.reps}; target: stall p50 <= 1.2x raw")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "machine": machine, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

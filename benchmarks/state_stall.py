"""How long ``submit()`` of a nested training state holds up training, against a raw copy.

The state is what a trainer checkpoints: a model of ``--mib`` MiB of float32
parameters (``--layers`` linear layers), its AdamW state, a scheduler, the
RNG state and Lightning's ``best_k_models``-like ``{"best_k": {path: 0-dim
tensor}}`` whose path changes at every save (``--fixed-names`` keeps it)::

    {"model": model, "opt": adamw, "sched": scheduler, "rng": torch.get_rng_state(),
     "loops": {"step": i, "best_k": {f"epoch={i}.ckpt": tensor(loss)}}}

Per rep, in alternating order (raw first on odd reps), each after the same
AdamW step: the STALL of ``writer.submit(state, path)`` and a RAW COPY, one
``torch._foreach_copy_`` of exactly the tensors that submit stages, into one
shared-memory buffer allocated once and laid out like a slot. Reported:
medians and p99 of both and their ratio, the sidecar's start (the first
submit), and the slot memory held at the end. Warm-up: ``slots`` untimed
saves, each written before the next, and one untimed raw copy; each timed
save is also written before the next (awaited outside the stall), as in a
trainer whose checkpoint interval is longer than a write.

``--uint8-mib N`` adds ``"codes"``, N MiB of uint8 (a dtype ``.fdl`` has no tag
for: it goes to the data file), changed in place before each save; the raw
copy covers it too, whichever way snapsvc stores it.

    python benchmarks/state_stall.py                 # 32 MiB, 40 reps
    python benchmarks/state_stall.py --mib 64 --reps 60 --fixed-names
    python benchmarks/state_stall.py --mib 1 --layers 2 --uint8-mib 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import snapsvc  # noqa: E402
from snapsvc.engine import staging  # noqa: E402
from snapsvc.format.layout import Layout  # noqa: E402
from snapsvc.state.tree import flatten  # noqa: E402


def build(mib: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    width = int((mib * (1 << 20) / 4 / layers) ** 0.5)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
    return model, opt, sched


def state_at(i: int, model: nn.Module, opt: torch.optim.Optimizer, sched: object,
             fixed_names: bool, codes: torch.Tensor | None = None) -> dict:
    name = "best.ckpt" if fixed_names else f"epoch=0-step={i}.ckpt"
    state = {"model": model, "opt": opt, "sched": sched, "rng": torch.get_rng_state(),
             "loops": {"step": i, "best_k": {name: torch.tensor(1.0 / (i + 1))}}}
    if codes is not None:
        state["codes"] = codes
    return state


def step(model: nn.Module, opt: torch.optim.Optimizer, sched: object) -> None:
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3) if p.grad is None else p.grad
    opt.step()
    sched.step()


def raw_copy(state: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every tensor of ``state`` and its view in one buffer laid out like a slot
    (``codes`` in a shared buffer of its own where this snapsvc keeps it out of
    the slot, in the metadata)."""
    flat = flatten(state)
    layout = Layout.of(flat.params, flat.buffers, "", state=flat.rest)
    srcs, views = flat.tensors(), staging.views(staging.allocate(layout), layout)
    codes = state.get("codes")
    if codes is not None and not any(t is codes for t in srcs):
        srcs.append(codes)
        views.append(torch.empty_like(codes).share_memory_())
    return srcs, views


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=32)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--fixed-names", action="store_true", help="best_k's key never changes")
    ap.add_argument("--uint8-mib", type=int, default=0,
                    help="add this many MiB of uint8 (a dtype .fdl has no tag for)")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, opt, sched = build(args.mib, args.layers)
    step(model, opt, sched)
    codes = torch.randint(0, 256, (args.uint8_mib << 20,), dtype=torch.uint8) \
        if args.uint8_mib else None
    stall, raw = [], []
    with tempfile.TemporaryDirectory() as d, \
            snapsvc.SnapshotWriter(d, slots=args.slots, keep_last=2) as w:
        t0 = time.perf_counter()
        w.submit(state_at(0, model, opt, sched, args.fixed_names, codes), "s0.ckpt.fdl").result(60)
        first_s = time.perf_counter() - t0
        for i in range(1, args.slots):
            w.submit(state_at(i, model, opt, sched, args.fixed_names, codes),
                     f"s{i}.ckpt.fdl").result(60)
        srcs, views = raw_copy(state_at(0, model, opt, sched, args.fixed_names, codes))
        torch._foreach_copy_(views, srcs)
        for i in range(args.slots, args.slots + args.reps):
            for op in (("raw", "save") if i % 2 else ("save", "raw")):
                step(model, opt, sched)
                if codes is not None:
                    codes.add_(1)
                if op == "raw":
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        torch._foreach_copy_(views, srcs)
                    raw.append(time.perf_counter() - t0)
                else:
                    state = state_at(i, model, opt, sched, args.fixed_names, codes)
                    t0 = time.perf_counter()
                    handle = w.submit(state, f"s{i}.ckpt.fdl")
                    stall.append(time.perf_counter() - t0)
                    handle.result(60)  # the write is awaited outside the stall
        stats = w.stats()
    out = {"mib": args.mib, "layers": args.layers, "uint8_mib": args.uint8_mib,
           "tensors": len(srcs), "reps": args.reps,
           "names": "fixed" if args.fixed_names else "changing",
           "first_submit_s": first_s,
           "stall_p50_ms": 1e3 * statistics.median(stall), "stall_p99_ms": 1e3 * pct(stall, .99),
           "raw_p50_ms": 1e3 * statistics.median(raw), "raw_p99_ms": 1e3 * pct(raw, .99),
           "slot_bytes": stats["slot_bytes"], "slots": stats["slots"]}
    out["ratio_p50"] = out["stall_p50_ms"] / out["raw_p50_ms"]
    out["ratio_p99"] = out["stall_p99_ms"] / out["raw_p99_ms"]
    # each save against the raw copy of its rep (timed just before or after it)
    out["ratio_paired"] = statistics.median(s / c for s, c in zip(stall, raw))
    print(f"nested state, {args.mib} MiB model in {args.layers} layers + AdamW + scheduler + rng "
          f"+ best_k ({out['names']} names)"
          + (f" + {args.uint8_mib} MiB uint8" if args.uint8_mib else "")
          + f", {out['tensors']} tensors, {args.reps} reps")
    print(f"  first submit (starts the sidecar): {first_s:.2f} s")
    print(f"  stall  p50 {out['stall_p50_ms']:8.2f} ms   p99 {out['stall_p99_ms']:8.2f} ms")
    print(f"  raw    p50 {out['raw_p50_ms']:8.2f} ms   p99 {out['raw_p99_ms']:8.2f} ms")
    print(f"  stall / raw copy: p50 {out['ratio_p50']:.2f}x   p99 {out['ratio_p99']:.2f}x")
    print(f"  slot memory at the end: {stats['slots']} slots, "
          f"{stats['slot_bytes'] / 2**20:.1f} MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

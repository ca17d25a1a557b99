"""The kept plan's fixed cost on many tiny tensors (issue 34): ``python benchmarks/plan_check.py``.

Models: ``tiny``, 20,000 1-D parameters of 256 B (stall.py's ``tiny``: they
go into the plan's ``torch.cat`` as themselves), and ``tiny2d``, 20,000
parameters of 4 x 16 float32 (256 B, 2-D: copied through flat aliases whose
addresses the plan compares at every submit). For each, ``--rounds`` rounds
of a blocking ``submit(model)`` beside a raw copy of the same tensors (one
``torch._foreach_copy_`` into one shared-memory buffer laid out like a slot,
faulted in once), raw first on odd rounds and the submit first on even
ones; an in-place add on every parameter before each. Prints the stall p50,
the raw p50 and the goal line (stall / raw <= 1.1). ``--profile`` adds the
functions that hold the submit longest (cProfile, ms per submit).

``--trees A B ...`` runs each case in a fresh process per tree (its
``snapsvc`` imported from that directory), the trees alternating, ``--runs``
times, and prints each tree's median ratio: the A/B of a change in one run.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time

GOAL = 1.1
CASES = {"tiny": (64,), "tiny2d": (4, 16)}


def measure(case: str, count: int, rounds: int, profile: bool) -> dict:
    import torch
    from torch import nn

    import snapsvc
    from snapsvc.engine import staging
    from snapsvc.format.layout import Layout

    torch.manual_seed(0)
    model = nn.Module()
    for i in range(count):
        model.register_parameter(f"p{i}", nn.Parameter(torch.randn(CASES[case])))
    params = list(model.named_parameters())
    src = [p for _, p in params]
    layout = Layout.of(params, [], "")
    views = staging.views(staging.allocate(layout), layout)
    torch._foreach_copy_(views, src)
    stalls: list[float] = []
    copies: list[float] = []

    def step() -> None:
        with torch.no_grad():
            torch._foreach_add_(src, 1e-3)

    def copy() -> None:
        step()
        t0 = time.perf_counter()
        with torch.no_grad():
            torch._foreach_copy_(views, src)
        copies.append(time.perf_counter() - t0)

    with tempfile.TemporaryDirectory() as d, snapsvc.SnapshotWriter(d, keep_last=None) as w:
        def submit(i: int) -> None:
            step()
            t0 = time.perf_counter()
            h = w.submit(model, f"s{i % 3}.fdl")
            stalls.append(time.perf_counter() - t0)
            h.result(timeout=120)

        for i in range(3):  # every slot used once
            submit(i)
        stalls.clear()
        for i in range(rounds):
            for op in ((copy, lambda: submit(i)) if i % 2 else (lambda: submit(i), copy)):
                op()
        lines: list[str] = []
        if profile:
            prof = cProfile.Profile()
            for i in range(10):
                step()
                prof.enable()
                h = w.submit(model, f"s{i % 3}.fdl")
                prof.disable()
                h.result(timeout=120)
            rows = sorted(pstats.Stats(prof).stats.items(),  # type: ignore[attr-defined]
                          key=lambda kv: -kv[1][3])[:18]
            lines.append(f"  {'own ms':>7} {'with callees':>12}  function (per submit)")
            for (file, line, name), (_, _, own, cum, _) in rows:
                where = f"{file.rsplit('/snapsvc/', 1)[-1]}:{line}" if "/snapsvc/" in file else file
                lines.append(f"  {1e3 * own / 10:7.2f} {1e3 * cum / 10:12.2f}  {name} ({where})")
    stall, raw = statistics.median(stalls) * 1e3, statistics.median(copies) * 1e3
    return {"case": case, "stall_ms": stall, "raw_ms": raw, "ratio": stall / raw,
            "profile": lines}


def goal_line(r: dict) -> str:
    return (f"{r['case']}: stall p50 {r['stall_ms']:.2f} ms, raw _foreach_copy_ p50 "
            f"{r['raw_ms']:.2f} ms; goal stall / raw = {r['ratio']:.3f} (target <= {GOAL}) "
            f"{'PASS' if r['ratio'] <= GOAL else 'FAIL'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--count", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--trees", nargs="+", default=None,
                    help="source trees to compare, alternating, one process per run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        for case in args.cases:
            print(json.dumps(measure(case, args.count, args.rounds, args.profile)), flush=True)
        return 0
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f}; {args.count} tensors, {args.rounds} rounds")
    if not args.trees:
        for case in args.cases:
            r = measure(case, args.count, args.rounds, args.profile)
            print("\n".join([goal_line(r), *r["profile"]]), flush=True)
        return 0
    ratios: dict[tuple[str, str], list[float]] = {}
    for run in range(args.runs):
        for tree in args.trees:
            env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
            out = subprocess.run([sys.executable, __file__, "--one", "--count", str(args.count),
                                  "--rounds", str(args.rounds), "--cases", *args.cases],
                                 env=env, capture_output=True, text=True, timeout=300, check=True)
            for line in out.stdout.splitlines():
                r = json.loads(line)
                ratios.setdefault((tree, r["case"]), []).append(r["ratio"])
                print(f"run {run + 1} {tree}: {goal_line(r)}", flush=True)
    print(f"medians of {args.runs} (trees alternating, one process each):")
    for (tree, case), xs in ratios.items():
        m = statistics.median(xs)
        print(f"  {tree} {case}: stall / raw {m:.3f} (target <= {GOAL}) "
              f"{'PASS' if m <= GOAL else 'FAIL'}  [{', '.join(f'{x:.3f}' for x in xs)}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``snapsvc demo`` and ``snapsvc bench``: the main job and the stall benchmark.
"""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import SnapsvcError
from .core import EXIT_FAILURE, EXIT_OK, UsageError, register


# -- demo ---------------------------------------------------------------------------
def _demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default="checkpoints", help="where checkpoints go (default: "
                   "./checkpoints)")
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument("--every", type=int, default=25, help="checkpoint every N steps (default 25)")
    p.add_argument("--keep-last", type=int, default=3, help="checkpoints kept (default 3)")


@register("demo", help="train a small CPU model with sidecar checkpoints, then restore",
          description="Train a small MLP on synthetic data on the CPU, checkpoint model, "
          "optimizer and step through the writer sidecar every --every steps into --dir, "
          "print a per-checkpoint stall table, then restore the last checkpoint into a fresh "
          "model and check it is bit-identical.", arguments=_demo_arguments)
def _demo(args: argparse.Namespace) -> int:
    from .demo import format_demo, run_demo  # torch training code: only when asked for

    if args.steps < args.every or args.every < 1:
        raise UsageError("--steps must be at least --every, and --every at least 1")
    print(f"snapsvc demo: {args.steps} steps, a checkpoint every {args.every}, into "
          f"{os.path.abspath(args.dir)}", flush=True)
    result = run_demo(args.dir, steps=args.steps, every=args.every, keep_last=args.keep_last)
    print(format_demo(result))
    return EXIT_OK if result.restored_ok else EXIT_FAILURE


# -- bench --------------------------------------------------------------------------
def _bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plot", default="stall.png", help="PNG plot (default stall.png)")
    p.add_argument("--json", default="stall.json", help="JSON rows (default stall.json)")
    p.add_argument("rest", nargs=argparse.REMAINDER,
                   help="further options for benchmarks/stall.py (after --), e.g. "
                   "-- --models 64M small --reps 20")


@register("bench", help="run the stall benchmark against the peers and write the plot",
          description="Run benchmarks/stall.py from the source checkout snapsvc is installed "
          "from: torch.save, a thread-based async save, DCP async_save and snapsvc, same "
          "models, one run. Exits 1 when a (model, method) cell failed (the table and files are "
          "written all the same).", arguments=_bench_arguments)
def _bench(args: argparse.Namespace) -> int:
    import subprocess

    script = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                          "benchmarks", "stall.py")
    if not os.path.exists(script):
        raise SnapsvcError(f"{script} not found: 'snapsvc bench' needs the source checkout "
                           "(pip install -e .)")
    rest = [a for a in args.rest if a != "--"]
    return subprocess.call([sys.executable, script, "--plot", args.plot, "--json", args.json,
                            *rest])

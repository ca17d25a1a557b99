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


# -- serve --------------------------------------------------------------------------
def _serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", help="the checkpoint directory its trainers write to")
    p.add_argument("--remote", default=None, help="a second tier (s3://, gs://, az:// or a "
                   "mounted directory): each durable checkpoint is copied there")
    p.add_argument("--keep", type=int, default=None, metavar="N",
                   help="keep the newest N files of each series (keep_last)")
    p.add_argument("--memory", type=int, default=None, metavar="BYTES",
                   help="cap the RAM of the trainer's slots plus the RAM copies held "
                   "(memory_limit); older RAM copies are evicted first")
    p.add_argument("--socket", default=None, metavar="PATH", help="listen here (default: "
                   "the directory's socket in the user's runtime folder); registered for "
                   "the directory either way")


@register("serve", help="run the writer sidecar as a service that outlives its trainers",
          description="Serve SnapshotWriter(DIRECTORY) trainers one at a time on a Unix "
          "socket: the same sidecar, its RAM copies (memory-only snapshots) and keep_last "
          "series kept across trainers. A trainer's death or close() leaves it running; "
          "SIGTERM or SIGINT ends it, removing its socket, its record and its RAM copies.",
          arguments=_serve_arguments)
def _serve(args: argparse.Namespace) -> int:
    from ..remote.store import check_remote
    from ..sidecar.serve import Service

    if args.keep is not None and args.keep < 1:
        raise UsageError("--keep must be at least 1")
    if args.memory is not None and args.memory < 1:
        raise UsageError("--memory must be at least 1 (bytes)")
    directory = os.path.abspath(args.directory)
    try:
        remote = check_remote(args.remote, directory, None, 300.0)
    except ValueError as e:
        raise UsageError(str(e)) from None
    Service(directory, sock=args.socket, keep_last=args.keep, remote=remote,
            memory=args.memory).run()
    return EXIT_OK

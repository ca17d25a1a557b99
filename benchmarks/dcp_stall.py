"""Stall of ``dcp.async_save`` (THREAD) per storage writer, each beside a raw copy (issue 33).

    PYTHONPATH=. python benchmarks/dcp_stall.py [--reps 3]

One process, a world of 1 on gloo, small plain state dicts (256 x 32 KiB and
16 x 1 MiB float32). For each writer: ``stall`` = time until ``async_save``
returns (the training thread's wait: staging), ``durable`` = until its future
resolves; ``raw`` = ``RawCopy`` of the same tensors right before. Writers:
DCP's ``FileSystemWriter`` with ``DefaultStager`` (shared memory, pinned off on
CPU, reused), and ``SnapsvcStorageWriter`` (not yet an AsyncStager: DCP's
default staging path stages for it). Medians over ``--reps`` after a warm-up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rawcopy import RawCopy  # noqa: E402
from snapsvc.dcp import SnapsvcStorageWriter  # noqa: E402

SHAPES = {"256x32KiB": (256, 8192), "16x1MiB": (16, 262144)}


def run(name: str, n: int, numel: int, reps: int, tmp: str) -> list[str]:
    state = {f"t{i}": torch.randn(numel) for i in range(n)}
    raw = RawCopy()
    rows = []
    stager = DefaultStager(StagingOptions(False, True, True, False))
    snap = SnapsvcStorageWriter(os.path.join(tmp, name, "snap", "step_0"))
    try:
        for method in ("dcp+DefaultStager", "snapsvc"):
            stalls, durables, raws = [], [], []
            for rep in range(reps + 1):
                r = raw.measure(state)
                t0 = time.perf_counter()
                if method == "snapsvc":
                    fut = dcp.async_save(state, storage_writer=snap, checkpoint_id=os.path.join(
                        tmp, name, "snap", f"step_{rep}"))
                else:
                    fut = dcp.async_save(state, async_stager=stager,
                                         storage_writer=dcp.FileSystemWriter(
                                             os.path.join(tmp, name, "fs", str(rep))))
                stall = time.perf_counter() - t0
                if hasattr(fut, "staging_completion"):
                    fut.staging_completion.result()
                    stall = time.perf_counter() - t0
                    fut = fut.upload_completion
                fut.result()
                durable = time.perf_counter() - t0
                if rep:   # the first is the warm-up
                    stalls.append(stall)
                    durables.append(durable)
                    raws.append(r)
            s, d, rc = (statistics.median(x) * 1e3 for x in (stalls, durables, raws))
            rows.append(f"{name:10} {method:18} stall {s:8.2f} ms  raw {rc:7.2f} ms  "
                        f"stall/raw {s / rc:6.1f}x  durable {d:8.1f} ms")
    finally:
        snap.close()
        stager.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name, (n, numel) in SHAPES.items():
                for row in run(name, n, numel, args.reps, tmp):
                    print(row, flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

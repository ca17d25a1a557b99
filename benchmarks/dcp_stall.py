"""Stall of ``dcp.async_save`` per storage writer and stager, each beside a raw copy (issue 33).

    PYTHONPATH=. python benchmarks/dcp_stall.py [--reps 3] [--shapes 4096x32KiB,nested4096x32KiB]
        [--no-load]

One process, a world of 1 on gloo, float32 state dicts. Flat ones, every tensor
a top-level key (``4096x32KiB``: 4096 tensors of 32 KiB; ``64x4MiB``;
``256x32KiB`` and ``16x1MiB`` for a quick run), and the shape DCP's users pass,
``{"model": model_sd, "optim": optim_sd}`` (``nested4096x32KiB``: 1366
parameters of 32 KiB and AdamW's state of each, ``exp_avg``, ``exp_avg_sq`` and
a 0-d ``step``, and its ``param_groups``: 4098 tensors of 32 KiB; ``nested256x32KiB``).

Per method: ``stall`` = until ``async_save`` returns and staging is complete
(the training thread's wait), ``durable`` = until the save's future resolves;
``stage()`` = the stager's own copy; ``dcp`` = stall minus ``stage()``, the work
DCP's ``async_save`` does on the training thread around the stager (whoever the
stager is: ``_stateful_to_state_dict`` makes a logged call per top-level key,
which dominates the flat 4096-key state and is small for the nested one);
``raw`` = ``RawCopy`` of the same tensors right before. Methods:

- ``dcp best``: ``FileSystemWriter`` with ``DefaultStager`` (shared memory,
  reused; pinned memory and CUDA streams off on CPU), THREAD;
- ``dcp thread``: ``FileSystemWriter`` and DCP's default staging (a fresh CPU
  copy per save), THREAD;
- ``snapsvc``: ``SnapsvcStorageWriter`` as its own stager, THREAD.

Then ``dcp.load`` of the last step: ``FileSystemReader`` vs ``SnapsvcStorageReader``.
Medians over ``--reps`` after a warm-up. Not measured here: FSDP2 + AdamW at
world size 2, and PROCESS mode.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rawcopy import RawCopy  # noqa: E402
from snapsvc.dcp import SnapsvcStorageReader, SnapsvcStorageWriter  # noqa: E402

SHAPES = {"4096x32KiB": (4096, 8192), "64x4MiB": (64, 1 << 20),
          "256x32KiB": (256, 8192), "16x1MiB": (16, 262144),
          "nested4096x32KiB": (4098, 8192), "nested256x32KiB": (258, 8192)}


def make_state(name: str) -> dict[str, Any]:
    """The state of shape ``name``: flat, or ``{"model": ..., "optim": ...}`` as AdamW's."""
    n, numel = SHAPES[name]
    if not name.startswith("nested"):
        return {f"t{i}": torch.randn(numel) for i in range(n)}
    params = n // 3
    model = {f"layers.{i}.weight": torch.randn(numel) for i in range(params)}
    optim = {"state": {i: {"step": torch.tensor(10.0), "exp_avg": torch.randn(numel),
                           "exp_avg_sq": torch.randn(numel).abs()} for i in range(params)},
             "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
                               "weight_decay": 0.01, "params": list(range(params))}]}
    return {"model": model, "optim": optim}


def _tensor_leaves(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensor_leaves(v)]
    if isinstance(state, list):
        return [t for v in state for t in _tensor_leaves(v)]
    return []


def _empty_like(state: Any) -> Any:
    """A load target of ``state``'s structure: tensors empty, other values as they are."""
    if isinstance(state, torch.Tensor):
        return torch.empty_like(state)
    if isinstance(state, dict):
        return {k: _empty_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_empty_like(v) for v in state]
    return state


def _wait(fut: Any, t0: float) -> tuple[float, float]:
    """(stall, durable) seconds of one async_save started at ``t0``."""
    stall = time.perf_counter() - t0
    if hasattr(fut, "staging_completion"):   # a stager whose stage() returns a future
        fut.staging_completion.result()
        stall = time.perf_counter() - t0
        fut = fut.upload_completion
    fut.result()
    return stall, time.perf_counter() - t0


def _timed_stage(stager: Any, into: list[float]) -> None:
    """Time each ``stager.stage()`` (the copy itself, without DCP's own work in async_save)."""
    stage = stager.stage

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return stage(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - t0)
    stager.stage = timed


def run(name: str, reps: int, tmp: str, load: bool = True) -> Iterator[str]:
    """Each method's row as soon as it is measured (a run cut short keeps what it printed)."""
    state = make_state(name)
    raw = RawCopy()
    stager = DefaultStager(StagingOptions(False, True, False, False))
    snap = SnapsvcStorageWriter(os.path.join(tmp, name, "snap", "step_0"))
    staged: dict[str, list[float]] = {"dcp best": [], "dcp thread": [], "snapsvc": []}
    _timed_stage(stager, staged["dcp best"])
    _timed_stage(snap, staged["snapsvc"])
    saves: dict[str, Callable[[int], Any]] = {
        "dcp best": lambda rep: dcp.async_save(
            state, async_stager=stager,
            storage_writer=dcp.FileSystemWriter(os.path.join(tmp, name, "best", str(rep)))),
        "dcp thread": lambda rep: dcp.async_save(
            state, storage_writer=dcp.FileSystemWriter(os.path.join(tmp, name, "fs", str(rep)))),
        "snapsvc": lambda rep: dcp.async_save(
            state, storage_writer=snap,
            checkpoint_id=os.path.join(tmp, name, "snap", f"step_{rep}")),
    }
    best = {}
    try:
        for method, save in saves.items():
            stalls, durables, raws = [], [], []
            for rep in range(reps + 1):
                r = raw.measure(state)
                t0 = time.perf_counter()
                stall, durable = _wait(save(rep), t0)
                if rep:   # the first is the warm-up
                    stalls.append(stall)
                    durables.append(durable)
                    raws.append(r)
            s, d, rc = (statistics.median(x) for x in (stalls, durables, raws))
            best[method] = (s, d)
            # stage() of each save, paired with its stall: DCP's own stager of "dcp thread"
            # is made per save and not timed
            st = staged[method][1:]
            if st:
                dcp_own = statistics.median(a - b for a, b in zip(stalls, st))
                stage = (f"stage() {statistics.median(st) * 1e3:8.2f} ms  dcp "
                         f"{dcp_own * 1e3:7.2f} ms")
            else:
                stage = f"stage()  (inside){'':17}"
            yield (f"{name:16} {method:11} stall {s * 1e3:9.2f} ms  {stage}  raw "
                        f"{rc * 1e3:7.2f} ms  stall/raw {s / rc:6.2f}x  durable {d * 1e3:8.1f} ms")
        s, d = best["snapsvc"]
        yield (f"{name:16} snapsvc vs dcp best: stall {s / best['dcp best'][0]:.2f}x, "
                    f"durable {d / best['dcp best'][1]:.2f}x; vs dcp thread: stall "
                    f"{s / best['dcp thread'][0]:.2f}x, durable {d / best['dcp thread'][1]:.2f}x")
        if load:
            yield load_times(name, state, reps, os.path.join(tmp, name, "fs", str(reps)),
                             os.path.join(tmp, name, "snap", f"step_{reps}"))
    finally:
        snap.close()
        stager.close()


def load_times(name: str, state: dict, reps: int, fs_dir: str, snap_dir: str) -> str:
    """Median ``dcp.load`` time of the same state through each reader."""
    out = {}
    for label, reader in (("FileSystemReader", lambda: dcp.FileSystemReader(fs_dir)),
                          ("SnapsvcStorageReader", lambda: SnapsvcStorageReader(snap_dir))):
        times = []
        for _ in range(reps):
            target = _empty_like(state)
            t0 = time.perf_counter()
            dcp.load(target, storage_reader=reader())
            times.append(time.perf_counter() - t0)
            assert all(map(torch.equal, _tensor_leaves(target), _tensor_leaves(state)))
        out[label] = statistics.median(times)
    fs, sn = out["FileSystemReader"], out["SnapsvcStorageReader"]
    return (f"{name:16} load: FileSystemReader {fs * 1e3:8.1f} ms  SnapsvcStorageReader "
            f"{sn * 1e3:8.1f} ms  ({sn / fs:.2f}x)")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--shapes", default="4096x32KiB,nested4096x32KiB,64x4MiB")
    p.add_argument("--no-load", action="store_true", help="skip the dcp.load comparison")
    args = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name in args.shapes.split(","):
                for row in run(name, args.reps, tmp, not args.no_load):
                    print(row, flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

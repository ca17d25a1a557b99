"""Stall of ``dcp.async_save`` per storage writer and stager, each beside a raw copy (issue 33).

    PYTHONPATH=. python benchmarks/dcp_stall.py [--reps 3] [--shapes 4096x32KiB,nested4096x32KiB]
        [--no-load] [--methods "dcp thread,snapsvc"]

A world of 1 on gloo, float32 state dicts, except ``fsdp2``. Flat ones, every tensor
a top-level key (``4096x32KiB``: 4096 tensors of 32 KiB; ``64x4MiB``;
``256x32KiB`` and ``16x1MiB`` for a quick run), and the shape DCP's users pass,
``{"model": model_sd, "optim": optim_sd}`` (``nested4096x32KiB``: 1366
parameters of 32 KiB and AdamW's state of each, ``exp_avg``, ``exp_avg_sq`` and
a 0-d ``step``, and its ``param_groups``: 4098 tensors of 32 KiB; ``nested256x32KiB``).
``fsdp2``: a world of 2 forked ranks on gloo, each saving its shards of an FSDP2
model (8 ``Linear(1024, 1024)``, each layer and the root ``fully_shard``-ed) after
one AdamW step, as ``{"model": get_model_state_dict(), "optim":
get_optimizer_state_dict()}`` (the FSDP2 tutorial's shape): per rank 16 MiB of
parameters and 32 MiB of AdamW state; rank 0's figures are printed, the raw copy
is of its local shards.

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
- ``dcp no-copy``: ``FileSystemWriter`` with a stager that copies nothing (it hands
  DCP the live state): no stager's stall can be lower; its ``dcp`` column is what
  ``async_save`` costs around any stager (not a safe way to save: training may
  change the tensors while they are written);
- ``snapsvc``: ``SnapsvcStorageWriter`` as its own stager, THREAD.

Then ``dcp.load`` of the last step: ``FileSystemReader`` vs ``SnapsvcStorageReader``.
Medians over ``--reps`` after a warm-up. Not measured here: PROCESS mode.
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
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rawcopy import RawCopy  # noqa: E402
from snapsvc.dcp import SnapsvcStorageReader, SnapsvcStorageWriter  # noqa: E402

SHAPES = {"4096x32KiB": (4096, 8192), "64x4MiB": (64, 1 << 20),
          "256x32KiB": (256, 8192), "16x1MiB": (16, 262144),
          "nested4096x32KiB": (4098, 8192), "nested256x32KiB": (258, 8192)}


class NoCopy(AsyncStager):
    """A stager that copies nothing: DCP writes the live state (the stall's floor)."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        pass


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


def fsdp2_state() -> dict[str, Any]:
    """This rank's FSDP2 + AdamW state after one step (see the module's docstring)."""
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict)
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(8)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 1024)).square().mean().backward()
    opt.step()
    return {"model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, opt)}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _tensor_leaves(state: Any) -> list[torch.Tensor]:
    """The tensors of ``state`` (a DTensor's local shard)."""
    if isinstance(state, torch.Tensor):
        return [_local(state)]
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


def run(name: str, state: dict[str, Any], reps: int, tmp: str, load: bool = True,
        methods: list[str] | None = None) -> Iterator[str]:
    """Each method's row as soon as it is measured (a run cut short keeps what it printed)."""
    raw = RawCopy()
    stager = DefaultStager(StagingOptions(False, True, False, False))
    snap = SnapsvcStorageWriter(os.path.join(tmp, name, "snap", "step_0"))
    nocopy = NoCopy()
    staged: dict[str, list[float]] = {"dcp best": [], "dcp thread": [], "dcp no-copy": [],
                                      "snapsvc": []}
    _timed_stage(stager, staged["dcp best"])
    _timed_stage(nocopy, staged["dcp no-copy"])
    _timed_stage(snap, staged["snapsvc"])
    saves: dict[str, Callable[[int], Any]] = {
        "dcp best": lambda rep: dcp.async_save(
            state, async_stager=stager,
            storage_writer=dcp.FileSystemWriter(os.path.join(tmp, name, "best", str(rep)))),
        "dcp thread": lambda rep: dcp.async_save(
            state, storage_writer=dcp.FileSystemWriter(os.path.join(tmp, name, "fs", str(rep)))),
        "dcp no-copy": lambda rep: dcp.async_save(
            state, async_stager=nocopy,
            storage_writer=dcp.FileSystemWriter(os.path.join(tmp, name, "nocopy", str(rep)))),
        "snapsvc": lambda rep: dcp.async_save(
            state, storage_writer=snap,
            checkpoint_id=os.path.join(tmp, name, "snap", f"step_{rep}")),
    }
    best = {}
    try:
        for method, save in saves.items():
            if methods is not None and method not in methods:
                continue
            stalls, durables, raws = [], [], []
            for rep in range(reps + 1):
                r = raw.measure(_tensor_leaves(state))   # a DTensor's local shard
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
        if {"snapsvc", "dcp best", "dcp thread"} <= set(best):
            s, d = best["snapsvc"]
            yield (f"{name:16} snapsvc vs dcp best: stall {s / best['dcp best'][0]:.2f}x, "
                   f"durable {d / best['dcp best'][1]:.2f}x; vs dcp thread: stall "
                   f"{s / best['dcp thread'][0]:.2f}x, durable {d / best['dcp thread'][1]:.2f}x")
        if load and {"snapsvc", "dcp thread"} <= set(best):
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
            dist.barrier()
        out[label] = statistics.median(times)
    fs, sn = out["FileSystemReader"], out["SnapsvcStorageReader"]
    return (f"{name:16} load: FileSystemReader {fs * 1e3:8.1f} ms  SnapsvcStorageReader "
            f"{sn * 1e3:8.1f} ms  ({sn / fs:.2f}x)")


def _print_all(shapes: list[str], reps: int, tmp: str, load: bool,
               methods: list[str] | None, rank: int = 0) -> None:
    for name in shapes:
        state = fsdp2_state() if name == "fsdp2" else make_state(name)
        for row in run(name, state, reps, tmp, load, methods):
            if rank == 0:
                print(row, flush=True)


def _fsdp2_rank(rank: int, tmp: str, reps: int, load: bool,
                methods: list[str] | None) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank,
                            world_size=2)
    try:
        _print_all(["fsdp2"], reps, tmp, load, methods, rank)
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--shapes", default="4096x32KiB,nested4096x32KiB,64x4MiB,fsdp2")
    p.add_argument("--no-load", action="store_true", help="skip the dcp.load comparison")
    p.add_argument("--methods", default=None,
                   help="comma-separated subset of: dcp best,dcp thread,dcp no-copy,snapsvc "
                        "(the load needs dcp thread and snapsvc)")
    args = p.parse_args()
    shapes = args.shapes.split(",")
    methods = None if args.methods is None else args.methods.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        if "fsdp2" in shapes:   # a world of 2 of its own, before this process joins one
            shapes.remove("fsdp2")
            import torch.multiprocessing as mp
            mp.start_processes(_fsdp2_rank, args=(tmp, args.reps, not args.no_load, methods), nprocs=2,
                               start_method="fork")
        if not shapes:
            return
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("gloo", rank=0, world_size=1)
        try:
            _print_all(shapes, args.reps, tmp, not args.no_load, methods)
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()

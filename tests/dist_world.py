"""Gloo worlds of forked processes on the CPU for the multi-rank tests (test_distributed, test_fsdp).

A scenario is a module-level function ``scenario(rank, world, tmp, **kwargs) -> dict``
run in each rank after ``init_process_group`` (rendezvous through a file in
``tmp``). A rank reports by writing ``result<rank>.json`` (its scenario's dict,
or a traceback); a rank about to kill itself writes its own with
:func:`write_result` first. Every run is bounded: the parent joins by a
deadline and kills stragglers.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import _shm_entries, shm_leaked

RUN_S = 100.0      # a whole spawned world, start to finish

# What the scenarios import, imported once per test process by multiprocessing's fork
# server, before anything ran in torch: each rank is a fork of that server (a clean
# process, as a spawned one, that pays no torch, FSDP or snapsvc import of its own, a few
# seconds a rank). tests/docs_world.py runs the docs examples the same way.
PRELOAD = ["torch", "torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.fsdp",
           "torch.distributed.tensor", "pytest", "snapsvc", "snapsvc.dcp"]

Scenario = Callable[..., dict]


def write_result(tmp: str, rank: int, result: dict) -> None:
    path = os.path.join(tmp, f"result{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


def rank_main(rank: int, world: int, init: str, tmp: str, scenario: Scenario,
              kwargs: dict[str, Any], env: dict[str, str], cwd: str) -> None:
    # the fork server's environment and directory are those of its start: a rank gets the
    # test's, as a spawned rank does
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    torch.set_num_threads(1)
    result: dict
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        try:
            result = scenario(rank, world, tmp, **kwargs)
        finally:
            dist.destroy_process_group()
    except BaseException:
        result = {"crash": traceback.format_exc()}
    write_result(tmp, rank, result)


def run_world(tmp_path, world: int, scenario: Scenario, *, run_s: float = RUN_S,
              check_shm: bool = True, **kwargs: Any) -> tuple[list[int | None], list]:
    """Spawn ``world`` ranks running ``scenario``, join them by a deadline, kill stragglers.

    ``check_shm=False``: /dev/shm may hold more afterwards (sidecars that linger on
    purpose, for a next world to take over; that world checks).

    Returns (exit codes, results); a rank that wrote no result has None.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)   # kept by the server once it runs
    init = f"file://{tmp_path}/rendezvous"
    shm_before = _shm_entries()
    procs = [ctx.Process(target=rank_main, name=f"rank{r}",
                         args=(r, world, init, str(tmp_path), scenario, kwargs,
                               dict(os.environ), os.getcwd()))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + run_s
    try:
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
    finally:
        stragglers = [p for p in procs if p.is_alive()]
        for p in stragglers:
            p.kill()
        for p in procs:
            p.join(10)
    codes = [p.exitcode for p in procs]
    pids = tuple(p.pid for p in procs if p.pid is not None)   # their torch_<pid>_ segments
    stragglers = [p.name for p in stragglers]
    for p in procs:
        if p.exitcode is not None:
            p.close()  # its sentinel fd
    results = []
    for r in range(world):
        try:
            with open(tmp_path / f"result{r}.json") as f:
                results.append(json.load(f))
        except FileNotFoundError:
            results.append(None)
    assert not stragglers, f"ranks {stragglers} did not finish in {run_s} s"
    for r, res in enumerate(results):
        assert res is None or "crash" not in res, f"rank {r} crashed:\n{res['crash']}"
    deadline = time.monotonic() + (20 if check_shm else 0)  # an orphaned sidecar may be exiting
    while check_shm and (leaked := shm_leaked(shm_before, str(tmp_path), pids)) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not check_shm or not leaked, f"/dev/shm entries leaked: {sorted(leaked)}"
    return codes, results

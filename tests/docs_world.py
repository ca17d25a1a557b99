"""Runs docs examples as torchrun would, for tests/test_docs.py: ``python docs_world.py``.

A server: each line on stdin is one request, JSON ``{"script", "world", "runs", "deadline_s",
"cwd", "env"}``; each answer on stdout is one line, JSON ``{"code"}``: 0 when every rank of
every run exited 0, else 1. A request runs in a forked *job* with its own directory and
environment; each run of the job starts ``world`` ranks, each running ``script`` as
``__main__`` with MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and LOCAL_RANK set, and waits
for them by the deadline (killing the rest). The job's own lines go to
``<script>.world.log``, each rank's output to ``<script>.run<run>.rank<rank>.log``.

Every rank is a fork made after this process imported torch, FSDP (and the dynamo it
loads) and snapsvc, and before anything ran in torch: the examples' imports are paid once
per test session, not once per rank and run. A rank exits as an interpreter does (atexit
handlers included) with the script's exit status: no frame above the fork catches its
SystemExit.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import time
import traceback

# imported once, for every rank: what the examples import (a fork shares it)
import torch  # noqa: F401
import torch._dynamo  # noqa: F401 - fully_shard imports it (seconds)
import torch.distributed.fsdp  # noqa: F401
import snapsvc  # noqa: F401

from remote_fixtures import free_port


def rank_main(script: str, run: int, rank: int, world: int, port: int) -> None:
    """In a forked rank: become what torchrun starts, run the script, exit with its status."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                      RANK=str(rank), LOCAL_RANK=str(rank))
    _output_to(f"{script}.run{run}.rank{rank}.log")
    sys.argv = [script]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
    sys.exit(0)


def run_world(script: str, world: int, runs: int, deadline_s: float) -> int:
    """In a forked job: ``runs`` runs of ``world`` ranks, one after the other."""
    deadline = time.monotonic() + deadline_s
    for run in range(runs):
        port = free_port()
        ranks = {}   # pid -> rank, while it runs
        for rank in range(world):
            pid = _fork()
            if pid == 0:
                rank_main(script, run, rank, world, port)
            ranks[pid] = rank
        failed = False
        while ranks and time.monotonic() < deadline:
            for pid in list(ranks):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    code = os.waitstatus_to_exitcode(status)
                    if code != 0:
                        print(f"run {run + 1}: rank {ranks[pid]} exited with {code}")
                        failed = True
                    del ranks[pid]
            time.sleep(0.05)
        for pid, rank in ranks.items():   # past the deadline
            print(f"run {run + 1}: rank {rank} still running after {deadline_s} s: killed")
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            failed = True
        if failed:
            return 1
    return 0


def serve() -> None:
    for line in sys.stdin:
        req = json.loads(line)
        pid = _fork()
        if pid == 0:   # the job
            os.chdir(req["cwd"])
            os.environ.clear()
            os.environ.update(req["env"])
            _output_to(f"{req['script']}.world.log")
            code = run_world(req["script"], req["world"], req["runs"], req["deadline_s"])
            sys.stdout.flush()
            os._exit(code)   # the job runs no example code: nothing to finalize
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), flush=True)


def _fork() -> int:
    sys.stdout.flush()   # nothing buffered here is written twice by a child
    sys.stderr.flush()
    return os.fork()


def _output_to(path: str) -> None:
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)


if __name__ == "__main__":
    serve()

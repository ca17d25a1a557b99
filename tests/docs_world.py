"""Run a docs example as torchrun would: ``python docs_world.py SCRIPT WORLD RUNS DEADLINE_S``.

Each run starts WORLD ranks, each running SCRIPT as ``__main__`` with MASTER_ADDR,
MASTER_PORT, RANK, WORLD_SIZE and LOCAL_RANK set, its output in
``SCRIPT.run<run>.rank<rank>.log``, and waits for them. The ranks are forks of this
process, made after importing torch, FSDP (and the dynamo it loads) and snapsvc and before anything runs in torch,
so a world pays those imports once, not once per rank and run (tests/test_docs.py runs
many worlds). A rank exits
as an interpreter does (atexit handlers included), with the script's exit status.

Exit status: 0 when every rank of every run exited 0; else 1, after killing the ranks
still running at the deadline (tests/test_docs.py reads the logs).
"""

from __future__ import annotations

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
    log = os.open(f"{script}.run{run}.rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.argv = [script]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
    sys.exit(0)


def main() -> int:
    script, world, runs, deadline_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    deadline = time.monotonic() + deadline_s
    failed = False
    for run in range(runs):
        port = free_port()
        ranks = {}   # pid -> rank, while it runs
        for rank in range(world):
            pid = os.fork()
            if pid == 0:   # nothing of this function's stack catches the child's SystemExit
                rank_main(script, run, rank, world, port)
            ranks[pid] = rank
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
            break
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

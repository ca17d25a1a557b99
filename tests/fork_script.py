"""A trainer that forks while its writer runs; prints one JSON line of what happened.

``python fork_script.py MODE PENDING DIR [MODE PENDING DIR ...]``: MODE ``fork`` (a raw
``os.fork()`` whose child tries a submit, then exits normally: through the ``with`` block
and the interpreter's exit handlers) or ``dataloader`` (a ``DataLoader(num_workers=2)``
started after the writer, run to the end); PENDING ``pending`` keeps a write in flight at
the fork. Each further group of three is another run, in turn, in the same process, with
a writer of its own; each prints its line.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

from torch import nn
from torch.utils.data import DataLoader

import snapsvc
import hooks


def child(w: snapsvc.SnapshotWriter, model: nn.Module, out: str) -> None:
    try:
        w.submit(model, "child.fdl")
        error = None
    except Exception as e:  # noqa: BLE001 - reported to the parent
        error = {"type": type(e).__name__, "snapsvc": isinstance(e, snapsvc.SnapsvcError),
                 "message": str(e)}
    with open(out, "w") as f:
        json.dump({"error": error}, f)
    sys.exit(0)  # unwinds the parent's ``with`` block in this child, then runs atexit


def wait_child(pid: int, timeout: float) -> tuple[float, int | None]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return time.monotonic() - t0, os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return time.monotonic() - t0, None


def main(mode: str, pending: bool, directory: str) -> None:
    model = nn.Linear(64, 64)
    # every write takes 1.5 s, so a second submit is still pending at the fork
    hook = functools.partial(hooks.sleep, 1.5) if pending else None
    result: dict = {}
    with snapsvc.SnapshotWriter(directory, drain_timeout=3, fault_hook=hook) as w:
        w.submit(model, "first.fdl").result(timeout=60)
        pid = w.pid
        handle = w.submit(model, "pending.fdl") if pending else None
        if mode == "fork":
            out = os.path.join(directory, "child.json")
            kid = os.fork()
            if kid == 0:
                child(w, model, out)
            result["child_s"], result["child_code"] = wait_child(kid, 30)
            with open(out) as f:
                result.update(json.load(f))
        else:
            loader = DataLoader(list(range(16)), batch_size=2, num_workers=2)
            result["batches"] = sum(1 for _ in loader)
        if handle is not None:
            try:
                handle.result(timeout=60)
                result["pending_ok"] = True
            except Exception as e:  # noqa: BLE001
                result["pending_ok"] = repr(e)
        try:
            w.submit(model, "after.fdl").result(timeout=60)
            result["after_ok"] = True
        except Exception as e:  # noqa: BLE001
            result["after_ok"] = repr(e)
        result["same_sidecar"] = w.pid == pid
        result["restarts"] = w.stats()["restarts"]
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    for i in range(1, len(sys.argv), 3):
        main(sys.argv[i], sys.argv[i + 1] == "pending", sys.argv[i + 2])

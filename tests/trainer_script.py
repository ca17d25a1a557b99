"""A stand-in training process for the tests that kill or stop a trainer.

    python tests/trainer_script.py MODE DIRECTORY N DELAY DRAIN

Starts a SnapshotWriter on DIRECTORY whose writes each take DELAY seconds,
submits N snapshots (the model changes between them), waits up to DRAIN
seconds for queued writes at exit, prints one JSON line
{"writer_pid", "paths", "states"} and then, by MODE:

- ``sigkill``: SIGKILLs itself;
- ``exit``: returns without close(), leaving the drain to interpreter exit;
- ``wait``: sleeps until a signal arrives (the test sends SIGTERM or SIGINT).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hooks  # noqa: E402
import snapsvc  # noqa: E402


def main() -> None:
    mode, directory, n, delay, drain = (sys.argv[1], sys.argv[2], int(sys.argv[3]),
                                        float(sys.argv[4]), float(sys.argv[5]))
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    w = snapsvc.SnapshotWriter(directory, slots=n, drain_timeout=drain,
                               fault_hook=functools.partial(hooks.sleep, delay))
    w.start()
    paths, sums = [], []
    for i in range(n):
        w.submit(model, f"t{i}.fdl", epoch=i)
        paths.append(os.path.join(directory, f"t{i}.fdl"))
        sums.append(model.weight.sum().item())
        with torch.no_grad():
            model.weight.add_(1.0)
    print(json.dumps({"writer_pid": w.pid, "paths": paths, "sums": sums}), flush=True)
    if mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "wait":
        while True:
            time.sleep(0.05)


if __name__ == "__main__":
    main()

"""Trainers SIGKILLed at random points, one after another, each resumed from the RAM tier.

    python tests/restart_kill_script.py DIRECTORY ROUNDS SEED OUT

One interpreter imports torch once, runs the control (the same training,
saved with stock ``torch.save`` after every step), then forks ROUNDS
trainers in turn, each a new process for snapsvc (a SnapshotWriter of its
own, no writer inherited: this process never opens one). Trainer ``r``:

1. opens ``SnapshotWriter(DIRECTORY, linger=, persist_every=3)``, which
   attaches to the sidecar its killed predecessor left lingering;
2. restores ``snapsvc.latest(DIRECTORY)`` (model, AdamW, scheduler, RNG,
   loader position) into fresh objects, noting whether the RAM tier held it;
3. compares the whole state bit for bit with the control's at that step;
4. trains and submits a few steps, then is SIGKILLed (by itself) at a
   random point: mid-copy (a thread kills it while ``submit`` copies),
   mid-write (just after ``submit`` returned, the sidecar writing), or
   between a memory-only submit's ``result()`` and the next submit.

Each trainer appends one JSON line to OUT before training (what it
restored) and notes each step it submits, so the test can check the
restored step against what the dead trainer had handed over. Torch runs
one thread (bit-exact against the control, and safe across fork).
"""

from __future__ import annotations

import io
import json
import os
import random
import signal
import sys
import threading
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import snapsvc  # noqa: E402
from bitwise import assert_bit_identical  # noqa: E402
from snapsvc.files import ramtier, rendezvous  # noqa: E402

STEPS = 200          # more than ROUNDS trainers can reach
DATA = torch.randn(STEPS, 16, 32, generator=torch.Generator().manual_seed(1))
TARGETS = torch.randn(STEPS, 16, 8, generator=torch.Generator().manual_seed(2))
BIG = 1 << 20        # a 4 MiB buffer in the state: a copy long enough to be killed in


def objects() -> dict:
    """A fresh trainer's state, the same seed every time."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return {"model": model, "opt": opt, "sched": sched,
            "rng": {"torch": torch.get_rng_state()}, "loader": {"pos": 0},
            "buffer": torch.zeros(BIG)}


def train_step(s: dict) -> None:
    pos = s["loader"]["pos"]
    s["model"].train()
    loss = nn.functional.mse_loss(s["model"](DATA[pos]), TARGETS[pos])  # dropout: the RNG
    s["opt"].zero_grad()
    loss.backward()
    s["opt"].step()
    s["sched"].step()
    s["loader"]["pos"] = pos + 1
    s["buffer"][pos] = float(pos)
    s["rng"]["torch"] = torch.get_rng_state()


def plain(s: dict) -> dict:
    """The state as torch.save keeps it."""
    return {"model": s["model"].state_dict(), "opt": s["opt"].state_dict(),
            "sched": s["sched"].state_dict(), "rng": torch.get_rng_state(),
            "pos": s["loader"]["pos"], "buffer": s["buffer"]}


def control() -> list[bytes]:
    """The stock run: torch.save of the state after each step (index = steps done)."""
    s = objects()
    saved = []
    for _ in range(STEPS):
        f = io.BytesIO()
        torch.save(plain(s), f)
        saved.append(f.getvalue())
        train_step(s)
    return saved


def note(out: str, **record) -> None:
    with open(out, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def trainer(directory: str, rng: random.Random, rnd: int, saved: list[bytes], out: str) -> None:
    s = objects()
    w = snapsvc.SnapshotWriter(directory, linger=30, persist_every=3)
    w.start()
    newest = snapsvc.latest(directory)
    step, from_ram, exact = 0, False, True
    if newest is not None:
        from_ram = ramtier.held(newest) is not None
        report = snapsvc.restore(newest, s)
        s["loader"]["pos"] = report.state["loader"]["pos"]
        torch.set_rng_state(s["rng"]["torch"])
        step = s["loader"]["pos"]
        try:
            expected = torch.load(io.BytesIO(saved[step]), weights_only=True)
            assert_bit_identical(plain(s), expected)
        except AssertionError as e:
            exact = f"{e}" or "differs"
    point = ("mid-copy", "mid-write", "between")[rnd % 3]  # each often; when within it: random
    todo = rng.randint(1, 4)  # submits before the kill
    note(out, round=rnd, attached=w.attached is not None and w.attached.pid,
         newest=newest, step=step, from_ram=from_ram, exact=exact, point=point, pid=os.getpid())
    for i in range(todo):
        train_step(s)
        step = s["loader"]["pos"]
        last = i == todo - 1
        note(out, round=rnd, submitting=step)
        if last and point == "mid-copy":
            delay = rng.uniform(0, 0.004)
            threading.Thread(target=lambda: (time.sleep(delay),
                                             os.kill(os.getpid(), signal.SIGKILL))).start()
        handle = w.submit(s, f"step{step}.fdl")
        note(out, round=rnd, submitted=step)
        if last and point == "mid-write":
            os.kill(os.getpid(), signal.SIGKILL)
        handle.result(30)
        if last and point == "between":
            train_step(s)   # half way to the next submit
            os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(30)  # mid-copy: the killer thread ends it
    os.kill(os.getpid(), signal.SIGKILL)


def wait_lingering(directory: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock = rendezvous.socket_path(directory)
        if sock is not None and os.path.exists(sock):
            return True
        time.sleep(0.02)
    return False


def main() -> None:
    directory, rounds, seed, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    saved = control()
    rng = random.Random(seed)
    for rnd in range(rounds):
        pid = os.fork()
        if pid == 0:
            try:
                trainer(directory, rng, rnd, saved, out)
            finally:
                os._exit(3)  # never back into this loop
        _, status = os.waitpid(pid, 0)
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        note(out, round=rnd, killed=killed, lingering=killed and wait_lingering(directory, 20))
        rng.random()  # the child's draws do not advance ours: move on
        rng = random.Random(rng.getrandbits(64))
    # the last one: attach and close cleanly, so the lingering sidecar's RAM copies go
    with snapsvc.SnapshotWriter(directory) as w:
        w.start()
        note(out, final=True, attached=w.attached is not None)


if __name__ == "__main__":
    main()

"""No shared-memory slot is leaked by a refused submit or a dead sidecar (issue 20, section 5).

Slots are file descriptors (torch's ``file_descriptor`` sharing: nothing in
/dev/shm), so leaks are counted as open fds to shared memory, in the
sidecar and in the trainer.
"""

from __future__ import annotations

import functools
import os
import signal
import time

import pytest
import torch
from torch import nn

import snapsvc
import hooks

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("no_leaks")]


def shm_fds(pid: int | str = "self") -> int:
    """Open fds of ``pid`` to shared memory (slots)."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/dev/shm/")
        except FileNotFoundError:
            pass
    return n


def test_a_submit_refused_by_the_slot_budget_frees_the_sidecars_slots(tmp_path):
    small, big = nn.Linear(16, 16), nn.Linear(64, 64)  # 1 KiB and 16 KiB of slots
    counts = []
    with snapsvc.SnapshotWriter(tmp_path, slots=2, max_slot_bytes=12_000) as w:
        for i in range(4):
            # a new layout each round (16 -> 17, ...): the last round's pool goes idle
            other = nn.Linear(16, 16 + i)
            w.submit(other, f"o{i}.fdl").result(timeout=60)
            w.submit(small, f"s{i}.fdl").result(timeout=60)
            with pytest.raises(snapsvc.SlotBudgetError):
                w.submit(big, f"b{i}.fdl")
            w.submit(small, f"t{i}.fdl").result(timeout=60)  # a FREE, if any, is read by now
            counts.append((shm_fds(w.pid), w.stats()["slots"]))
    assert counts[-1] == counts[0], f"sidecar slot fds, trainer slots per round: {counts}"


def test_a_sidecar_killed_before_it_read_a_slot_leaves_no_fd_in_the_trainer(tmp_path):
    torch.manual_seed(0)
    slow = nn.Linear(8, 8)
    counts = []
    hook = functools.partial(hooks.pause, "open", "slow", 30.0)  # the sidecar stays busy
    with snapsvc.SnapshotWriter(tmp_path, slots=1, fault_hook=hook) as w:
        for i in range(4):
            pending = w.submit(slow, f"slow{i}.fdl")
            # a layout larger than the arena: a new slot goes down the pipe, the
            # sidecar never reads it
            with pytest.raises(TimeoutError, match="not mapped"):
                w.submit(nn.Linear(8, 4096 + i), f"new{i}.fdl", timeout=0.5)
            os.kill(w.pid, signal.SIGKILL)
            with pytest.raises(snapsvc.BrokenWriterError):
                pending.result(timeout=30)
            w.start()  # a new sidecar (it maps nothing until the next submit)
            time.sleep(0.2)
            counts.append(shm_fds())
    assert counts[-1] == counts[0], f"trainer fds to shared memory after each death: {counts}"

"""Restart from a SIGKILLed trainer: the RAM tier against disk and a raw copy (issue 31).

A trainer process fills a model-sized state (one float32 tensor of ``--mib``
MiB plus a step counter), submits it with ``linger``, once persisted and once
memory-only, and SIGKILLs itself. Then, for each source, a fresh process
imports snapsvc (timed apart), restores the state into a preallocated tensor and
checks it bit-exact:

- ram:        the memory-only snapshot, held by the lingering sidecar
- warm disk:  the persisted snapshot, page cache warm
- cold disk:  the same after posix_fadvise(POSIX_FADV_DONTNEED) on its files
- memcpy:     a raw copy of the same bytes from an in-memory tensor: the floor

Run: python benchmarks/restart.py --mib 64 --rounds 1 [--out FILE]
Not measured here (issue 31 asks for them): AdamW/scheduler/RNG/loader state,
512 MiB, the remote tier (moto).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout

TRAINER = """
import os, signal, sys, torch, snapsvc
d, mib = sys.argv[1], int(sys.argv[2])
w = snapsvc.SnapshotWriter(d, linger=120)
state = {"w": torch.arange(mib << 18, dtype=torch.float32), "step": 7}
w.submit(state, "disk7.fdl").result()
w.submit(state, "ram7.fdl", persist=False).result()
print(w.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""

READER = """
import sys, time
t0 = time.perf_counter()
import torch, snapsvc
t1 = time.perf_counter()
path, mib, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]
target = {"w": torch.empty(mib << 18, dtype=torch.float32), "step": 0}
expected = torch.arange(mib << 18, dtype=torch.float32)
t2 = time.perf_counter()
if how == "memcpy":
    target["w"].copy_(expected)
else:
    snapsvc.restore(path, target)
t3 = time.perf_counter()
assert torch.equal(target["w"], expected), "not bit-exact"
print(f"{t1 - t0:.4f} {t3 - t2:.4f}")
"""


def _evict(path: str) -> None:
    for name in (path, path + ".meta"):
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _run(path: str, mib: int, how: str) -> tuple[float, float, float]:
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", READER, path, str(mib), how], check=True,
                         capture_output=True, text=True, timeout=300).stdout.split()
    return float(out[0]), float(out[1]), time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lines = [f"restart benchmark: {args.mib} MiB float32, {args.rounds} round(s), "
             f"{os.cpu_count()} CPUs, python {sys.version.split()[0]}",
             f"{'source':<10} {'imports_s':>10} {'restore_s':>10} {'process_s':>10} {'GB/s':>7}"]
    with tempfile.TemporaryDirectory(dir=os.getcwd()) as d:
        for _ in range(args.rounds):
            # no pipe: the lingering sidecar inherits the trainer's stdout and would hold it
            code = subprocess.run([sys.executable, "-c", TRAINER, d, str(args.mib)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  timeout=300).returncode
            assert code == -signal.SIGKILL, code
            ram, disk = os.path.join(d, "ram7.fdl"), os.path.join(d, "disk7.fdl")
            assert not os.path.exists(ram)  # memory-only: never on disk
            rows = [("ram", ram, "restore"), ("warm disk", disk, "restore"),
                    ("cold disk", disk, "cold"), ("memcpy", ram, "memcpy")]
            _run(disk, args.mib, "restore")  # warm the page cache
            for name, path, how in rows:
                if how == "cold":
                    _evict(path)
                imports_s, restore_s, process_s = _run(path, args.mib,
                                                       "memcpy" if how == "memcpy" else "r")
                gbs = (args.mib << 20) / restore_s / 1e9
                lines.append(f"{name:<10} {imports_s:>10.3f} {restore_s:>10.4f} "
                             f"{process_s:>10.3f} {gbs:>7.2f}")
            with snapsvc_writer(d):  # attach and close: the lingering sidecar ends
                pass
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


class snapsvc_writer:
    """A writer on ``d`` opened and closed: it takes over the lingering sidecar's
    RAM copies, and its clean close frees them."""

    def __init__(self, d: str) -> None:
        import snapsvc
        self.w = snapsvc.SnapshotWriter(d)

    def __enter__(self) -> None:
        self.w.start()

    def __exit__(self, *exc: object) -> None:
        self.w.close()


if __name__ == "__main__":
    main()

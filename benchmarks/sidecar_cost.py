"""What the writer sidecar costs: its memory and CPU to the first write, and its write speed.

    PYTHONPATH=. python benchmarks/sidecar_cost.py [--starts 3] [--mib 256] [--small 10000]
        [--repeat 3] [--dir DIR] [--sections start write]

* start: a SnapshotWriter writes a small model once; then, from the
  sidecar's /proc entries, its CPU time (user + system) from its spawn to
  that first DONE, its peak and current RSS, and whether it has torch
  loaded (``libtorch`` in its maps). --starts writers, one after another.
* write: the sidecar's own write path in this process (its slot encoders
  built by ``snapsvc.sidecar.writes.Files`` from a layout message, over an
  anonymous mapping standing for the slot), a checkpoint of one --mib MiB
  float32 tensor, --small float32 tensors of 1 KiB, a few int64 and a bool
  tensor (the data file), written durably plain and gzip (default level) to
  --dir (``durable``: the whole write, fsync included), and the same
  encoders into a sink that drops the bytes (``null``: encoding and gzip
  alone, the part that is CPU, not disk), also for an encoder of the small
  tensors alone (``small``: the ~1 MiB batches, where per-entry cost shows).
  The slot holds random bytes (gzip's worst case). MB/s is 10^6 bytes of
  tensor data per second, fastest and median of --repeat after one warm-up.

Run it against an older snapsvc with PYTHONPATH pointing at its export: the
write section uses only what both have (``Files.encoders``, ``write_with_meta``).
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import time

import torch

import snapsvc
from snapsvc.sidecar import writes
from snapsvc.files.meta import Meta, write_with_meta
from snapsvc.format.layout import Layout
from snapsvc.format.streams import gzip_writer


class Null:
    """A writer that drops what it is given."""

    def write(self, data) -> int:
        return memoryview(data).nbytes

    def flush(self) -> None:
        pass


def timed(fn, repeat: int) -> list[float]:
    """Seconds of each of ``repeat`` runs of ``fn``, after one warm-up run."""
    times = []
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times[1:]


def to_null(encoder, gzip: bool) -> None:
    if gzip:
        with gzip_writer(Null(), None) as gz:
            encoder.write(gz, reuse=True)
    else:
        encoder.write(Null(), reuse=True)


def proc_cost(pid: int) -> tuple[float, float, float, bool]:
    """(CPU seconds, peak RSS MiB, RSS MiB, libtorch mapped) of process ``pid``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    status = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            status[key] = value.strip()
    with open(f"/proc/{pid}/maps") as f:
        torch_mapped = "libtorch" in f.read()
    return (cpu, int(status["VmHWM"].split()[0]) / 1024, int(status["VmRSS"].split()[0]) / 1024,
            torch_mapped)


def start_section(starts: int, directory: str) -> None:
    print(f"{'start':>6} {'cpu_s':>7} {'peak_MiB':>9} {'rss_MiB':>8} {'torch':>6} {'wall_s':>7}")
    for i in range(starts):
        t0 = time.perf_counter()
        with snapsvc.SnapshotWriter(directory) as w:
            w.submit(torch.nn.Linear(8, 8), f"start{i}.fdl").result(timeout=300)
            wall = time.perf_counter() - t0
            cpu, peak, rss, mapped = proc_cost(w.pid)
        print(f"{i:>6} {cpu:>7.2f} {peak:>9.1f} {rss:>8.1f} {str(mapped):>6} {wall:>7.2f}")


def write_section(mib: int, small: int, repeat: int, directory: str) -> None:
    big = torch.empty(mib << 18, dtype=torch.float32)  # mib MiB
    params = [("big", big)] + [(f"s{i}", torch.empty(256)) for i in range(small)]
    buffers = [(f"n{i}", torch.empty(4, dtype=torch.int64)) for i in range(8)]
    buffers.append(("mask", torch.empty(1000, dtype=torch.bool)))
    layout = Layout.of(params, buffers, "")
    data_bytes = sum(s.nbytes for s in layout.specs)
    memory = mmap.mmap(-1, layout.nbytes)
    for at in range(0, layout.nbytes, 64 << 20):  # random bytes; the bool tensor's: 0 or 1
        n = min(64 << 20, layout.nbytes - at)
        memory[at:at + n] = os.urandom(n)
    mask = next(s for s in layout.specs if s.name == "mask")
    memory[mask.offset:mask.offset + mask.nbytes] = bytes(mask.nbytes)
    del big, params, buffers
    files = writes.Files(None, None)
    enc = files.encoders(layout.to_msg(), memory)
    assert not isinstance(enc, str), enc
    smalls = Layout.from_specs((sp for sp in layout.specs if sp.name.startswith("s")),
                               layout.nbytes, "")
    small = files.encoders(smalls.to_msg(), memory)
    small_bytes = sum(sp.nbytes for sp in smalls.specs)
    print(f"{data_bytes / 1e6:.0f} MB of tensor data, {len(layout.specs)} entries; "
          f"small: {small_bytes / 1e6:.0f} MB, {len(smalls.specs)} entries")
    print(f"{'file':>8} {'to':>8} {'best_MB/s':>10} {'median_MB/s':>12}")

    def show(name: str, to: str, nbytes: int, times: list[float]) -> None:
        print(f"{name:>8} {to:>8} {nbytes / min(times) / 1e6:>10.0f} "
              f"{nbytes / statistics.median(times) / 1e6:>12.0f}")

    for name in ("w.fdl", "w.fdl.gz"):
        path = os.path.join(directory, name)
        gzip = name.endswith(".gz")
        show(name, "durable", data_bytes,
             timed(lambda: write_with_meta(path, enc.model, Meta(), data=enc.data), repeat))
        show(name, "null", data_bytes, timed(lambda: to_null(enc.model, gzip), repeat))
        show(name, "small", small_bytes, timed(lambda: to_null(small.model, gzip), repeat))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--starts", type=int, default=3)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--small", type=int, default=10000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--sections", nargs="+", default=["start", "write"])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        print(f"snapsvc from {os.path.dirname(snapsvc.__file__)}")
        if "start" in args.sections:
            start_section(args.starts, directory)
        if "write" in args.sections:
            write_section(args.mib, args.small, args.repeat, directory)


if __name__ == "__main__":
    main()

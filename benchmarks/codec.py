"""Codec benchmark: snapsvc ``.fdl`` against torch.save, restore, and a gzip level table.

    python benchmarks/codec.py [--mib 256] [--repeat 3] [--restore-repeat 9]
        [--sections files restore levels] [--compare-with DIR] [--device cuda]
        [--threads N] [--dir DIR] [--json out.json] [--nested-mib 64]

One run, one set of tensors (16 MiB float32 normal matrices totalling --mib
MiB, plus a few small bias/BatchNorm tensors), measured side by side:

* files: snapsvc.save_checkpoint / read_checkpoint, plain ``.fdl`` and
  ``.fdl.gz`` at the default isal level, against torch.save /
  torch.load(weights_only=True). Every save ends with an fsync: snapsvc's
  atomic write fsyncs the temp file, renames it and fsyncs the directory;
  torch.save writes into a file opened here, then flush and fsync (no
  rename). Every load reads the file just written, so it comes from a warm
  page cache (caches are not dropped): loads measure decoding, not the disk.
* restore: ``snapsvc.restore`` of a checkpoint written by the sidecar (the
  file's size and CRC-32 checked against its metadata, then copied into the
  model) against ``model.load_state_dict(torch.load(weights_only=True))``
  and two raw reads of the same ``.fdl`` file: ``readinto`` into a fresh
  ``torch.empty`` (what any reader of the file pays, page faults included)
  and into one buffer allocated and touched before the rounds (the copy out
  of the page cache alone: the floor of any read).
  With ``--nested-mib`` (default 64), also a nested state ``{"model",
  "opt"}`` with AdamW after one step (its file three times the weights):
  ``snapsvc.restore`` into the live state against ``torch.load`` +
  ``load_state_dict`` of both and a raw ``readinto`` of its ``.fdl``.
  The goal lines of issue 34 follow the table, each with its ratio from
  this run. The model and the page cache are warm. The operations run round-robin,
  --restore-repeat rounds after one warm-up round, so drifting load on a
  shared machine hits them alike; the table gives medians and ratios.
  ``--compare-with DIR`` also times ``restore`` of the snapsvc package in
  DIR (e.g. an export of an older commit) in the same rounds. ``--device
  cuda`` restores into a model on the GPU (through pinned memory; torch's
  load_state_dict copies from pageable memory); raw reads stay host reads.
* gzip levels, in memory: isal levels 0-3 (isal.igzip.compress, the deflate
  engine behind snapsvc.format.streams.gzip_writer) and Python's zlib at level 6,
  both producing gzip, on the float32 data of the tensors above and on an
  int64 small-integer buffer and a zero-filled buffer of the same size.

MB/s is 10^6 bytes of uncompressed tensor data per second, from the median
and from the fastest (min-time) of --repeat runs, after one untimed warm-up
run of each operation. On glibc, allocations of 1 MiB and more are made fresh
mmaps (see ``fresh_allocations``), so every run, whichever ran before it,
pays the page faults a new process pays to fill its tensors. ratio is
compressed or file size over tensor data size.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import isal
import torch
from isal import igzip
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout
import snapsvc  # noqa: E402
from snapsvc.format.fdl import _byte_view  # noqa: E402
from snapsvc.format.streams import DEFAULT_GZIP_LEVEL  # noqa: E402

T = TypeVar("T")
Tensors = dict[str, torch.Tensor]

BIG_MIB = 16
SIDE = 2048  # a 2048 x 2048 float32 matrix is 16 MiB
ISAL_LEVELS = (0, 1, 2, 3)
SECTIONS = ("files", "restore", "levels")
ZLIB_LEVEL = 6


@dataclass
class Stat:
    """Timings of one operation over all repeats."""

    runs_s: list[float]
    median_s: float
    min_s: float
    mbps_median: float
    mbps_best: float


@dataclass
class FileRow:
    op: str
    file_bytes: int
    ratio: float
    time: Stat


@dataclass
class RestoreRow:
    op: str
    time: Stat
    cpu_s: list[float]       # process CPU seconds (user + system, all threads) of each run
    cpu_median_s: float
    vs_raw: float            # median over the median of a raw readinto (fresh buffer)
    vs_raw_reused: float     # ... of a raw readinto into a buffer touched beforehand
    vs_torch: float          # ... of torch.load(weights_only=True) + load_state_dict
    cpu_vs_raw: float        # the same ratios of median CPU seconds
    cpu_vs_torch: float


@dataclass
class CodecRow:
    data: str
    codec: str
    ratio: float
    compress: Stat
    decompress: Stat


def stat(nbytes: int, runs: list[float]) -> Stat:
    med, best = statistics.median(runs), min(runs)
    return Stat(runs, med, best, nbytes / med / 1e6, nbytes / best / 1e6)


def timed(fn: Callable[[], T], repeat: int,
          before: Callable[[], None] | None = None) -> tuple[list[float], T]:
    """Run ``fn`` once untimed, then ``repeat`` times; return the durations and the last result."""
    def once() -> tuple[float, T]:
        if before is not None:
            before()
        t0 = time.perf_counter()
        result = fn()
        return time.perf_counter() - t0, result

    _, result = once()
    runs: list[float] = []
    for _ in range(repeat):
        del result  # free the previous result before the next run
        elapsed, result = once()
        runs.append(elapsed)
    return runs, result


def fresh_allocations() -> bool:
    """Make glibc serve every allocation of 1 MiB or more with a fresh mmap.

    By default glibc keeps large freed blocks for reuse once some have been
    freed, so a load timed after other work skips the first-touch page faults
    (about half of a warm-cache load here) and one timed first does not. A
    fixed threshold makes every run pay them. False where glibc is absent.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_mmap_threshold = -3  # from glibc's malloc.h
    return bool(libc.mallopt(m_mmap_threshold, 1 << 20))


def make_tensors(mib: int) -> Tensors:
    """Float32 normal matrices totalling ``mib`` MiB, then small bias-like tensors."""
    gen = torch.Generator().manual_seed(0)
    tensors: Tensors = {}
    for i in range(mib // BIG_MIB):
        tensors[f"layer{i}.weight"] = torch.randn(SIDE, SIDE, generator=gen)
    if mib % BIG_MIB:
        rows = (mib % BIG_MIB) * (1 << 20) // (4 * SIDE)
        tensors["tail.weight"] = torch.randn(rows, SIDE, generator=gen)
    for i in range(4):
        tensors[f"layer{i}.bias"] = 0.01 * torch.randn(SIDE, generator=gen)
    tensors["bn.running_mean"] = torch.zeros(SIDE)
    tensors["bn.running_var"] = torch.ones(SIDE)
    tensors["bn.num_batches_tracked"] = torch.tensor(0, dtype=torch.int64)
    return tensors


def data_bytes(tensors: Tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def check_same(what: str, got: Tensors, want: Tensors) -> None:
    if list(got) != list(want) or not all(torch.equal(got[k], v) for k, v in want.items()):
        raise SystemExit(f"{what}: the data read back differs from the data written")


def torch_save_fsync(tensors: Tensors, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(tensors, f)
        f.flush()
        os.fsync(f.fileno())


def bench_files(tensors: Tensors, directory: Path, repeat: int) -> list[FileRow]:
    nbytes = data_bytes(tensors)
    rows: list[FileRow] = []

    def row(op: str, path: Path, runs: list[float]) -> None:
        size = path.stat().st_size
        rows.append(FileRow(op, size, size / nbytes, stat(nbytes, runs)))

    def fdl(path: Path, label: str) -> None:
        runs, _ = timed(lambda: snapsvc.save_checkpoint(path, tensors), repeat,
                        before=lambda: path.unlink(missing_ok=True))
        row(f"snapsvc save {label}", path, runs)
        runs, ckpt = timed(lambda: snapsvc.read_checkpoint(path), repeat)
        check_same(f"read_checkpoint({path.name})", ckpt.entries, tensors)
        row(f"snapsvc load {label}", path, runs)

    fdl(directory / "ckpt.fdl", ".fdl")
    fdl(directory / "ckpt.fdl.gz", f".fdl.gz (isal {DEFAULT_GZIP_LEVEL})")
    path = directory / "ckpt.pt"
    runs, _ = timed(lambda: torch_save_fsync(tensors, path), repeat,
                    before=lambda: path.unlink(missing_ok=True))
    row("torch.save + fsync", path, runs)
    runs, loaded = timed(lambda: torch.load(path, weights_only=True), repeat)
    check_same("torch.load", loaded, tensors)
    row("torch.load weights_only", path, runs)
    return rows


def make_model(tensors: Tensors) -> nn.Module:
    """A module holding copies of ``tensors`` under the same names: BatchNorm
    statistics as buffers, the rest as parameters."""
    model = nn.Module()
    for name, t in tensors.items():
        owner, leaf = name.split(".")
        if not hasattr(model, owner):
            model.add_module(owner, nn.Module())
        sub = getattr(model, owner)
        if owner == "bn":
            sub.register_buffer(leaf, t.clone())
        else:
            sub.register_parameter(leaf, nn.Parameter(t.clone()))
    return model


def load_baseline(directory: Path) -> ModuleType:
    """The snapsvc package in ``directory``, imported as ``snapsvc_baseline``."""
    init = directory / "snapsvc" / "__init__.py"
    spec = importlib.util.spec_from_file_location(
        "snapsvc_baseline", init, submodule_search_locations=[str(init.parent)])
    if spec is None or spec.loader is None:
        raise SystemExit(f"--compare-with: no snapsvc package in {directory}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def rounds(ops: dict[str, Callable[[], object]], repeat: int
           ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """One untimed warm-up round, then ``repeat`` rounds of every op in turn:
    (wall seconds, process CPU seconds) of each op's runs. CPU time shows what
    an op costs even when other processes share the cores (wall time then
    includes waiting for one)."""
    wall: dict[str, list[float]] = {name: [] for name in ops}
    cpu: dict[str, list[float]] = {name: [] for name in ops}
    for r in range(repeat + 1):
        for name, fn in ops.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            if r:
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
    return wall, cpu


def read_whole(path: Path, view: memoryview) -> None:
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < len(view):
            n = f.readinto(view[done:])
            if not n:
                raise SystemExit(f"{path} is shorter than it was")
            done += n


def raw_fresh(path: Path) -> None:
    buf = torch.empty(path.stat().st_size, dtype=torch.uint8)
    read_whole(path, _byte_view(buf))


def raw_reused(path: Path, buf: torch.Tensor) -> None:
    read_whole(path, _byte_view(buf))


def synced(fn: Callable[[], object], device: str) -> None:
    fn()
    torch.cuda.synchronize(device)


NESTED = "nested state"  # in an op's name: the {model, AdamW} state, measured against its own


def nested_state(mib: int, directory: Path, device: str
                 ) -> tuple[dict[str, Any], Path, Path, dict[str, Any]]:
    """A ``{"model", "opt"}`` state of ``mib`` MiB of weights and AdamW after one
    step (twice that again), written by the sidecar and by torch.save: (the live
    state, its .fdl, its .pt, the saved values to check a restore against)."""
    model = make_model(make_tensors(mib)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    state = {"model": model, "opt": opt}
    with snapsvc.SnapshotWriter(directory) as w:
        w.submit(state, "nested.fdl").result(timeout=600)
    pt = directory / "nested.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, pt)
    want = {f"opt.{i}.{k}": v.clone() for i, s in opt.state_dict()["state"].items()
            for k, v in s.items()}
    want.update((f"model.{k}", v.clone()) for k, v in model.state_dict().items())
    with torch.no_grad():  # so that every restore has something to change
        for p in model.parameters():
            p.zero_()
    return state, directory / "nested.fdl", pt, want


def nested_values(state: dict[str, Any]) -> Tensors:
    got = {f"opt.{i}.{k}": v.cpu() for i, s in state["opt"].state_dict()["state"].items()
           for k, v in s.items()}
    got.update((f"model.{k}", v.cpu()) for k, v in state["model"].state_dict().items())
    return got


def torch_nested(state: dict[str, Any], pt: Path) -> None:
    sd = torch.load(pt, weights_only=True)
    state["model"].load_state_dict(sd["model"])
    state["opt"].load_state_dict(sd["opt"])


def bench_restore(tensors: Tensors, directory: Path, repeat: int,
                  baseline: ModuleType | None, device: str,
                  nested_mib: int = 0) -> list[RestoreRow]:
    model = make_model(tensors).to(device)
    with snapsvc.SnapshotWriter(directory) as w:
        w.submit(model, "r.fdl").result(timeout=600)
        w.submit(model, "r.fdl.gz").result(timeout=600)
    pt = directory / "r.pt"
    torch.save(model.state_dict(), pt)
    fdl, gz = directory / "r.fdl", directory / "r.fdl.gz"
    reused = torch.ones(fdl.stat().st_size, dtype=torch.uint8)  # every page touched
    with torch.no_grad():  # so that every restore below has something to undo
        for p in model.parameters():
            p.zero_()

    ops: dict[str, Callable[[], object]] = {
        "raw readinto, fresh buffer": lambda: raw_fresh(fdl),
        "raw readinto, reused buffer": lambda: raw_reused(fdl, reused),
        "torch.load + load_state_dict": lambda: model.load_state_dict(
            torch.load(pt, weights_only=True)),
        "snapsvc.restore .fdl": lambda: snapsvc.restore(fdl, model),
    }
    if baseline is not None:
        ops["baseline restore .fdl"] = lambda: baseline.restore(fdl, model)
    ops["snapsvc.restore .fdl.gz"] = lambda: snapsvc.restore(gz, model)
    if nested_mib:
        state, nfdl, npt, want = nested_state(nested_mib, directory, device)
        nreused = torch.ones(nfdl.stat().st_size, dtype=torch.uint8)
        ops[f"raw readinto, reused, {NESTED}"] = lambda: raw_reused(nfdl, nreused)
        ops[f"torch.load + load_sd, {NESTED}"] = lambda: torch_nested(state, npt)
        if baseline is not None:
            ops[f"baseline restore {NESTED}"] = lambda: baseline.restore(nfdl, state)
        ops[f"snapsvc.restore {NESTED}"] = lambda: snapsvc.restore(nfdl, state)
    if device != "cpu":  # each op ends when its copies to the device have
        ops = {name: partial(synced, fn, device) for name, fn in ops.items()}
    times, cpu = rounds(ops, repeat)
    check_same("restore", {k: v.cpu() for k, v in sorted(model.state_dict().items())},
               dict(sorted(tensors.items())))
    if nested_mib:  # the last op of each round was snapsvc's restore
        check_same("nested restore", dict(sorted(nested_values(state).items())),
                   dict(sorted(want.items())))

    nbytes = fdl.stat().st_size
    med = {name: statistics.median(runs) for name, runs in times.items()}
    cmed = {name: statistics.median(runs) for name, runs in cpu.items()}
    raw, pop, ref = ("raw readinto, fresh buffer", "raw readinto, reused buffer",
                     "torch.load + load_state_dict")
    rows = []
    for name, runs in times.items():
        # the nested rows against the nested raw read and torch's nested load
        r, p, t = ((raw, f"raw readinto, reused, {NESTED}", f"torch.load + load_sd, {NESTED}")
                   if NESTED in name else (raw, pop, ref))
        rows.append(RestoreRow(name, stat(nbytes, runs), cpu[name], cmed[name],
                               med[name] / med[r], med[name] / med[p], med[name] / med[t],
                               cmed[name] / cmed[r], cmed[name] / cmed[t]))
    return rows


def bench_codec(data_name: str, data: memoryview, codec: str,
                compress: Callable[[memoryview], bytes],
                decompress: Callable[[bytes], bytes], repeat: int) -> CodecRow:
    c_runs, packed = timed(lambda: compress(data), repeat)
    d_runs, unpacked = timed(lambda: decompress(packed), repeat)
    if unpacked != data:
        raise SystemExit(f"{codec} on {data_name}: round trip differs")
    n = len(data)
    return CodecRow(data_name, codec, len(packed) / n, stat(n, c_runs), stat(n, d_runs))


def bench_levels(tensors: Tensors, repeat: int) -> list[CodecRow]:
    floats = torch.cat([t.flatten() for t in tensors.values() if t.dtype == torch.float32])
    n = floats.numel()
    gen = torch.Generator().manual_seed(1)
    buffers = {
        "float32 randn": floats,
        "int64 0..65535": torch.randint(0, 1 << 16, (n // 2,), dtype=torch.int64, generator=gen),
        "zeros": torch.zeros(n, dtype=torch.float32),
    }
    codecs: list[tuple[str, Callable[[memoryview], bytes], Callable[[bytes], bytes]]] = [
        (f"isal {level}", partial(igzip.compress, compresslevel=level, mtime=0),
         igzip.decompress)
        for level in ISAL_LEVELS
    ]
    codecs.append((f"zlib {ZLIB_LEVEL}", partial(zlib.compress, level=ZLIB_LEVEL, wbits=31),
                   partial(zlib.decompress, wbits=31)))
    return [bench_codec(name, _byte_view(t), codec, comp, decomp, repeat)
            for name, t in buffers.items() for codec, comp, decomp in codecs]


# issue 34: a verified restore within 1.25x the copy out of the page cache
# alone, and at most half of torch.load + load_state_dict
GOALS = (("x reuse", "vs_raw_reused", 1.25), ("x torch", "vs_torch", 0.5))


def restore_goals(restores: list[RestoreRow]) -> list[str]:
    """The goal lines of the plain ``.fdl`` restore and the nested state's (against
    its own raw read and torch load), each with its ratio from this run."""
    lines = ["goals (medians of this run; the nested state, whose AdamW state a restore must "
             "make anew, against torch.load + load_state_dict of the same state):"]
    for op, goals in (("snapsvc.restore .fdl", GOALS), (f"snapsvc.restore {NESTED}", GOALS[1:])):
        row = next((r for r in restores if r.op == op), None)
        for label, attr, limit in goals if row is not None else ():
            value = getattr(row, attr)
            lines.append(f"  {op} {label}: {value:.2f} (target <= {limit}) "
                         f"{'PASS' if value <= limit else 'FAIL'}")
    return lines if len(lines) > 1 else []


def print_tables(files: list[FileRow], restores: list[RestoreRow], codecs: list[CodecRow],
                 header: list[str]) -> None:
    print("\n".join(header))
    if files:
        print("\nfiles (saves include fsync; loads read the file just written: warm page cache)")
        print(f"{'op':<30} {'file MB':>9} {'ratio':>6} {'med s':>7} {'min s':>7}"
              f" {'MB/s med':>9} {'MB/s best':>9}")
        for r in files:
            t = r.time
            print(f"{r.op:<30} {r.file_bytes / 1e6:>9.1f} {r.ratio:>6.3f} {t.median_s:>7.3f}"
                  f" {t.min_s:>7.3f} {t.mbps_median:>9.0f} {t.mbps_best:>9.0f}")
    if restores:
        runs = len(restores[0].time.runs_s)
        print(f"\nrestore into a warm model, warm page cache ({runs} rounds, medians; x = over "
              "raw fresh, raw reused, torch; cpu = process CPU time)")
        print(f"{'op':<36} {'wall ms':>7} {'min ms':>7} {'cpu ms':>7}"
              f" {'x raw':>6} {'x reuse':>7} {'x torch':>7} {'cpu x raw':>9} {'cpu x torch':>11}")
        for r in restores:
            t = r.time
            print(f"{r.op:<36} {t.median_s * 1e3:>7.1f} {t.min_s * 1e3:>7.1f}"
                  f" {r.cpu_median_s * 1e3:>7.1f} {r.vs_raw:>6.2f} {r.vs_raw_reused:>7.2f}"
                  f" {r.vs_torch:>7.2f} {r.cpu_vs_raw:>9.2f} {r.cpu_vs_torch:>11.2f}")
        print("\n".join(restore_goals(restores)))
    if not codecs:
        return
    print("\ngzip levels in memory (MB/s of uncompressed data)")
    print(f"{'data':<15} {'codec':<7} {'ratio':>6} {'comp med':>9} {'comp best':>9}"
          f" {'dec med':>9} {'dec best':>9}")
    for c in codecs:
        print(f"{c.data:<15} {c.codec:<7} {c.ratio:>6.3f} {c.compress.mbps_median:>9.0f}"
              f" {c.compress.mbps_best:>9.0f} {c.decompress.mbps_median:>9.0f}"
              f" {c.decompress.mbps_best:>9.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="MiB of float32 weights (default 256)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement (default 3)")
    ap.add_argument("--dir", type=Path, default=Path.cwd(),
                    help="where the temporary directory goes (default: the current directory)")
    ap.add_argument("--restore-repeat", type=int, default=9,
                    help="rounds of the restore comparison (default 9)")
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                    help="what to run (default: all)")
    ap.add_argument("--compare-with", type=Path, metavar="DIR",
                    help="also time restore of the snapsvc package in DIR, in the same rounds")
    ap.add_argument("--device", default="cpu",
                    help="where the restored model lives, e.g. cuda (default cpu): restore "
                         "then reads through pinned memory")
    ap.add_argument("--threads", type=int,
                    help="torch.set_num_threads before measuring (default: torch's choice)")
    ap.add_argument("--json", type=Path, help="also write the results here as JSON")
    ap.add_argument("--nested-mib", type=int, default=64,
                    help="MiB of weights of the nested {model, AdamW} restore rows (AdamW's "
                         "state adds twice that; 0: none; default 64)")
    args = ap.parse_args()
    if args.mib < 1 or args.repeat < 1 or args.restore_repeat < 1:
        ap.error("--mib, --repeat and --restore-repeat must be at least 1")
    baseline = load_baseline(args.compare_with) if args.compare_with else None
    if args.threads:
        torch.set_num_threads(args.threads)

    fresh = fresh_allocations()
    tensors = make_tensors(args.mib)
    load_before = os.getloadavg()[0]
    files: list[FileRow] = []
    restores: list[RestoreRow] = []
    with tempfile.TemporaryDirectory(prefix="snapsvc-bench-", dir=args.dir) as tmp:
        if "files" in args.sections:
            files = bench_files(tensors, Path(tmp), args.repeat)
        if "restore" in args.sections:
            restores = bench_restore(tensors, Path(tmp), args.restore_repeat, baseline,
                                     args.device, args.nested_mib)
    codecs = bench_levels(tensors, args.repeat) if "levels" in args.sections else []
    header = [
        f"snapsvc codec benchmark: {len(tensors)} tensors, "
        f"{data_bytes(tensors) / 1e6:.1f} MB of data, {args.repeat} runs each",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}, "
        f"torch threads {torch.get_num_threads()}, restore into a model on {args.device}"
        + (f", baseline: snapsvc from {args.compare_with.resolve()}" if baseline else ""),
        f"python {platform.python_version()}, torch {torch.__version__}, isal {isal.__version__}, "
        f"{os.cpu_count()} CPUs, load average {load_before:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after, files under {args.dir.resolve()}",
        "MB/s = 10^6 bytes of uncompressed tensor data per second; "
        "med = median run, best = fastest run, after 1 untimed warm-up run",
        "large allocations: " + ("fresh mmap each run (page faults included)" if fresh
                                 else "allocator default (glibc not found)"),
    ]
    print_tables(files, restores, codecs, header)
    if args.json:
        report = {"mib": args.mib, "repeat": args.repeat, "header": header,
                  "files": [asdict(r) for r in files], "restore": [asdict(r) for r in restores],
                  "codecs": [asdict(c) for c in codecs]}
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

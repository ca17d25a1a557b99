"""How long a checkpoint holds up training: snapsvc next to its peers, in one run.

Methods (same models, same disk, same run):

  torch.save          synchronous torch.save + fsync
  thread-async        clone to CPU on the caller, torch.save in a thread (Lightning-like)
  dcp-process         torch.distributed.checkpoint.async_save, PROCESS checkpointer,
                      reused DefaultStager on shared memory, world size 1 on gloo
  torchsnapshot       torchsnapshot.Snapshot.async_take (+ fsync of its files); optional,
                      skipped with a note unless ``pip install torchsnapshot==0.1.0``
  snapsvc-block       SnapshotWriter.submit, blocking staging
  snapsvc-overlap     SnapshotWriter(overlap=True) + guard(optimizer)
  snapsvc-incremental SnapshotWriter(incremental=True): re-copies only changed tensors;
                      skipped with a note where SnapshotWriter has no ``incremental``

For every (model, method) a fresh worker process (so peak RSS is its own) does:

* warm-up: one untimed raw copy, and for snapsvc as many untimed saves as it
  has slots (2), so every destination page (raw buffer, each slot) is faulted
  in before timing (DCP and torchsnapshot warm up in their own setup);
* timed reps, each of a RAW COPY and a SAVE, in alternating order (raw first
  on odd reps, save first on even ones). Before each of the two the same
  "optimizer step" runs (an in-place add on every trainable tensor), so both
  start from the same cache state: the trainable tensors just written, the
  frozen ones untouched. The raw copy is one ``torch._foreach_copy_`` of the
  same tensors into ONE preallocated shared-memory buffer laid out like a
  slot (pinned memory on CUDA): the floor any staging pays. Stall is save()'s
  time; the write is awaited outside it. Reps stop at ``--reps`` or once
  ``--budget-s`` is spent (at least ``--min-reps``);
* snapsvc-block also times a RAW WRITE after each durable save: the raw
  buffer's bytes written to a new file in the same directory with plain
  os.write and one fsync (the writer's floor); every snapsvc method reads
  its sidecar's CPU time from /proc (seconds per GiB written);
* CPU s/GiB: CPU time of this process and all its descendants (threads,
  DCP's checkpoint process, snapsvc's sidecar) from just before each save
  to its durability, per GiB of model;
* the time added per checkpoint to a synthetic training loop (fixed compute
  plus an SGD update of the trainable tensors, a checkpoint every
  ``--every`` steps) against the same loop without checkpoints, A B A B,
  medians; skipped where one durable write takes longer than the loop's
  whole checkpoint interval budget (it would only measure the disk);
* peak RSS of the worker and of its children.

A last worker measures the writer alone on ``--writer-model``: raw write +
fsync against snapsvc's durable ``.fdl`` and ``.fdl.gz`` (isal, single
member), and in-memory compression MB/s of isal and zlib level 6.

Sidecar start: ``SnapshotWriter.start()`` until the sidecar's READY, median
of ``--start-reps``, in a worker that imported nothing more and in one whose
``__main__`` first imported ``--start-import`` (as a training script's top
level would; the sidecar must not pay for it), beside a bare
``python -c "import torch"`` (what the sidecar would cost if it imported
torch before READY).

    python benchmarks/stall.py                      # the default models, every method
    python benchmarks/stall.py --models 64M small --reps 20 --json out.json --plot out.png
    python benchmarks/stall.py --device cuda --dtype bfloat16 --models 1G   # on a GPU
    python benchmarks/stall.py --profile    # the demo's small submit, microsecond by microsecond

Models: ``<N>M`` / ``<N>G`` are N MiB / GiB of 16 MiB tensors; ``<count>x<size>``
is count tensors of size bytes (``K``/``M`` suffixes: ``64x4M``); ``tiny`` is
20000x256, ``small`` 4096x32K (``small:<count>`` sets the count); ``frozen`` is
256 MiB as 64 x 4 MiB of which 61 (95.3 % of the bytes) are frozen
(``requires_grad=False``, never written between checkpoints).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from typing import Any, Callable

import torch
from isal import isal_zlib
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402
import snapsvc  # noqa: E402
from snapsvc.engine import staging  # noqa: E402
from snapsvc.format.layout import Layout  # noqa: E402
from snapsvc.files.checkpoint import write_checkpoint_file  # noqa: E402
from snapsvc.format.fdl import _byte_view  # noqa: E402
from snapsvc.engine.snapshot import model_sources  # noqa: E402
from snapsvc.format.streams import DEFAULT_GZIP_LEVEL  # noqa: E402

METHODS = ["torch.save", "thread-async", "dcp-process", "torchsnapshot", "snapsvc-block",
           "snapsvc-overlap", "snapsvc-incremental"]
DEFAULT_MODELS = ["tiny", "small", "64x4M", "frozen"]
ALIASES = {"tiny": "20000x256", "small": "4096x32K", "frozen": "64x4M"}
_LARGE = 16 << 20
_FROZEN_SHARE = 0.95
_SLOTS = 2


class Skip(Exception):
    """This method cannot run here; the message says why (shown in the table)."""


# -- models and the training loop ------------------------------------------------
def _size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    return int(text[:-1] if mult > 1 else text) * mult


def model_sizes(spec: str) -> list[int]:
    """Tensor sizes in bytes of the named model."""
    if spec.startswith("small:"):
        return [32 << 10] * int(spec.split(":")[1])
    spec = ALIASES.get(spec, spec)
    if "x" in spec:
        count, size = spec.split("x")
        return [_size(size)] * int(count)
    total = _size(spec)
    return [_LARGE] * (total // _LARGE) + ([total % _LARGE] if total % _LARGE else [])


def build_model(spec: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """A module of the named shape, filled with random data (``frozen``: mostly frozen)."""
    item = torch.empty((), dtype=dtype).element_size()
    sizes = model_sizes(spec)
    n_frozen = len(sizes) - max(1, round(len(sizes) * (1 - _FROZEN_SHARE))) if spec == "frozen" else 0
    torch.manual_seed(0)
    m = nn.Module()
    for i, n in enumerate(sizes):
        m.register_parameter(f"p{i}", nn.Parameter(torch.randn(n // item, dtype=dtype, device=device),
                                                   requires_grad=i >= n_frozen))
    return m


def model_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def trainable(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


class Loop:
    """A training step: fixed compute, then an SGD update of every trainable parameter.

    ``compute="sleep"`` (default) waits ``ms`` as a host thread waits for its
    GPU, leaving the CPU to whoever can use it: the picture of GPU training
    on a CPU-only box. ``compute="matmul"`` burns the CPU instead (``work``
    matmuls), so every CPU cycle a method spends in the background is taken
    from training.
    """

    def __init__(self, model: nn.Module, compute: str, ms: float, work: int,
                 device: str) -> None:
        params = trainable(model)
        for p in params:
            p.grad = torch.full_like(p, 1e-6)
        self.opt = torch.optim.SGD(params, lr=1.0)
        self.a = torch.randn(256, 256, device=device)
        self.compute, self.ms, self.work, self.device = compute, ms, work, device

    def step(self) -> None:
        if self.compute == "sleep":
            time.sleep(self.ms / 1e3)
        else:
            x = self.a
            for _ in range(self.work):
                x = torch.tanh(x @ self.a)
        self.opt.step()
        if self.device == "cuda":
            torch.cuda.synchronize()


def calibrate(ms: float) -> int:
    """Matmuls per step that take about ``ms`` on this machine, idle."""
    a = torch.randn(256, 256)
    t0 = time.perf_counter()
    for _ in range(50):
        a = torch.tanh(a @ a)
    per = (time.perf_counter() - t0) / 50
    return max(1, round(ms / 1e3 / per))


# -- CPU time from /proc ---------------------------------------------------------------
_TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pid: int) -> float:
    """User + system seconds of process ``pid`` (all its threads); 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def tree_cpu() -> float:
    """CPU seconds of this process (every thread) and of its live descendants."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime + sum(proc_cpu(p) for p in _descendants(os.getpid()))


# -- snapsvc as a method -------------------------------------------------------------
class Snapsvc:
    """snapsvc behind the peers' interface (benchmarks/peers.py)."""

    def __init__(self, mode: str) -> None:
        self.name = f"snapsvc-{mode}"
        self.mode = mode
        self.writer: snapsvc.SnapshotWriter | None = None
        self.handle: snapsvc.WriteHandle | None = None

    def setup(self, model: nn.Module, directory: str) -> None:
        kw: dict[str, Any] = {"overlap": self.mode == "overlap"}
        if self.mode == "incremental":
            if "incremental" not in inspect.signature(snapsvc.SnapshotWriter).parameters:
                raise Skip("this SnapshotWriter has no incremental= parameter yet")
            kw["incremental"] = True
        self.writer = snapsvc.SnapshotWriter(directory, slots=_SLOTS, keep_last=2, **kw).start()

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        assert self.writer is not None
        self.writer.guard(optimizer)

    def save(self, model: nn.Module, step: int) -> None:
        assert self.writer is not None
        self.handle = self.writer.submit(model, f"snap{step % 3}.fdl")

    def wait_durable(self) -> float:
        assert self.handle is not None
        return self.handle.result(timeout=600).total_s

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def make_method(name: str) -> Any:
    if name.startswith("snapsvc-"):
        return Snapsvc(name.removeprefix("snapsvc-"))
    if name == "torchsnapshot":
        if importlib.util.find_spec("torchsnapshot") is None:
            raise Skip(f"torchsnapshot is not installed (pip install {peers.TORCHSNAPSHOT_PIN})")
        return peers.TorchSnapshotAsync()
    for m in peers.peer_methods():
        if m.name == name:
            return m
    raise SystemExit(f"unknown method {name!r}; choose from {METHODS}")


# -- the floors ------------------------------------------------------------------------
def raw_copy_fn(model: nn.Module) -> tuple[Callable[[], None], torch.Tensor | None]:
    """The staging floor: one fused copy into ONE preallocated shared-memory
    buffer laid out like a slot (pinned memory on CUDA). Returns the copy and
    the flat CPU buffer (None on CUDA)."""
    params, buffers = model_sources(model)
    src = [t for _, t in params + buffers]
    if src[0].is_cuda:
        dst = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in src]

        def copy() -> None:
            torch._foreach_copy_(dst, src, non_blocking=True)
            torch.cuda.synchronize()
        return copy, None
    layout = Layout.of(params, buffers, "")
    flat = staging.allocate(layout)
    views = staging.views(flat, layout)
    return (lambda: torch._foreach_copy_(views, src)), flat


def raw_write(flat: torch.Tensor, directory: str) -> float:
    """The writer's floor: ``flat``'s bytes to a new file, plain os.write + fsync.

    Returns the seconds from open to fsync done; the file is then removed."""
    path = os.path.join(directory, "raw-write.bin")
    view = _byte_view(flat)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:done + (1 << 30)])
        os.fsync(fd)
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - t0
    os.unlink(path)
    return elapsed


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# -- one worker: one (model, method) -------------------------------------------------
def worker(args: argparse.Namespace) -> dict[str, Any]:
    if args.method == "writer":
        return writer_worker(args)
    if args.method == "start":
        return start_worker(args)
    row: dict[str, Any] = {"model": args.model, "method": args.method}
    try:
        method = make_method(args.method)
    except Skip as e:
        return {**row, "skipped": str(e)}
    dtype = getattr(torch, args.dtype)
    model = build_model(args.model, args.device, dtype)
    nbytes = model_bytes(model)
    train = trainable(model)

    @torch.no_grad()
    def step() -> None:  # what an optimizer step does to the cache and to _version
        torch._foreach_add_(train, 1e-3)

    with tempfile.TemporaryDirectory(dir=args.dir, prefix="snapsvc-stall-") as d:
        try:
            method.setup(model, d)
        except (Skip, ImportError) as e:
            return {**row, "skipped": str(e)}
        raw, flat = raw_copy_fn(model)
        raw()  # fault the raw buffer's pages in, as the warm-ups below do the slots'
        for i in range(_SLOTS if isinstance(method, Snapsvc) else 0):  # peers warm in setup
            step()
            method.save(model, 100 + i)
            method.wait_durable()
        sidecar = method.writer.pid if isinstance(method, Snapsvc) and method.writer else None
        writes = args.method == "snapsvc-block" and flat is not None
        stall, durable, raw_s, cpu, write_s = [], [], [], [], []
        sidecar_cpu = 0.0
        deadline = time.perf_counter() + args.budget_s
        for i in range(1, args.reps + 1):
            for op in (("raw", "save") if i % 2 else ("save", "raw")):
                step()
                if op == "raw":
                    t0 = time.perf_counter()
                    raw()
                    raw_s.append(time.perf_counter() - t0)
                    continue
                c0 = tree_cpu()
                s0 = proc_cpu(sidecar) if sidecar else 0.0
                t0 = time.perf_counter()
                method.save(model, i)
                stall.append(time.perf_counter() - t0)
                durable.append(method.wait_durable())
                cpu.append(tree_cpu() - c0)
                if sidecar:
                    sidecar_cpu += proc_cpu(sidecar) - s0
                if writes:  # part of the save op, so the raw copy's neighbours stay alike
                    write_s.append(raw_write(flat, d))
            if i >= args.min_reps and time.perf_counter() > deadline:
                break

        loop = Loop(model, args.compute, args.compute_ms, args.work, args.device)
        if hasattr(method, "attach"):
            method.attach(loop.opt)
        loop.step()

        def run_loop(checkpoints: bool) -> tuple[float, int]:
            # ``every`` extra steps after the last checkpoint: its background
            # cost lands inside the timed region, as in a run that goes on.
            n = 0
            t0 = time.perf_counter()
            for s in range(1, args.steps + args.every + 1):
                loop.step()
                if checkpoints and s % args.every == 0 and s <= args.steps:
                    method.save(model, 1000 + s)
                    n += 1
            elapsed = time.perf_counter() - t0
            if n:
                method.wait_durable()
            return elapsed, n

        # A loop whose checkpoints queue behind a write longer than the whole
        # loop measures only the disk, at many times the budget: skipped.
        loop_ckpts = args.steps // args.every
        if med(durable) * loop_ckpts * 2 <= args.budget_s:
            base, ckpt = [], []
            for _ in range(2):  # A B A B: drift on a shared machine hits both alike
                base.append(run_loop(False)[0])
                elapsed, n_ckpt = run_loop(True)
                ckpt.append(elapsed)
            row["added_per_ckpt_ms"] = 1e3 * (med(ckpt) - med(base)) / n_ckpt
            row["step_ms"] = 1e3 * med(base) / (args.steps + args.every)
        method.close()
    gib = nbytes / 2**30
    row.update({
        "MiB": nbytes / 2**20, "tensors": len(list(model.parameters())),
        "trainable_MiB": sum(p.numel() * p.element_size() for p in train) / 2**20,
        "reps": len(stall),
        "stall_p50_ms": 1e3 * med(stall), "stall_p99_ms": 1e3 * pct(stall, .99),
        "raw_p50_ms": 1e3 * med(raw_s), "raw_p99_ms": 1e3 * pct(raw_s, .99),
        "durable_p50_ms": 1e3 * med(durable), "durable_p99_ms": 1e3 * pct(durable, .99),
        "cpu_s_per_GiB": med(cpu) / gib,
        "rss_MiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "child_rss_MiB": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024})
    if sidecar:
        row["sidecar_cpu_s_per_GiB"] = sidecar_cpu / (gib * len(stall))
    if write_s:
        row["raw_write_p50_ms"] = 1e3 * med(write_s)
        row["raw_write_p99_ms"] = 1e3 * pct(write_s, .99)
    return row


def _timed(fn: Callable[[], Any], reps: int) -> tuple[float, float]:
    """(median seconds, median CPU seconds of this process) of ``reps`` calls after one warm-up."""
    fn()
    wall, cpu = [], []
    for _ in range(reps):
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        fn()
        wall.append(time.perf_counter() - t0)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu.append(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)
    return med(wall), med(cpu)


def writer_worker(args: argparse.Namespace) -> dict[str, Any]:
    """The writer alone, in this process: raw write + fsync against snapsvc's
    durable .fdl and .fdl.gz of the same tensors, and compression MB/s."""
    torch.set_num_threads(1)  # as in the sidecar
    model = build_model(args.model, "cpu", getattr(torch, args.dtype))
    params, buffers = model_sources(model)
    layout = Layout.of(params, buffers, "")
    flat = staging.allocate(layout)
    views = staging.views(flat, layout)
    torch._foreach_copy_(views, [t for _, t in params + buffers])
    slot = [(s.name, v) for s, v in zip(layout.specs, views)]  # what the sidecar encodes
    nbytes = model_bytes(model)
    sample = _byte_view(flat)[:min(flat.numel(), 32 << 20)]
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="snapsvc-writer-") as d:
        def add(op: str, fn: Callable[[], Any], size: int) -> None:
            wall, cpu = _timed(fn, args.writer_reps)
            rows.append({"op": op, "MB_s": size / 1e6 / wall, "ms": 1e3 * wall,
                         "cpu_s_per_GiB": cpu / (size / 2**30)})

        add("raw write + fsync", lambda: raw_write(flat, d), flat.numel())
        add("snapsvc .fdl (durable)", lambda: write_checkpoint_file(
            os.path.join(d, "w.fdl"), slot, bytes(32)), nbytes)
        add(f"snapsvc .fdl.gz isal-{DEFAULT_GZIP_LEVEL} (durable)", lambda: write_checkpoint_file(
            os.path.join(d, "w.fdl.gz"), slot, bytes(32)), nbytes)
        add(f"isal-{DEFAULT_GZIP_LEVEL} compress, memory", lambda: isal_zlib.compress(
            sample, DEFAULT_GZIP_LEVEL, wbits=31), len(sample))
        add("zlib-6 compress, memory", lambda: zlib.compress(sample, 6, wbits=31), len(sample))
    return {"model": args.model, "method": "writer", "MiB": nbytes / 2**20, "writer": rows}


def start_worker(args: argparse.Namespace) -> dict[str, Any]:
    """Sidecar start, ``--start-reps`` times: start() until READY, then close.
    ``--model`` names a module this worker's ``__main__`` imports first ("bare": none)."""
    row: dict[str, Any] = {"model": args.model, "method": "start"}
    if args.model != "bare":
        try:
            importlib.import_module(args.model)
        except ImportError as e:
            return {**row, "skipped": str(e)}
    times = []
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="snapsvc-start-") as d:
        for _ in range(args.start_reps):
            writer = snapsvc.SnapshotWriter(d)
            t0 = time.perf_counter()
            writer.start()
            times.append(time.perf_counter() - t0)
            writer.close()
    return {**row, "start_s": med(times)}


def import_torch_s(reps: int) -> float:
    """Median wall time of a fresh ``python -c "import torch"``."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        times.append(time.perf_counter() - t0)
    return med(times)


def start_line(starts: list[dict], torch_s: float) -> str:
    parts = [f"{r['start_s']:.2f} s" + ("" if r["model"] == "bare" else
                                        f" with {r['model']} imported in __main__")
             if "start_s" in r else f"{r['model']}: {r.get('skipped') or r.get('error')}"
             for r in starts]
    return (f"sidecar start (start() to READY, median): {'; '.join(parts)}; "
            f"a bare python -c 'import torch': {torch_s:.2f} s")


# -- the parent: runs the workers, prints, writes JSON and a plot ------------------------
def run_one(args: argparse.Namespace, model: str, method: str, work: int) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--model", model,
           "--method", method, "--work", str(work), "--reps", str(args.reps),
           "--budget-s", str(args.budget_s), "--min-reps", str(args.min_reps), "--writer-reps", str(args.writer_reps),
           "--compute", args.compute, "--compute-ms", str(args.compute_ms),
           "--steps", str(args.steps), "--every", str(args.every), "--device", args.device,
           "--dtype", args.dtype, "--start-reps", str(args.start_reps)] \
        + (["--dir", args.dir] if args.dir else [])
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.worker_timeout)
    except subprocess.TimeoutExpired:
        return {"model": model, "method": method,
                "error": [f"timed out after {args.worker_timeout:.0f} s"]}
    if out.returncode != 0:
        return {"model": model, "method": method, "error": out.stderr.strip().splitlines()[-1:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def find(rows: list[dict], model: str, method: str, key: str) -> float | None:
    r = next((r for r in rows if r["model"] == model and r["method"] == method and key in r), None)
    return None if r is None else r[key]


def ratio(rows: list[dict], model: str, a: str, key_a: str, b: str, key_b: str) -> float | None:
    va, vb = find(rows, model, a, key_a), find(rows, model, b, key_b)
    return None if va is None or vb is None or vb <= 0 else va / vb


def targets(rows: list[dict], models: list[str]) -> list[str]:
    """The issues' targets, each as a measured ratio and PASS/FAIL."""
    lines = []

    def check(label: str, value: float | None, limit: float) -> None:
        if value is None:
            lines.append(f"  {label}: n/a")
        else:
            lines.append(f"  {label}: {value:.3f} (target <= {limit}) "
                         f"{'PASS' if value <= limit else 'FAIL'}")

    blk = "snapsvc-block"
    for m in models:
        check(f"{m}: block stall p50 / raw copy p50",
              ratio(rows, m, blk, "stall_p50_ms", blk, "raw_p50_ms"), 1.1)
        check(f"{m}: block durable p50 / raw write+fsync p50",
              ratio(rows, m, blk, "durable_p50_ms", blk, "raw_write_p50_ms"), 1.1)
        if m == "frozen":
            check(f"{m}: incremental stall p50 / raw full copy p50",
                  ratio(rows, m, "snapsvc-incremental", "stall_p50_ms", "snapsvc-incremental",
                        "raw_p50_ms"), 0.1)
        check(f"{m}: overlap added/ckpt / DCP added/ckpt",
              ratio(rows, m, "snapsvc-overlap", "added_per_ckpt_ms", "dcp-process",
                    "added_per_ckpt_ms"), 0.25)
    return lines


def _f(value: float | None, width: int, prec: int = 1) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:{width}.{prec}f}"


def table(rows: list[dict]) -> str:
    head = (f"{'model':>7} {'method':<19} {'stall p50':>9} {'p99':>8} {'raw p50':>8} "
            f"{'x raw':>6} {'durable':>8} {'rawwrite':>8} {'x rw':>5} {'w/rw':>5} {'CPU/GiB':>7} "
            f"{'side/GiB':>8} {'added/ck':>8} {'reps':>4} {'RSS':>5} {'chRSS':>5}")
    lines = [head, "-" * len(head)]
    for r in rows:
        label = f"{r['model']:>7} {r['method']:<19}"
        if "error" in r:
            lines.append(f"{label} ERROR {r['error']}")
            continue
        if "skipped" in r:
            lines.append(f"{label} skipped: {r['skipped']}")
            continue
        x_raw = r["stall_p50_ms"] / r["raw_p50_ms"] if r.get("raw_p50_ms") else None
        x_rw = w_rw = None
        if r.get("raw_write_p50_ms"):
            x_rw = r["durable_p50_ms"] / r["raw_write_p50_ms"]
            w_rw = (r["durable_p50_ms"] - r["stall_p50_ms"]) / r["raw_write_p50_ms"]
        lines.append(
            f"{label} {_f(r['stall_p50_ms'], 9, 2)} {_f(r['stall_p99_ms'], 8, 2)} "
            f"{_f(r['raw_p50_ms'], 8, 2)} {_f(x_raw, 6, 2)} {_f(r['durable_p50_ms'], 8)} "
            f"{_f(r.get('raw_write_p50_ms'), 8)} {_f(x_rw, 5, 2)} {_f(w_rw, 5, 2)} "
            f"{_f(r['cpu_s_per_GiB'], 7, 2)} "
            f"{_f(r.get('sidecar_cpu_s_per_GiB'), 8, 2)} {_f(r.get('added_per_ckpt_ms'), 8)} "
            f"{r['reps']:4d} {r['rss_MiB']:5.0f} {r['child_rss_MiB']:5.0f}")
    return "\n".join(lines)


def writer_table(row: dict) -> str:
    if "writer" not in row:
        return f"writer ({row.get('model')}): {row.get('error') or row.get('skipped')}"
    head = (f"{'writer alone, ' + row['model'] + ' (' + format(row['MiB'], '.0f') + ' MiB)':<42} "
            f"{'MB/s':>7} {'ms':>8} {'CPU s/GiB':>9}")
    lines = [head, "-" * len(head)]
    for w in row["writer"]:
        lines.append(f"{w['op']:<42} {w['MB_s']:7.0f} {w['ms']:8.1f} {w['cpu_s_per_GiB']:9.2f}")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install -e '.[plot]')"
    models = list(dict.fromkeys(r["model"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, title in ((axes[0], "stall_p50_ms", "stall p50 (ms, log)"),
                           (axes[1], "added_per_ckpt_ms", "time added per checkpoint (ms, log)")):
        width = 0.8 / len(methods)
        for i, meth in enumerate(methods):
            vals = [next((max(r.get(key, 0), 1e-3) for r in rows
                          if r["model"] == m and r["method"] == meth and key in r), 1e-3)
                    for m in models]
            ax.bar([j + i * width for j in range(len(models))], vals, width, label=meth)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(models))], models)
        ax.set_yscale("log")
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return f"plot written to {path}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=DEFAULT_MODELS)
    ap.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    ap.add_argument("--reps", type=int, default=8, help="timed saves per (model, method), at most")
    ap.add_argument("--budget-s", type=float, default=5.0,
                    help="stop a worker's reps after this many seconds (at least --min-reps)")
    ap.add_argument("--min-reps", type=int, default=2)
    ap.add_argument("--steps", type=int, default=15, help="training-loop steps per run")
    ap.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    ap.add_argument("--compute-ms", type=float, default=30.0, help="fixed compute per step")
    ap.add_argument("--compute", default="sleep", choices=["sleep", "matmul"],
                    help="sleep: the CPU is free while the 'GPU' computes (default); "
                    "matmul: training keeps the CPU busy")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--writer-model", default="256M",
                    help="model of the writer-alone measurement ('none' skips it)")
    ap.add_argument("--writer-reps", type=int, default=3)
    ap.add_argument("--start-reps", type=int, default=3,
                    help="sidecar starts timed per worker (0 skips the measurement)")
    ap.add_argument("--start-import", default="transformers",
                    help="what the second start worker's __main__ imports first")
    ap.add_argument("--dir", default=None, help="where files go (default: a temp dir here)")
    ap.add_argument("--json", default=None, help="also write the rows as JSON here")
    ap.add_argument("--plot", default=None, help="also write a PNG plot here (needs matplotlib)")
    ap.add_argument("--note", default="", help="a line printed under the header (e.g. the load)")
    ap.add_argument("--worker-timeout", type=float, default=300.0)
    ap.add_argument("--profile", action="store_true",
                    help="only profile the snapsvc demo's submit (model + Adam): stall, raw "
                    "copy, the goal line and microseconds per function (submit_profile.py)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--method", help=argparse.SUPPRESS)
    ap.add_argument("--work", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)), flush=True)
        return 0
    if args.profile:
        from submit_profile import profile_submit
        print("\n".join(profile_submit()))
        return 0
    args.dir = os.path.abspath(args.dir or ".")
    started = time.perf_counter()
    work = calibrate(args.compute_ms)
    machine = (f"{platform.node()} {platform.machine()} {platform.processor() or ''}".rstrip()
               + f", {os.cpu_count()} CPUs, torch {torch.__version__}, "
               f"device {args.device} {args.dtype}")
    if args.device == "cuda":
        machine += f" ({torch.cuda.get_device_name()})"
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"# {date} {machine}", flush=True)
    print(f"# load average at start {os.getloadavg()[0]:.2f}{'; ' + args.note if args.note else ''}",
          flush=True)
    what = "sleep" if args.compute == "sleep" else f"{work} matmuls"
    print(f"# reps<={args.reps} (budget {args.budget_s:.0f} s/worker), loop {args.steps} steps of "
          f"{args.compute_ms:.0f} ms compute ({what}) + SGD update, a checkpoint every "
          f"{args.every}", flush=True)
    rows = []
    for model in args.models:
        for method in args.methods:
            rows.append(run_one(args, model, method, work))
            print(table([rows[-1]]).splitlines()[-1], flush=True)
    writer = None
    if args.writer_model != "none":
        writer = run_one(args, args.writer_model, "writer", work)
    starts, torch_s = [], None
    if args.start_reps:
        starts = [run_one(args, m, "start", work) for m in ("bare", args.start_import)]
        torch_s = import_torch_s(args.start_reps)
    print()
    print(table(rows))
    print("  ms; x raw = stall p50 / raw copy p50 (same worker, alternating); durable = submit to "
          "durable p50;\n  rawwrite = plain write + fsync of the same bytes; x rw = durable / "
          "rawwrite; w/rw = (durable - stall) / rawwrite;\n  CPU/GiB = CPU s of the whole process tree per GiB checkpointed; "
          "side/GiB = snapsvc sidecar's own CPU s/GiB")
    if writer is not None:
        print()
        print(writer_table(writer))
    if starts:
        print(start_line(starts, torch_s))
    print("targets:")
    print("\n".join(targets(rows, args.models)))
    print(f"# load average at end {os.getloadavg()[0]:.2f}; run took "
          f"{time.perf_counter() - started:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": date, "machine": machine, "load_avg_end": os.getloadavg()[0],
                       "args": {k: v for k, v in vars(args).items() if k != "worker"},
                       "rows": rows, "writer": writer, "start": starts,
                       "import_torch_s": torch_s}, f, indent=1)
    if args.plot:
        print(plot(rows, args.plot))
    cells = rows + ([writer] if writer is not None else [])
    failed = [f"{r['model']} {r['method']}" for r in cells if "error" in r]
    if failed:   # the table and files are written all the same; a script must see it
        print(f"# {len(failed)} of {len(cells)} cells failed: {', '.join(failed)}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

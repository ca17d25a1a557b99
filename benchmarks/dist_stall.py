"""Stall per rank of a multi-rank checkpoint: snapsvc's DistributedSnapshotWriter
against DCP's ``async_save`` (PROCESS checkpointer, reused DefaultStager), one run.

    python benchmarks/dist_stall.py                         # world 2, 64M and small
    python benchmarks/dist_stall.py --world 2 --reps 10 --json out.json
    python benchmarks/dist_stall.py --methods snapsvc snapsvc+r1 --models 64M  # replicas

Each rank is a spawned process on gloo (CPU) holding its own model of the
named shape (``<N>M``: N MiB of 16 MiB float32 tensors; ``small``: 4096
tensors of 32 KiB), or its shards of one global model (``fsdp<N>M``: N MiB
global of ``Linear(4096, 4096)`` layers, each ``fully_shard``-ed with FSDP2,
so each rank holds N / world MiB of DTensor shards; ``fsdp<N>M/<W>``: of
``Linear(W, W)`` layers, more and smaller tensors). A ``+adam`` suffix
(``fsdp64M+adam``) adds AdamW after one step: the checkpoint is then the
state ``{"model", "optim"}`` (DCP: ``get_state_dict(model, optim)``), the
optimizer's moments sharded as the parameters are. For each model the ranks
alternate the two methods, ``--reps`` times each after one untimed warm-up
(which starts the sidecars, DCP's checkpoint process and its gloo group, and
allocates the staging memory), with a barrier before every save so ranks
start together:

* ``snapsvc``: ``DistributedSnapshotWriter.submit(model, step)``: the copy
  into a shared-memory slot (for FSDP2: of each rank's local shards); the
  sidecar writes ``step_<N>/rank<r>.fdl``, rank 0 the manifest once every
  rank's file is durable (for FSDP2 after each rank read its file back for
  the per-entry CRC-32s).
* ``dcp``: ``torch.distributed.checkpoint.async_save({"model": sd},
  checkpoint_id=dir, async_checkpointer_type=AsyncCheckpointerType.PROCESS,
  async_stager=<one DefaultStager per model, reused>)`` with
  ``StagingOptions(use_pinned_memory=False, use_shared_memory=True,
  use_async_staging=False, use_non_blocking_copy=False)`` (the two
  accelerator options raise or are ignored without CUDA; synchronous staging
  is the better choice on CPU, where nothing overlaps the copy). It returns
  once the state dict is copied into the stager's shared memory. For FSDP2
  ``model.state_dict()`` holds the DTensor shards, which DCP saves as such.

Stall is the time the training loop is held by that call. ``durable`` is from
the call to the checkpoint being complete on every rank: snapsvc's handle
result (manifest committed), DCP's upload future (``.metadata`` renamed) plus
an fsync of the checkpoint directory and its parent, which DCP leaves out.
Both are waited for outside the timed region, so no save ever waits for a
previous one.

* ``snapsvc+r1``: as ``snapsvc`` with ``replicas=1`` (each rank its own
  ``SNAPSVC_NODE``, so rank r's copy goes to rank r+1): ``durable`` also waits
  for ``handle.replicated()``. Beside the table, the replication pass's
  throughput (every rank's file to its peer, over the writer's gloo group,
  from ``stats()``, the median of the timed reps) against a raw gloo send of the same bytes in the same
  pattern (a size message then the payload, rank by rank round the ring), measured right
  after each pass so that both see the same load; and the stall ratio with and without
  replicas. Older checkpoints are deleted between reps (untimed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from concurrent.futures import Future
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from snapsvc.files.durable import fsync_dir

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402
from rawcopy import RawCopy  # noqa: E402
import snapsvc  # noqa: E402

_LARGE = 16 << 20
WAIT_S = 600.0


def build(spec: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """The model of ``spec``, and with a ``+adam`` suffix its AdamW after one step
    (so its moments exist): saved then as the state ``{"model", "optim"}``."""
    name, _, opt = spec.partition("+")
    model = build_model(name, seed)
    if opt != "adam":
        return model, None
    adam = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    adam.step()
    return model, adam


def build_model(spec: str, seed: int) -> nn.Module:
    """Same shapes as benchmarks/stall.py, or an FSDP2-sharded stack of Linear layers."""
    torch.manual_seed(seed)
    if spec.startswith("fsdp"):
        from torch.distributed.fsdp import fully_shard
        size, _, width = spec[4:].partition("/")
        width = int(width or 4096)
        layers = max(1, round((int(size[:-1]) << 20) / (width * (width + 1) * 4)))
        torch.manual_seed(0)   # one global model: the same on every rank
        m = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
        for layer in m:
            fully_shard(layer)
        return fully_shard(m)
    if spec.startswith("small"):
        sizes = [(32 << 10) // 4] * (int(spec.split(":")[1]) if ":" in spec else 4096)
    else:
        total = int(spec[:-1]) << (20 if spec.endswith("M") else 30)
        sizes = [_LARGE // 4] * (total // _LARGE) + ([(total % _LARGE) // 4] if total % _LARGE else [])
    m = nn.Module()
    for i, n in enumerate(sizes):
        m.register_parameter(f"p{i}", nn.Parameter(torch.randn(n)))
    return m


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def tensors(model: nn.Module, opt: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """This rank's tensors of a checkpoint: the model's, then the optimizer state's."""
    out = [_local(v) for v in model.state_dict().values()]
    if opt is not None:
        out += [_local(v) for st in opt.state.values() for v in st.values()
                if isinstance(v, torch.Tensor)]
    return out


@torch.no_grad()
def _touch(model: nn.Module, opt: torch.optim.Optimizer | None) -> None:
    # a "training step" between saves: every saved tensor changes
    torch._foreach_add_([t for t in tensors(model, opt) if t.is_floating_point()], 1.0)


class Snapsvc:
    name = "snapsvc"

    def __init__(self, directory: str, replicas: int = 0) -> None:
        self.dir = directory
        self.name = "snapsvc" if not replicas else f"snapsvc+r{replicas}"
        self.w = snapsvc.DistributedSnapshotWriter(directory, coord_timeout=WAIT_S, slots=2,
                                                   replicas=replicas)
        self.w.start()
        self.step = 0
        self.handle = None

    def save(self, model: nn.Module, opt: torch.optim.Optimizer | None) -> None:
        self.step += 1
        self.handle = self.w.submit(model if opt is None else {"model": model, "optim": opt},
                                    self.step)

    def wait_durable(self) -> None:
        self.handle.result(timeout=WAIT_S)
        self.handle.replicated(timeout=WAIT_S)

    def prune(self, rank: int) -> None:
        if rank == 0:
            for s in range(1, self.step):
                shutil.rmtree(os.path.join(self.dir, f"step_{s}"), ignore_errors=True)

    def close(self) -> None:
        self.w.close()


class Dcp:
    name = "dcp"

    def __init__(self, directory: str) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        self.dir = directory
        os.makedirs(directory, exist_ok=True)
        self.stager = DefaultStager(StagingOptions(
            use_pinned_memory=False, use_shared_memory=True,
            use_async_staging=False, use_non_blocking_copy=False))
        self.seq = 0
        self.upload: Future | None = None
        self.path = ""

    def save(self, model: nn.Module, opt: torch.optim.Optimizer | None) -> None:
        from torch.distributed.checkpoint import async_save
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.checkpoint.state_dict_saver import (
            AsyncCheckpointerType,
            AsyncSaveResponse,
        )
        self.seq += 1
        self.path = os.path.join(self.dir, f"dcp_{self.seq:04d}")
        # One top-level key, as DCP's examples do: async_save wraps each
        # top-level key in a logging decorator, costly for thousands of keys.
        if opt is None:
            state = {"model": model.state_dict()}
        else:  # DCP's own helper for a sharded model and its optimizer
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd}
        resp = async_save(state, checkpoint_id=self.path,
                          async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                          async_stager=self.stager)
        if isinstance(resp, AsyncSaveResponse):  # only with use_async_staging=True
            resp.staging_completion.result(timeout=WAIT_S)
            resp = resp.upload_completion
        self.upload = resp

    def wait_durable(self) -> None:
        self.upload.result(timeout=WAIT_S)
        fsync_dir(self.path)
        fsync_dir(self.dir)

    def prune(self, rank: int) -> None:
        if rank == 0:
            for s in range(1, self.seq):
                shutil.rmtree(os.path.join(self.dir, f"dcp_{s:04d}"), ignore_errors=True)

    def close(self) -> None:
        self.stager.close()


def _stop_dcp_process() -> None:
    from torch.distributed.checkpoint import _async_process_executor as ape
    peers._stop_checkpoint_process(ape)


def raw_ring(nbytes: int, rank: int, world: int) -> float:
    """Seconds for every rank's ``nbytes`` sent to the next rank over gloo, one
    after another, as the replication pass sends them (a size, then the bytes)."""
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    n = torch.tensor([nbytes], dtype=torch.int64)
    dist.barrier()
    t0 = time.perf_counter()
    for origin in range(world):
        peer = (origin + 1) % world
        if rank == origin:
            dist.send(n, peer)
            dist.send(buf, peer)
        elif rank == peer:
            dist.recv(n, origin)
            dist.recv(buf, origin)
    dist.barrier()
    return time.perf_counter() - t0


def make(method: str, d: str) -> "Snapsvc | Dcp":
    if method == "dcp":
        return Dcp(os.path.join(d, "dcp"))
    replicas = int(method.partition("+r")[2] or 0)
    return Snapsvc(os.path.join(d, method.replace("+", "_")), replicas)


def rank_main(rank: int, world: int, init: str, base: str, specs: list[str], reps: int,
              threads: int, method_names: list[str]) -> None:
    torch.set_num_threads(threads)
    os.environ["SNAPSVC_NODE"] = f"node{rank}"   # replicas go to other "nodes"
    out: dict = {"rank": rank, "models": {}}
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=timedelta(seconds=WAIT_S))
        for spec in specs:
            model, opt = build(spec, 1000 + rank)
            nbytes = sum(t.numel() * t.element_size() for t in tensors(model, opt))
            d = os.path.join(base, spec)
            methods = [make(name, d) for name in method_names]
            rec = {m.name: {"stall_s": [], "durable_s": [], "raw_s": []} for m in methods}
            raw = RawCopy()
            passes: list[float] = []           # replication passes of the timed reps
            raws: list[float] = []             # a raw gloo ring of the same bytes, after each
            for rep in range(reps + 1):        # rep 0: warm-up, not recorded
                for m in methods:
                    _touch(model, opt)
                    # the floor: this rank's tensors of that checkpoint, copied right
                    # before (the last write is durable: its sidecar idle, as at the save),
                    # every rank at once after a barrier, as they copy at the save
                    dist.barrier()
                    raw.measure(tensors(model, opt))
                    dist.barrier()
                    replicating = isinstance(m, Snapsvc) and m.w.replicas
                    before = m.w.stats()["replica_s"] if replicating else 0.0
                    sent = m.w.stats()["replica_bytes"] if replicating else 0
                    t0 = time.perf_counter()
                    m.save(model, opt)
                    stall = time.perf_counter() - t0
                    m.wait_durable()
                    durable = time.perf_counter() - t0
                    if rep:
                        rec[m.name]["stall_s"].append(stall)
                        rec[m.name]["durable_s"].append(durable)
                        rec[m.name]["raw_s"].append(raw.times[-1])
                        if replicating:   # the raw ring right after, in the same conditions
                            passes.append(m.w.stats()["replica_s"] - before)
                            raws.append(raw_ring(m.w.stats()["replica_bytes"] - sent, rank,
                                                 world))
                    dist.barrier()             # every rank done before rank 0 prunes
                    m.prune(rank)
            replication = {}
            for m in methods:
                if isinstance(m, Snapsvc) and m.w.replicas:
                    st = m.w.stats()
                    per = st["replica_bytes"] // max(1, st["replicated"])
                    replication = {"bytes": per, "pass_s": statistics.median(passes),
                                   "raw_s": statistics.median(raws),
                                   "ratios": [a / b for a, b in zip(passes, raws)]}
            for m in methods:
                m.close()
            _stop_dcp_process()                # the next model gets a fresh one
            out["models"][spec] = {"bytes": nbytes, "tensors": len(tensors(model, opt)),
                                   "replication": replication, **rec}
            dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        out["crash"] = traceback.format_exc()
    with open(os.path.join(base, f"result{rank}.json"), "w") as f:
        json.dump(out, f)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def table(results: list[dict], specs: list[str], world: int, reps: int) -> str:
    lines = [(f"world size {world}, gloo on CPU, {reps} timed saves per method per model "
              f"(after 1 warm-up), torch {torch.__version__}, {os.cpu_count()} CPUs"),
             "",
             ("| model | method | rank | stall p50 ms | stall p90 ms | stall max ms "
              "| raw p50 ms | stall/raw | durable p50 s | durable max s |"),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for spec in specs:
        for method in [k for k in results[0]["models"][spec]
                       if k not in ("bytes", "tensors", "replication")]:
            for res in results:
                r = res["models"][spec][method]
                mb = res["models"][spec]["bytes"] / (1 << 20)
                label = f"{spec} ({res['models'][spec]['tensors']} x, {mb:.0f} MiB/rank)"
                lines.append(
                    f"| {label} | {method} | {res['rank']} "
                    f"| {statistics.median(r['stall_s']) * 1e3:.1f} "
                    f"| {pct(r['stall_s'], 0.9) * 1e3:.1f} | {max(r['stall_s']) * 1e3:.1f} "
                    f"| {statistics.median(r['raw_s']) * 1e3:.1f} "
                    f"| {statistics.median(a / b for a, b in zip(r['stall_s'], r['raw_s'])):.2f} "
                    f"| {statistics.median(r['durable_s']):.2f} | {max(r['durable_s']):.2f} |")
    for spec in specs:
        for res in results:
            rep = res["models"][spec].get("replication")
            if rep:
                mib = rep["bytes"] * world / (1 << 20)
                lines.append(f"\n{spec} rank {res['rank']}: replication pass {mib:.0f} MiB in "
                             f"{rep['pass_s'] * 1e3:.0f} ms ({mib / rep['pass_s']:.0f} MiB/s), "
                             f"raw gloo send of the same bytes {rep['raw_s'] * 1e3:.0f} ms "
                             f"({mib / rep['raw_s']:.0f} MiB/s): "
                             f"{rep['pass_s'] / rep['raw_s']:.2f}x; per rep (pass/raw right "
                             f"after it): {', '.join(f'{x:.2f}x' for x in rep['ratios'])}, "
                             f"median {statistics.median(rep['ratios']):.2f}x")
        names = [k for k in results[0]["models"][spec] if k.startswith("snapsvc")]
        if "snapsvc" in names and "snapsvc+r1" in names:
            ratio = [statistics.median(res["models"][spec]["snapsvc+r1"]["stall_s"]) /
                     statistics.median(res["models"][spec]["snapsvc"]["stall_s"])
                     for res in results]
            lines.append(f"\n{spec}: stall p50 with replicas=1 / without, per rank: "
                         f"{', '.join(f'{x:.2f}x' for x in ratio)}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--models", nargs="+", default=["64M", "small", "fsdp256M"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--methods", nargs="+", default=["snapsvc", "dcp"],
                    help="snapsvc, snapsvc+r1 (replicas=1), dcp")
    ap.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the raw figures here")
    ap.add_argument("--timeout", type=float, default=1800.0, help="whole run, seconds")
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="dist_stall-", dir=args.dir)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # DCP's checkpoint process binds here
    threads = max(1, (os.cpu_count() or 1) // args.world)
    ctx = mp.get_context("spawn")
    init = f"file://{base}/rendezvous"
    procs = [ctx.Process(target=rank_main, name=f"rank{r}",
                         args=(r, args.world, init, base, args.models, args.reps, threads,
                               args.methods))
             for r in range(args.world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.timeout
    try:
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                print(f"{p.name} did not finish in {args.timeout:.0f} s; killed", file=sys.stderr)
                p.kill()
                p.join(10)
    try:
        results = []
        for r in range(args.world):
            with open(os.path.join(base, f"result{r}.json")) as f:
                results.append(json.load(f))
        crashed = [r for r in results if "crash" in r]
        for r in crashed:
            print(f"rank {r['rank']} failed:\n{r['crash']}", file=sys.stderr)
        if crashed:
            return 1
        print(table(results, args.models, args.world, args.reps))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world": args.world, "reps": args.reps, "results": results}, f,
                          indent=1)
        return 0
    except FileNotFoundError as e:
        print(f"a rank wrote no result: {e}", file=sys.stderr)
        return 1
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

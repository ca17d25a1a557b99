"""``restart.py --world W --nodes K``: a lost node, back from a peer's RAM and from the remote tier.

W ranks (gloo on CPU) as K simulated nodes (``SNAPSVC_NODE``, ranks split in
order), each with its own model of ``--mib`` MiB and AdamW after one step,
save with ``DistributedSnapshotWriter(replicas=1, linger, remote=<moto S3>)``
step 10 persisted (uploaded) and step 20 memory-only. The last node is then
lost: its sidecars SIGKILLed, its RAM copies and the replicas it held gone,
its disk files of step 10 deleted; every trainer dies (the job restarts).

A new world of W fresh processes (the lost node's on the same ids) opens its
writers, then, timed from a barrier to the barrier after the last rank holds
its state, bit-exact against ``torch.save`` references:

- peer RAM: ``latest_checkpoint`` (step 20, complete in RAM) and
  ``restore_distributed``: the lost node's files from its peers' replicas;
- remote: ``restore_distributed("s3://.../step_10")``, every rank fetching its
  own files from moto on loopback (a whole-step remote restore);
- raw gloo: each lost rank's file size sent by its replica holder over gloo,
  all pairs at once: the floor for the peer-RAM figure.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import statistics
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

LINGER_S = 120


def _objects(mib: int, seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(max(mib // 4, 1))])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _state(model, opt) -> dict:
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optim": opt.state_dict()["state"]}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _node(rank: int, world: int, nodes: int) -> str:
    return "ABCDEFGH"[rank * nodes // world]


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _rank(rank: int, world: int, nodes: int, init: str, base: str, phase: str, mib: int,
          url: str, env: dict) -> None:
    os.environ.update(env)
    os.environ["SNAPSVC_NODE"] = _node(rank, world, nodes)
    torch.set_num_threads(1)
    import snapsvc
    from snapsvc.distributed.replicas import held_by
    from snapsvc.files.ramtier import drop, held
    out: dict = {}
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
        d = os.path.join(base, "ckpt")
        lost = _node(rank, world, nodes) == _node(world - 1, world, nodes)
        if phase == "save":
            model, opt = _objects(mib, rank)
            w = snapsvc.DistributedSnapshotWriter(d, replicas=1, linger=LINGER_S, remote=url,
                                                  coord_timeout=120).start()
            for step, persist in ((10, True), (20, False)):
                h = w.submit(model, step, optimizer=opt, persist=persist)
                torch.save(_state(model, opt), os.path.join(base, f"ref{step}_{rank}.pt"))
                h.result(120)
                h.replicated(timeout=120)
                if persist:
                    h.uploaded(timeout=120)
                model(torch.randn(4, 1024)).sum().backward()
                opt.step()
                opt.zero_grad()
            dist.barrier()
            if lost:   # its sidecar, its RAM copies and held replicas, its disk files
                os.kill(w.writer.pid, signal.SIGKILL)
                for n in (10, 20):
                    own = held(os.path.join(d, f"step_{n}", f"rank{rank}.fdl"))
                    if own is not None:
                        drop(own)
                    for ram in held_by(d, n, rank, world).values():
                        drop(ram)
                for p in glob.glob(os.path.join(d, "step_10", f"rank{rank}.*")):
                    os.unlink(p)
            _write(base, rank, out)
            os.kill(os.getpid(), signal.SIGKILL)   # every trainer dies
        model, opt = _objects(mib, 100 + rank)   # other values than the saved ones
        with snapsvc.DistributedSnapshotWriter(d, replicas=1, linger=LINGER_S,
                                               coord_timeout=120) as w:
            w.start()
            path: list[str] = []
            out["latest_s"] = _timed(lambda: path.append(snapsvc.latest_checkpoint(d)))
            out["ram_s"] = out["latest_s"] + _timed(
                lambda: snapsvc.restore_distributed(path[0], model, opt))
            out["path"] = os.path.basename(path[0])
            out["ram_exact"] = _same(_state(model, opt),
                                     torch.load(os.path.join(base, f"ref20_{rank}.pt")))
            model, opt = _objects(mib, 200 + rank)
            out["remote_s"] = _timed(lambda: snapsvc.restore_distributed(f"{url}/step_10",
                                                                         model, opt))
            out["remote_exact"] = _same(_state(model, opt),
                                        torch.load(os.path.join(base, f"ref10_{rank}.pt")))
            out["raw_s"] = statistics.median(_raw(d, rank, world, nodes) for _ in range(3))
    except BaseException:
        out["crash"] = traceback.format_exc()
    _write(base, rank, out)


def _raw(d: str, rank: int, world: int, nodes: int) -> float:
    """Each lost rank's file's bytes from its replica holder, all pairs at once."""
    from snapsvc.distributed.replicas import place_replicas
    names = [_node(r, world, nodes) for r in range(world)]
    gone = [r for r in range(world) if names[r] == names[-1]]
    size = {r: sum(map(os.path.getsize, glob.glob(os.path.join(d, "step_10", f"rank{r}.*"))))
            if r not in gone else 0 for r in range(world)}
    size = {r: size[r] or max(size.values()) for r in size}   # the same model on every rank
    pairs = [(place_replicas(names, r, 1)[0], r) for r in gone]
    bufs = {p: torch.ones(size[p[1]], dtype=torch.uint8) for p in pairs if rank in p}

    def go() -> None:
        works = [dist.isend(b, dst) if src == rank else dist.irecv(b, src)
                 for (src, dst), b in bufs.items()]
        for work in works:
            work.wait()
    return _timed(go)


def _write(base: str, rank: int, out: dict) -> None:
    with open(os.path.join(base, f"result{rank}.json.tmp"), "w") as f:
        json.dump(out, f)
    os.replace(os.path.join(base, f"result{rank}.json.tmp"),
               os.path.join(base, f"result{rank}.json"))


def run(world: int, nodes: int, mib: int, url: str, base: str) -> list[str]:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "snapsvc"])
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    results = []
    for phase in ("save", "resume"):
        for f in glob.glob(os.path.join(base, "result*.json")) + [os.path.join(base, "rdv")]:
            if os.path.exists(f):
                os.unlink(f)
        procs = [ctx.Process(target=_rank, args=(r, world, nodes, f"file://{base}/rdv", base,
                                                  phase, mib, url, env)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + 300
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(10)
        results = []
        for r in range(world):
            with open(os.path.join(base, f"result{r}.json")) as f:
                results.append(json.load(f))
        crashed = [f"rank {r}:\n{res['crash']}" for r, res in enumerate(results) if "crash" in res]
        if crashed:
            raise RuntimeError("\n".join(crashed))
    r0 = results[0]
    file_mib = sum(map(os.path.getsize, glob.glob(os.path.join(base, "ckpt", "step_10",
                                                               "rank0.*")))) / 2**20
    lost = [r for r in range(world) if _node(r, world, nodes) == _node(world - 1, world, nodes)]
    exact = all(r["ram_exact"] and r["remote_exact"] for r in results)
    return [f"\nworld {world} as {nodes} nodes, {mib} MiB of parameters per rank ({file_mib:.0f} "
            f"MiB per rank's files with AdamW's state); node {_node(world - 1, world, nodes)} (ranks "
            f"{lost}) lost; seconds from a barrier until every rank holds its state "
            f"(bit-exact: {exact}):",
            f"peer RAM ({r0['path']}): {r0['ram_s']:.3f} s (latest_checkpoint "
            f"{r0['latest_s']:.3f} s, then restore_distributed) = "
            f"{r0['ram_s'] / r0['raw_s']:.2f}x the raw gloo transfer of the lost ranks' bytes "
            f"({r0['raw_s']:.3f} s, median of 3)",
            f"remote (moto on loopback, every rank its own files of step_10): "
            f"{r0['remote_s']:.3f} s = {r0['remote_s'] / r0['raw_s']:.2f}x the raw transfer"]

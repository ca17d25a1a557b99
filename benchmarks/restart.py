"""Restart from a SIGKILLed trainer: the RAM tier against disk, remote and a raw copy (issue 31).

A trainer process holds a whole training state (a model of ``--mib`` MiB of
float32 parameters, AdamW after one step, so twice that again in its state,
a StepLR scheduler, the torch RNG, a loader position), submits it once
persisted (uploaded to moto's S3 server on loopback) and once memory-only
with ``linger``, saves the same state with stock ``torch.save`` as the
reference, and SIGKILLs itself. Then, for each source, a fresh process
builds the same objects and restores the state into them; the time from its
spawn to holding the state is split into process start + imports, building
the objects, and the restore; the state is then checked bit-exact (model,
optimizer, scheduler, RNG, loader position) against the reference:

- ram:        the memory-only snapshot, held by the sidecar lingering after the kill
- warm disk:  the persisted snapshot, page cache warm
- cold disk:  the same after posix_fadvise(POSIX_FADV_DONTNEED) on its files
- remote:     the uploaded copy, from moto on loopback (``snapsvc.restore("s3://...")``)
- memcpy:     a raw copy of the same tensors from memory into the same objects' tensors: the floor
              (AdamW's state tensors made and faulted in before the clock starts)
- memcpy+new: the same, AdamW's state copied into fresh tensors (``clone``) as a restore into a
              new optimizer must: the floor with the page faults of the memory it allocates

Also, in the trainer: the stall (``submit()``'s return) of a memory-only
snapshot against a persisted one; and, with a small state, the bytes written
per 100 submits with ``persist_every=10`` against every submit persisted, and
the lost work: a trainer SIGKILLed at step N resumes from the newest submitted
step, not the newest persisted one.

Each restore row is run ``--reps`` times (default 3), the rows taking turns,
and its median is shown.

Run: python benchmarks/restart.py --quick [--out FILE]      (64 MiB)
     python benchmarks/restart.py --mib 64 512 [--out FILE]
     python benchmarks/restart.py --world 4 --nodes 2 [--mib 16]   (a lost node: restart_nodes.py)
     python benchmarks/restart.py --mib 512 --stalls 2 --no-small    (the 512 MiB rows alone)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # a checkout
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

COMMON = """
import torch
from torch import nn

def objects(mib, init=True):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False, device=None if init else "meta")
                            for _ in range(max(mib // 4, 1))])
    if not init:   # a reader: the restore sets every value; its memory faulted in, as a trainer's
        model.to_empty(device="cpu").requires_grad_(True)
        for p in model.parameters():
            p.data.zero_()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
    return {"model": model, "opt": opt, "sched": sched,
            "rng": {"torch": torch.get_rng_state()}, "loader": {"pos": 0}}

def step(s):
    x = torch.randn(8, 1024)
    s["model"](x).square().mean().backward()
    s["opt"].step()
    s["opt"].zero_grad(set_to_none=True)
    s["sched"].step()
    s["loader"]["pos"] += 1
    s["rng"]["torch"] = torch.get_rng_state()

def plain(s):
    return {"model": s["model"].state_dict(), "opt": s["opt"].state_dict(),
            "sched": s["sched"].state_dict(), "rng": torch.get_rng_state(),
            "pos": s["loader"]["pos"]}
"""

STALLS = 8   # samples of each mode's stall (--stalls)

TRAINER = COMMON + """
import os, signal, sys, time, json, snapsvc
d, mib, remote, STALLS = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
s = objects(mib)
step(s)
w = snapsvc.SnapshotWriter(d, linger=300, remote=remote, slots=2, keep_last=2,
                           remote_keep_last=2)   # the stall files: no 16 copies on disk and in moto
w.submit(s, "warm.fdl", persist=False).result(600)     # the sidecar is up, the slots are made
stalls = {"persisted": [], "memory-only": []}
modes = [("persisted", True), ("memory-only", False)]
for i in range(STALLS):
    # each timed submit starts on an idle sidecar: the previous snapshot is written, and
    # uploaded when persisted (else the memory-only one, timed next, would share the CPU
    # with that upload); the order alternates, so neither mode always comes first
    for label, persist in (modes if i % 2 == 0 else modes[::-1]):
        t0 = time.perf_counter()
        h = w.submit(s, f"stall{label[0]}{i}.fdl", persist=persist)
        stalls[label].append(time.perf_counter() - t0)
        h.result(600)
        if persist:
            h.uploaded(600)
torch.save(plain(s), os.path.join(d, "reference.pt"))
w.submit(s, "disk1.fdl").uploaded(600)
w.submit(s, "ram1.fdl", persist=False).result(600)
print(json.dumps(stalls), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""

READER = """
import time, sys
t0 = time.time()
""" + COMMON + """
import json, os, snapsvc
from bitwise import assert_bit_identical
t1 = time.time()
path, mib, how, ref = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
s = objects(mib, init=False)
if how.startswith("memcpy"):   # the same bytes into the model's tensors and AdamW's
    expected = torch.load(ref, weights_only=True)
    src = list(expected["model"].values()) + [t for st in expected["opt"]["state"].values()
                                             for t in st.values() if t.dim()]
    dst = list(s["model"].state_dict().values())
    if how == "memcpy":   # AdamW's to be, faulted in
        dst += [torch.zeros_like(t) for t in src[len(dst):]]
t2 = time.time()
if how == "memcpy":
    torch._foreach_copy_(dst, src)
elif how == "memcpy+new":
    torch._foreach_copy_(dst, src[:len(dst)])
    fresh = [t.clone() for t in src[len(dst):]]
else:
    report = snapsvc.restore(path, s)
    s["loader"]["pos"] = report.state["loader"]["pos"]
    torch.set_rng_state(s["rng"]["torch"])
t3 = time.time()
if how == "restore":
    assert_bit_identical(plain(s), torch.load(ref, weights_only=True), "state")
print(json.dumps({"start": t0, "imports": t1, "built": t2, "restored": t3}))
"""

SMALL = COMMON + """
import os, signal, sys, json, snapsvc
d, n, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = objects(4)
step(s)
w = snapsvc.SnapshotWriter(d, linger=300, persist_every=every or None)
written = 0
for i in range(1, n + 1):
    step(s)
    written += w.submit(s, f"step{i}.fdl").result(600).bytes
print(json.dumps({"bytes": written, "steps": n}), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _p50_p99(samples: list[float]) -> tuple[float, float]:
    """The median and the 99th percentile (nearest rank: of 8 samples, the largest)."""
    ordered = sorted(samples)
    rank = -(-99 * len(ordered) // 100)   # ceil(0.99 n)
    return statistics.median(ordered), ordered[min(len(ordered), rank) - 1]


def _evict(directory: str, name: str) -> None:
    for f in os.listdir(directory):
        if f.startswith(name):
            fd = os.open(os.path.join(directory, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _killed(code: str, *args: str) -> dict:
    """Run a trainer that SIGKILLs itself; its last JSON line."""
    with tempfile.TemporaryFile("w+") as out:   # a file: the lingering sidecar inherits it
        rc = subprocess.run([sys.executable, "-c", code, *args], stdout=out,
                            stderr=subprocess.DEVNULL, cwd=ROOT, timeout=900).returncode
        out.seek(0)
        assert rc == -signal.SIGKILL, rc
        return json.loads(out.read().splitlines()[-1])


def _read(path: str, mib: int, how: str, ref: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])}
    spawn = time.time()
    out = subprocess.run([sys.executable, "-c", READER, path, str(mib), how, ref], check=True,
                         capture_output=True, text=True, timeout=900, env=env).stdout
    t = json.loads(out.splitlines()[-1])
    return {"start+imports": t["imports"] - spawn, "build": t["built"] - t["imports"],
            "restore": t["restored"] - t["built"], "total": t["restored"] - spawn}


def _release(d: str) -> None:
    """Attach to the lingering sidecar and close: its RAM copies go."""
    import snapsvc
    with snapsvc.SnapshotWriter(d) as w:
        w.start()


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def run_size(mib: int, url: str, base: str, reps: int = 3, stalls_n: int = STALLS) -> list[str]:
    d = os.path.join(base, f"m{mib}")
    stalls = _killed(TRAINER, d, str(mib), f"{url}/m{mib}", str(stalls_n))
    ref = os.path.join(d, "reference.pt")
    state_mib = os.path.getsize(os.path.join(d, "disk1.fdl")) / 2**20
    lines = [f"\n{mib} MiB of parameters ({state_mib:.0f} MiB in the checkpoint file with AdamW's "
             "state); seconds from the new process's spawn:",
             f"{'source':<10} {'start+imports':>13} {'build':>7} {'restore':>8} {'total':>7} "
             f"{'restore/memcpy':>14} {'/memcpy+new':>11}   (medians of {reps} runs)"]
    try:
        rows = [("ram", os.path.join(d, "ram1.fdl")), ("warm disk", os.path.join(d, "disk1.fdl")),
                ("cold disk", os.path.join(d, "disk1.fdl")), ("remote", f"{url}/m{mib}/disk1.fdl"),
                ("memcpy", ""), ("memcpy+new", "")]
        # the page cache is warm: the trainer has just written the file (and the
        # warm row reads it again after each cold one)
        runs: dict[str, list[dict[str, float]]] = {name: [] for name, _ in rows}
        for _ in range(reps):
            for name, path in rows:
                if name == "cold disk":
                    _evict(d, "disk1.fdl")
                runs[name].append(_read(path, mib, name if name.startswith("memcpy")
                                        else "restore", ref))
                print(f"{mib} MiB {name}: {runs[name][-1]}", file=sys.stderr, flush=True)
        results = {name: _median(r) for name, r in runs.items()}
        floor, floor_new = (results[k]["restore"] for k in ("memcpy", "memcpy+new"))
        for name, r in results.items():
            lines.append(f"{name:<10} {r['start+imports']:>13.2f} {r['build']:>7.2f} "
                         f"{r['restore']:>8.3f} {r['total']:>7.2f} {r['restore'] / floor:>13.2f}x "
                         f"{r['restore'] / floor_new:>10.2f}x")
        (p50p, p99p), (p50m, p99m) = (_p50_p99(stalls[k]) for k in ("persisted", "memory-only"))
        lines.append(f"goal: restore from RAM <= 1.3x the raw copy: "
                     f"{results['ram']['restore'] / floor_new:.2f}x memcpy+new, "
                     f"{results['ram']['restore'] / floor:.2f}x memcpy "
                     f"({'PASS' if results['ram']['restore'] / floor_new <= 1.3 else 'FAIL'} "
                     "against memcpy+new, the floor of a restore into a new optimizer)")
        lines.append(f"stall (submit(), {stalls_n} of each, alternating, each on an idle sidecar): "
                     f"persisted p50 {p50p * 1e3:.1f} ms p99 {p99p * 1e3:.1f} ms; memory-only p50 "
                     f"{p50m * 1e3:.1f} ms p99 {p99m * 1e3:.1f} ms ({p50m / p50p:.2f}x at p50)")
    finally:
        _release(d)
    return lines


def small_runs(base: str) -> list[str]:
    import snapsvc
    lines = ["\n4 MiB model + AdamW, 100 submits:"]
    got = {}
    for every in (0, 10):
        d = os.path.join(base, f"small{every}")
        got[every] = _killed(SMALL, d, "103" if every else "100", str(every))
        # what the disk holds (no keep_last: every persisted file stays), beside what the
        # handles report: memory-only snapshots must add nothing here
        got[every]["on disk"] = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
        if every:
            newest, on_disk = snapsvc.latest(d), max(
                int(f[4:-4]) for f in os.listdir(d) if f.endswith(".fdl"))
            pos = snapsvc.load(newest)["loader"]["pos"]
        _release(d)
    per = {e: {k: got[e][k] * 100 / got[e]["steps"] / 2**20 for k in ("bytes", "on disk")}
           for e in got}
    lines.append(f"bytes written per 100 submits (reported by the handles; the directory's files "
                 f"after the run): every one persisted {per[0]['bytes']:.1f} MiB "
                 f"({per[0]['on disk']:.1f} MiB on disk), persist_every=10 {per[10]['bytes']:.1f} "
                 f"MiB ({per[10]['on disk']:.1f} MiB on disk)")
    lines.append(f"lost work: SIGKILLed after submitting step 103 with persist_every=10: the newest "
                 f"on disk is step {on_disk}; snapsvc.latest gives {os.path.basename(newest)} "
                 f"(loader position {pos}, from RAM): {103 - int(os.path.basename(newest)[4:-4])} "
                 f"steps lost, {103 - on_disk} without the RAM tier")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--quick", action="store_true", help="64 MiB only")
    ap.add_argument("--out", default=None)
    ap.add_argument("--world", type=int, default=None,
                    help="ranks: a lost node, from a peer's RAM and remote (restart_nodes.py)")
    ap.add_argument("--nodes", type=int, default=2, help="simulated nodes, with --world")
    ap.add_argument("--reps", type=int, default=3, help="runs of each restore row (medians)")
    ap.add_argument("--stalls", type=int, default=STALLS, help="stall samples of each mode")
    ap.add_argument("--no-small", action="store_true",
                    help="skip the 4 MiB persist_every and lost-work runs")
    args = ap.parse_args()
    sizes = [64] if args.quick else args.mib
    from remote import _start_moto   # benchmarks/remote.py's moto on loopback
    import boto3
    import torch

    server, endpoint = _start_moto()
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    lines = [f"restart benchmark, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: "
             f"{os.cpu_count()} CPUs, torch {torch.__version__}, python {sys.version.split()[0]}"]
    try:
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
        with tempfile.TemporaryDirectory(dir=os.getcwd(), prefix="snapsvc-bench-") as base:
            if args.world:   # --mib's first size, 16 unless given
                from restart_nodes import run
                mib = 16 if args.mib == ap.get_default("mib") else args.mib[0]
                lines += run(args.world, args.nodes, mib, "s3://bench/nodes", base)
                sizes = []
            for mib in sizes:
                lines += run_size(mib, "s3://bench/run", base, args.reps, args.stalls)
            if not args.world and not args.no_small:
                lines += small_runs(base)
    finally:
        server.kill()
        server.wait(30)
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()

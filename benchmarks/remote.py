"""The remote tier against its engine, in one run, against moto's S3 server on loopback.

Rows (same bytes, same server, same run):

  upload     snapsvc: from the local commit (``h.result()``) to ``h.uploaded()``:
             the sidecar's upload of the .fdl and .meta, checked against the CRC
  raw put    obstore.put of the same two files from this process, its defaults
  restore    snapsvc.restore(url, model): ranged parallel fetch, CRC check, copy in
  raw get    the same bytes by parallel 8 MiB ranged GETs into memory (obstore)
  local      snapsvc.restore from the local file
  stall      submit() p50 with remote= and without (the training loop's cost)

moto is a Python server, so the absolute rates say more about it than about
S3; the ratios are the point (goals: upload <= 1.2x raw put, restore <= 1.3x
raw get, stall with remote= within 1.1x of without).

    python benchmarks/remote.py                 # 64 MiB model, 3 rounds
    python benchmarks/remote.py --mib 256 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_moto() -> tuple[subprocess.Popen, str]:
    """moto_server in its own process, so it does not share this one's GIL."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-c", "from moto.server import main; main()",
                             "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("moto_server did not start within 60 s")


def _model(mib: int):
    import torch
    from torch import nn

    torch.manual_seed(0)  # 16 MiB tensors
    return nn.ParameterList([nn.Parameter(torch.randn(4 << 20)) for _ in range(max(mib // 16, 1))])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import boto3
    import obstore
    from obstore.store import from_url

    import snapsvc

    server, endpoint = _start_moto()
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    try:
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
        url = "s3://bench/run"
        store = from_url(url, client_options={"allow_http": True})
        model = _model(args.mib)
        rows: dict[str, list[float]] = {k: [] for k in ("upload", "raw put", "restore",
                                                         "raw get", "local")}
        stalls: dict[str, list[float]] = {"without remote=": [], "with remote=": []}
        with tempfile.TemporaryDirectory() as tmp:
            for remote, label in ((None, "without remote="), (url, "with remote=")):
                d = os.path.join(tmp, "remote" if remote else "local")
                with snapsvc.SnapshotWriter(d, remote=remote, slots=1) as w:
                    w.submit(model, "warm.fdl").uploaded(timeout=600)  # starts the sidecar
                    for i in range(args.rounds):
                        t0 = time.perf_counter()
                        h = w.submit(model, f"step{i}.fdl")
                        stalls[label].append(time.perf_counter() - t0)
                        h.result(timeout=600)
                        done = time.perf_counter()
                        if remote is None:
                            continue
                        h.uploaded(timeout=600)
                        rows["upload"].append(time.perf_counter() - done)
                        t0 = time.perf_counter()
                        for name in (f"step{i}.fdl", f"step{i}.fdl.meta"):
                            obstore.put(store, f"raw/{name}", Path(d, name))
                        rows["raw put"].append(time.perf_counter() - t0)
                        t0 = time.perf_counter()
                        snapsvc.restore(f"{url}/step{i}.fdl", model)
                        rows["restore"].append(time.perf_counter() - t0)
                        t0 = time.perf_counter()
                        asyncio.run(_raw_get(store, f"step{i}.fdl"))  # what restore read
                        rows["raw get"].append(time.perf_counter() - t0)
                        t0 = time.perf_counter()
                        snapsvc.restore(os.path.join(d, f"step{i}.fdl"), model)
                        rows["local"].append(time.perf_counter() - t0)
        print(f"remote tier, {args.mib} MiB model, {args.rounds} rounds, moto on loopback, "
              f"{os.cpu_count()} CPUs")
        med = {k: statistics.median(v) for k, v in rows.items()}
        print(f"  upload   {med['upload'] * 1e3:8.0f} ms   raw put {med['raw put'] * 1e3:8.0f} ms"
              f"   ratio {med['upload'] / med['raw put']:.2f}x")
        print(f"  restore  {med['restore'] * 1e3:8.0f} ms   raw get {med['raw get'] * 1e3:8.0f} ms"
              f"   ratio {med['restore'] / med['raw get']:.2f}x   local restore "
              f"{med['local'] * 1e3:.0f} ms")
        s0, s1 = (statistics.median(stalls[k]) for k in ("without remote=", "with remote="))
        print(f"  stall    {s1 * 1e3:8.1f} ms with remote=, {s0 * 1e3:.1f} ms without"
              f"   ratio {s1 / s0:.2f}x")
    finally:
        server.kill()
        server.wait()


async def _raw_get(store, key: str) -> bytes:
    import obstore

    size = (await obstore.head_async(store, key))["size"]
    part = 8 << 20
    chunks = await asyncio.gather(*(obstore.get_range_async(store, key, start=s,
                                                            end=min(s + part, size))
                                    for s in range(0, size, part)))
    return b"".join(bytes(c) for c in chunks)


if __name__ == "__main__":
    main()

"""The stall where users meet snapsvc, four paths in one run, each against a raw copy.

Runs, one after another on the same machine, the four benchmarks below
(each in its own processes), reads their figures and prints one table. Every
ratio is the median stall over the median raw copy of the same run: the raw
copy is ``torch._foreach_copy_`` of exactly the tensors of that checkpoint
into shared memory allocated once, timed in the same process right before
each save (see each script's docstring). Beside it, the median of each save's
stall over its own raw copy (the pairs each script times)::

    path                          script                      goal
    nested state, changing names  state_stall.py              <= 1.2x
    Lightning's CheckpointIO      lightning_stall.py          <= 1.2x
      (monitored top-k; the whole Trainer.save_checkpoint beside it)
    FSDP2 + AdamW, world 2        dist_stall.py fsdp...+adam  <= 1.2x per rank
    SnapsvcTrainer._save_checkpoint  hf_stall.py              <= 1.5x

It also prints the sidecar's start (the first submit of state_stall.py), and the
Lightning and HF rows with ``overlap=True`` (no goal: the copy hides behind the next step).

    python benchmarks/user_paths.py                    # about 10 minutes on 2 cores
    python benchmarks/user_paths.py --out benchmarks/results/DATE-user-paths.txt
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def run(script: str, *args: str, timeout: float) -> dict | list:
    """Run ``script`` with ``args`` plus ``--json FILE``; its figures."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "figures.json")
        cmd = [sys.executable, os.path.join(HERE, script), *args, "--json", out]
        print("$", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True, timeout=timeout)
        with open(out) as f:
            return json.load(f)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fsdp", default="fsdp64M+adam", help="dist_stall.py's model")
    p.add_argument("--timeout", type=float, default=1800.0, help="per script, seconds")
    p.add_argument("--out", help="also write the table here")
    a = p.parse_args()
    t = a.timeout
    rows = []  # (path, stall p50 s, raw p50 s, median of per-save ratios, goal or None)
    state = run("state_stall.py", "--reps", "40", timeout=t)
    rows.append(("nested state, names change at every save", state["stall_p50_ms"] / 1e3,
                 state["raw_p50_ms"] / 1e3, state["ratio_paired"], 1.2))
    # lightning_stall.py's defaults: a checkpoint interval longer than a write, as in training
    # (saves that come faster than the disk takes them wait for a free slot, policy "block":
    # the disk's backpressure, not the copy), 10 saves.
    light = {r["io"]: r for r in run("lightning_stall.py", "--ios", "snapsvc,overlap",
                                     "--steps", "400", timeout=t)}   # 20 saves
    rows.append(("SnapsvcCheckpointIO.save_checkpoint, as ModelCheckpoint(monitor, "
                 "save_top_k=2) calls it", light["snapsvc"]["io_p50"],
                 light["snapsvc"]["raw_p50"], light["snapsvc"]["io_ratio"], 1.2))
    rows.append(("  the whole Trainer.save_checkpoint (Lightning's dump, the save, the "
                 "top-k removal)", light["snapsvc"]["p50"], light["snapsvc"]["raw_p50"],
                 light["snapsvc"]["ratio"], None))
    rows.append(("  the same, overlap=True", light["overlap"]["p50"],
                 light["overlap"]["raw_p50"], light["overlap"]["ratio"], None))
    dist = run("dist_stall.py", "--models", a.fsdp, "--reps", "30", timeout=t)
    for res in dist["results"]:
        r = res["models"][a.fsdp]["snapsvc"]
        rows.append((f"FSDP2 + AdamW, world 2, rank {res['rank']}",
                     statistics.median(r["stall_s"]), statistics.median(r["raw_s"]),
                     statistics.median(s / c for s, c in zip(r["stall_s"], r["raw_s"])), 1.2))
    hf = run("hf_stall.py", "--steps", "80", "--every", "10", timeout=t)  # 7 saves counted
    rows.append(("SnapsvcTrainer._save_checkpoint", hf["SnapsvcTrainer"]["p50"],
                 hf["SnapsvcTrainer"]["raw_p50"], hf["SnapsvcTrainer"]["ratio"], 1.5))
    rows.append(("  the same, overlap=True", hf["overlap=True"]["p50"],
                 hf["overlap=True"]["raw_p50"], hf["overlap=True"]["ratio"], None))

    import torch
    lines = [f"user_paths: {time.strftime('%Y-%m-%d')}, {platform.machine()}, "
             f"{os.cpu_count()} CPUs, torch {torch.__version__}",
             f"sidecar start (first submit of state_stall.py): {state['first_submit_s']:.2f} s",
             "", "| path | stall p50 ms | raw copy p50 ms | stall / raw (medians) "
             "| per-save stall / raw, p50 | goal |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, stall, raw, paired, goal in rows:
        lines.append(f"| {name} | {stall * 1e3:.1f} | {raw * 1e3:.1f} | {stall / raw:.2f}x "
                     f"| {paired:.2f}x | {'' if goal is None else f'<= {goal}x'} |")
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(f"$ python benchmarks/user_paths.py {' '.join(sys.argv[1:])}\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

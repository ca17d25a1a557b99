"""The demo behind ``snapsvc demo``: a small CPU training run with the sidecar.

It trains an MLP on synthetic data for a few hundred steps, checkpoints the
model, optimizer and step through a :class:`~snapsvc.SnapshotWriter` every
``every`` steps, then restores the last checkpoint into a fresh model and
optimizer and checks it is bit-identical to the live state at that step.
Each stall (the time ``submit()`` held the loop) sits beside a raw copy of the
same tensors (``torch._foreach_copy_`` into shared memory allocated once),
timed the same way right before it.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn

from ..engine.writer import SnapshotWriter
from ..files.checkpoint import model_tensors
from ..files.verify import verify
from ..state.resume import restore

__all__ = ["DemoResult", "run_demo", "format_demo"]


@dataclass
class DemoResult:
    rows: list[dict]           # one per checkpoint: its stall and raw copy, ms
    step_ms: float             # median training step without a checkpoint
    total_s: float
    restored: str              # path of the checkpoint restored
    restored_ok: bool          # bit-identical model and optimizer state, verify() clean
    verify_msg: str


def _model(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(64, width), nn.BatchNorm1d(width), nn.ReLU(),
                         nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU(),
                         nn.Linear(width, 1))


def run_demo(directory: str = "checkpoints", *, steps: int = 300, every: int = 25,
             width: int = 512, keep_last: int = 3, seed: int = 0) -> DemoResult:
    """Train, checkpoint every ``every`` steps into ``directory``, restore the last one."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = _model(width)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    target = torch.randn(64, 1, generator=gen)
    rows, step_times, handles = [], [], []
    timed: list[tuple[float, float]] = []   # (raw copy s, stall s) per checkpoint
    raw: list[torch.Tensor] | None = None
    last_state: dict[str, torch.Tensor] = {}
    last_optim: dict = {}
    t_start = time.perf_counter()
    with SnapshotWriter(directory, keep_last=keep_last) as writer:
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            x = torch.randn(128, 64, generator=gen)
            loss = nn.functional.mse_loss(model(x), x @ target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % every:
                step_times.append(time.perf_counter() - t0)
                continue
            path = f"step{step:05d}.fdl"
            src = [t for _, t in model_tensors(model)] + [
                v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
            if raw is None:   # allocated and touched once, outside the timing, as a slot is
                raw = [torch.empty_like(t).share_memory_() for t in src]
                torch._foreach_copy_(raw, src)
            t0 = time.perf_counter()
            with torch.no_grad():
                torch._foreach_copy_(raw, src)
            t1 = time.perf_counter()
            handle = writer.submit(model, path, optimizer=opt, metrics={"loss": loss.item()},
                                   epoch=step // every, extra={"step": step})
            timed.append((t1 - t0, time.perf_counter() - t1))
            handles.append((step, loss.item(), handle))
            last_state = {n: t.detach().clone() for n, t in model_tensors(model)}
            last_optim = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
        for (step, loss_value, h), (raw_s, stall_s) in zip(handles, timed):
            r = h.result(timeout=120)
            rows.append({"step": step, "loss": loss_value, "file": os.path.basename(r.path),
                         "MiB": r.bytes / 2**20, "stall_ms": 1e3 * stall_s,
                         "raw_ms": 1e3 * raw_s, "durable_ms": 1e3 * r.total_s})
    total_s = time.perf_counter() - t_start

    last = os.path.join(directory, str(rows[-1]["file"]))
    torch.manual_seed(seed + 1)  # a differently initialised model proves the restore
    fresh = _model(width)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-3)
    report = restore(last, fresh, fresh_opt, strict=True)
    same_model = all(torch.equal(t, last_state[n]) for n, t in model_tensors(fresh))
    same_optim = all(torch.equal(v, last_optim[k])
                     for k, v in fresh_opt.state_dict()["state"][0].items())
    check = verify(last)
    return DemoResult(rows, 1e3 * statistics.median(step_times), total_s, last,
                      same_model and same_optim and report.extra == {"step": rows[-1]["step"]}
                      and check.ok, str(check))


def format_demo(result: DemoResult) -> str:
    """The demo's report: a per-checkpoint stall table, then the restore check."""
    lines = [f"{'step':>6} {'loss':>10} {'file':<16} {'MiB':>6} {'stall ms':>9} "
             f"{'raw copy ms':>12} {'durable ms':>11}"]
    for r in result.rows:
        lines.append(f"{r['step']:>6} {r['loss']:>10.4f} {r['file']:<16} {r['MiB']:>6.2f} "
                     f"{r['stall_ms']:>9.2f} {r['raw_ms']:>12.2f} {r['durable_ms']:>11.1f}")
    stalls = sorted(r["stall_ms"] for r in result.rows)
    raws = [r["raw_ms"] for r in result.rows]
    lines.append(f"checkpoints: {len(stalls)}; stall p50 {statistics.median(stalls):.2f} ms, "
                 f"max {stalls[-1]:.2f} ms, beside a raw copy of the same tensors p50 "
                 f"{statistics.median(raws):.2f} ms; a training step takes {result.step_ms:.2f} ms "
                 f"(median); run {result.total_s:.1f} s")
    verdict = "bit-identical to the live model and optimizer" if result.restored_ok else "MISMATCH"
    lines.append(f"restored {result.restored}: {verdict}; {result.verify_msg}")
    return "\n".join(lines)

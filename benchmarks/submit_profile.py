"""Where each microsecond of one small submit goes: ``python benchmarks/stall.py --profile``.

The ``snapsvc demo`` case of issue 34: its MLP (1.15 MiB) and Adam, one
training step between submits, each ``submit(model, optimizer=, metrics=,
epoch=, extra=)`` (the demo's call) beside a raw copy of the same tensors
(one ``torch._foreach_copy_`` into shared memory allocated and touched
once), raw first on odd rounds and the submit first on even ones. The
stall p50 and raw p50 come from rounds run without the profiler; then the
same submits run under cProfile and the functions that hold the submit
longest are listed in microseconds per submit (own time, and with what
they call). The goal line: stall p50 <= raw p50 + 0.25 ms.
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import tempfile
import time

import torch

import snapsvc
from snapsvc.cli.demo import _model
from snapsvc.files.checkpoint import model_tensors

GOAL_MS = 0.25  # issue 34: a small submit costs at most its copy plus this


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def profile_submit(rounds: int = 200, width: int = 512, top: int = 22) -> list[str]:
    """The stall and raw copy medians, the goal line and the profile, as lines."""
    torch.manual_seed(0)
    model = _model(width)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(128, 64)
    _step(model, opt, x)
    src = [t for _, t in model_tensors(model)] + [
        v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    raw = [torch.empty_like(t).share_memory_() for t in src]
    torch._foreach_copy_(raw, src)
    stalls: list[float] = []
    copies: list[float] = []
    prof = cProfile.Profile()

    def submit(w: snapsvc.SnapshotWriter, i: int, profiled: bool) -> None:
        if profiled:
            prof.enable()
        t0 = time.perf_counter()
        h = w.submit(model, f"s{i % 3}.fdl", optimizer=opt, metrics={"loss": 0.5},
                     epoch=i, extra={"step": i})
        t1 = time.perf_counter()
        if profiled:
            prof.disable()
        else:
            stalls.append(t1 - t0)
        h.result(timeout=60)

    def copy() -> None:
        t0 = time.perf_counter()
        with torch.no_grad():
            torch._foreach_copy_(raw, src)
        copies.append(time.perf_counter() - t0)

    with tempfile.TemporaryDirectory() as d, snapsvc.SnapshotWriter(d, keep_last=None) as w:
        for i in range(5):  # warm: every slot used once
            submit(w, i, profiled=True)
        prof = cProfile.Profile()
        for i in range(rounds):
            _step(model, opt, x)
            for op in ((copy, lambda: submit(w, i, False)) if i % 2
                       else (lambda: submit(w, i, False), copy)):
                op()
        for i in range(rounds):
            _step(model, opt, x)
            submit(w, i, profiled=True)
    stall, rawp = 1e3 * statistics.median(stalls), 1e3 * statistics.median(copies)
    over = stall - rawp
    lines = [f"demo model + Adam, {sum(t.numel() * t.element_size() for t in src) / 2**20:.2f} MiB "
             f"staged, {rounds} rounds: stall p50 {stall:.3f} ms, raw copy p50 {rawp:.3f} ms, "
             f"x raw {stall / rawp:.2f}",
             f"  goal: stall p50 - raw p50 = {over:.3f} ms (target <= {GOAL_MS}) "
             f"{'PASS' if over <= GOAL_MS else 'FAIL'}",
             f"profile of {rounds} more submits (us per submit; cProfile adds its own "
             "cost to each Python call):",
             f"  {'own':>7} {'with callees':>12}  function"]
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]  # type: ignore[attr-defined]
    for (file, line, name), (_, _, own, cum, _) in rows:
        where = f"{file.rsplit('/snapsvc/', 1)[-1]}:{line}" if "/snapsvc/" in file else file
        lines.append(f"  {1e6 * own / rounds:7.1f} {1e6 * cum / rounds:12.1f}  {name} ({where})")
    return lines

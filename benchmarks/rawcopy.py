"""The raw-copy baseline every stall figure sits beside.

:class:`RawCopy` times ``torch._foreach_copy_`` of exactly the tensors of one
checkpoint (found anywhere in nested dicts, lists, tuples and objects'
``state_dict()``) into CPU shared memory allocated once per set of shapes and
dtypes, outside the timing. Call :meth:`measure` right before each save, in
the same process and thread, so the stall and its raw copy see the same
caches and the same load: right after it, the copy would compete with the
sidecar writing that checkpoint (at training's priority on a CPU run).
"""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["RawCopy", "tensors_of"]


def tensors_of(obj: Any, out: list[torch.Tensor] | None = None, depth: int = 0) -> list[torch.Tensor]:
    """Every tensor reachable from ``obj``, depth first (shared storages counted once each)."""
    out = [] if out is None else out
    if depth > 64:
        return out
    if isinstance(obj, torch.Tensor):
        out.append(obj.detach())
    elif isinstance(obj, dict):
        for v in obj.values():
            tensors_of(v, out, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            tensors_of(v, out, depth + 1)
    elif isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)) or hasattr(obj, "state_dict"):
        try:
            tensors_of(obj.state_dict(), out, depth + 1)
        except TypeError:
            pass
    return out


class RawCopy:
    """Shared-memory destinations allocated once per layout; one timed copy per call."""

    def __init__(self) -> None:
        self._dst: dict[tuple, list[torch.Tensor]] = {}
        self.times: list[float] = []

    def measure(self, obj: Any) -> float:
        src = [t.to("cpu") if t.device.type != "cpu" else t for t in tensors_of(obj)]
        key = tuple((tuple(t.shape), t.dtype) for t in src)
        dst = self._dst.get(key)
        if dst is None:  # allocated and touched outside the timing, as a slot is
            dst = [torch.empty(t.shape, dtype=t.dtype).share_memory_() for t in src]
            torch._foreach_copy_(dst, src)
            self._dst = {key: dst}  # one set alive, like one slot pool
        t0 = time.perf_counter()
        torch._foreach_copy_(dst, src)
        dt = time.perf_counter() - t0
        self.times.append(dt)
        return dt

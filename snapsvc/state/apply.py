"""The last step of every restore: a checked plan applied to live objects, all or nothing.

Both forms of :func:`snapsvc.restore` (a model, a mapping of live objects)
check everything they can first (names, shapes, classes, that each live
tensor can be written), then hand a :class:`Plan` to :func:`apply`. What
the checks cannot foresee (a ``load_state_dict`` or ``set_extra_state``
that raises, a ``copy_`` that fails) undoes every change already made.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..files.checkpoint import LoadReport

__all__ = ["Plan", "apply"]


@dataclass
class Plan:
    """What a checked restore will change, each step named as the report names it."""

    loads: list[tuple[str, Any, Any]] = field(default_factory=list)  # (name, object, state dict)
    extras: list[tuple[str, nn.Module, Any]] = field(default_factory=list)  # (name, module, state)
    copies: list[tuple[str, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # (name, live tensor, saved tensor)
    report: LoadReport = field(default_factory=LoadReport)


def apply(plan: Plan) -> None:
    """Load objects, set extra states, copy tensors; all or nothing.

    On a failure every change already made is undone, in reverse order, and
    the error is raised again, noting which step failed (Python 3.11+). The
    undo keeps: an optimizer's previous ``state_dict()`` (its tensors by
    reference: loading replaces them, never writes into them), a deep copy of
    every other object's state, and a CPU copy of each live tensor before it
    is overwritten (so a restore holds up to the restored tensors' size in
    extra host memory until it returns).
    """
    undo: list[Callable[[], Any]] = []
    step = ""
    try:
        for step, obj, sd in plan.loads:
            previous = obj.state_dict()
            if not isinstance(obj, torch.optim.Optimizer):
                previous = copy.deepcopy(previous)
            undo.append(functools.partial(obj.load_state_dict, previous))  # undoes a half-load too
            obj.load_state_dict(sd)
        for step, module, state in plan.extras:
            undo.append(functools.partial(module.set_extra_state,
                                          copy.deepcopy(module.get_extra_state())))
            module.set_extra_state(state)
        with torch.no_grad():
            for step, live, saved in plan.copies:
                previous = live.detach().to("cpu", copy=True)
                # from pinned memory (read_verified(pin_memory=True)) a copy to CUDA is async DMA
                live.copy_(saved, non_blocking=live.is_cuda)
                undo.append(functools.partial(live.copy_, previous))
            step = "copying to CUDA"
            # Done before returning: the source may be a buffer freed with the checkpoint.
            for device in {live.device for _, live, _ in plan.copies if live.is_cuda}:
                torch.cuda.current_stream(device).synchronize()
    except BaseException as e:
        with torch.no_grad():
            for back in reversed(undo):
                back()
        if hasattr(e, "add_note"):  # 3.11+: the error keeps its type and says where
            e.add_note(f"snapsvc.restore: failed at {step!r}; every change made before it "
                       "was undone")
        raise

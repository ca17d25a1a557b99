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
import signal
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..errors import RollbackError
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
    the error is raised again, noting which step failed (Python 3.11+); if
    some undo steps raise, the others still run and :class:`RollbackError`
    names the objects that could not be put back. The
    undo keeps: an optimizer's previous ``state_dict()`` (its tensors by
    reference: loading replaces them, never writes into them), a deep copy of
    every other object's state, and a CPU copy of each live tensor that is
    a subclass, sparse or on CUDA before it is overwritten (so such a
    restore holds up to those tensors' size in extra host memory until it
    returns). Plain dense CPU tensors are copied last, in one call that
    cannot fail once checked, and keep no copy (:func:`_split_copies`).
    SIGINT and SIGTERM wait while ``apply`` runs (main thread: their
    handlers run there), so no KeyboardInterrupt lands between two copies;
    one that arrived meanwhile is acted on once the restore is whole.
    """
    held = _hold_signals()
    try:
        _apply(plan)
    finally:
        if held is not None:
            _release_signals(*held)


_HELD = (signal.SIGINT, signal.SIGTERM)


def _hold_signals() -> tuple[dict[int, Any], list[int]] | None:
    """Note SIGINT and SIGTERM instead of acting on them (main thread only: their
    handlers run there). The handlers to put back and the list that collects
    the signals; None off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return None
    caught: list[int] = []
    old: dict[int, Any] = {}
    for sig in _HELD:
        handler = signal.getsignal(sig)
        if handler is not None and handler is not signal.SIG_IGN:  # None: set outside Python
            old[sig] = signal.signal(sig, lambda signum, frame: caught.append(signum))
    return old, caught


def _release_signals(old: dict[int, Any], caught: list[int]) -> None:
    """Put the handlers back, then act on each signal that arrived meanwhile."""
    for sig, handler in old.items():
        signal.signal(sig, handler)
    for sig in dict.fromkeys(caught):
        signal.raise_signal(sig)


def _apply(plan: Plan) -> None:
    undo: list[tuple[str, Callable[[], Any]]] = []
    step = ""
    try:
        for step, obj, sd in plan.loads:
            previous = obj.state_dict()
            if not isinstance(obj, torch.optim.Optimizer):
                previous = copy.deepcopy(previous)
            undo.append((step, functools.partial(obj.load_state_dict, previous)))  # a half-load too
            obj.load_state_dict(sd)
        for step, module, state in plan.extras:
            undo.append((step, functools.partial(module.set_extra_state,
                                                 copy.deepcopy(module.get_extra_state()))))
            module.set_extra_state(state)
        guarded, plain = _split_copies(plan.copies)
        with torch.no_grad():
            for step, live, saved in guarded:
                previous = live.detach().to("cpu", copy=True)
                # from pinned memory (read_verified(pin_memory=True)) a copy to CUDA is async DMA
                live.copy_(saved, non_blocking=live.is_cuda)
                undo.append((step, functools.partial(live.copy_, previous)))
            step = "copying to CUDA"
            # Done before returning: the source may be a buffer freed with the checkpoint.
            for device in {live.device for _, live, _ in guarded if live.is_cuda}:
                torch.cuda.current_stream(device).synchronize()
            step = "copying tensors"
            if plain:  # last, in one call: nothing can fail after them, so no undo copy
                torch._foreach_copy_([live for _, live, _ in plain],
                                     [saved for _, _, saved in plain])
    except BaseException as e:
        if hasattr(e, "add_note"):  # 3.11+: the error keeps its type and says where
            e.add_note(f"snapsvc.restore: failed at {step!r}; every change made before it "
                       "was undone")
        _undo(undo, e)
        raise


_Copy = tuple[str, torch.Tensor, torch.Tensor]  # (name, live tensor, saved tensor)


def _split_copies(copies: list[_Copy]) -> tuple[list[_Copy], list[_Copy]]:
    """The copies that need an undo copy of the live tensor, and those that cannot fail.

    A copy between dense CPU tensors of plain types, of one shape, into a
    target the restore checked (``copy_problem``: writable, not overlapping,
    not complex into real) runs no user code and raises nothing, so done in
    one C call after everything else (no Python bytecode between them for
    an interrupt to land on) it needs no undo. Keeping one cost a second
    copy of every restored byte into fresh memory: 4x the copy itself on a
    256 MiB model (issue 34). Subclasses (their ``__torch_function__`` can
    raise), CUDA, sparse, nested and quantized tensors keep theirs.
    """
    guarded: list[_Copy] = []
    plain: list[_Copy] = []
    for c in copies:
        _, live, saved = c
        (plain if _cannot_fail(live) and _cannot_fail(saved) and live.shape == saved.shape
         else guarded).append(c)
    return guarded, plain


def _cannot_fail(t: torch.Tensor) -> bool:
    return (type(t) in _PLAIN_TYPES and t.device.type == "cpu" and t.layout == torch.strided
            and not t.is_nested and not t.is_quantized)


_PLAIN_TYPES = (torch.Tensor, nn.Parameter)


def _undo(undo: list[tuple[str, Callable[[], Any]]], cause: BaseException) -> None:
    """Every step of ``undo``, in reverse order, even past one that raises: an
    object left restored would pass for rolled back. RollbackError (from
    ``cause``) names each one that could not be put back."""
    failed: list[str] = []
    errors: list[BaseException] = []
    with torch.no_grad():
        for name, back in reversed(undo):
            try:
                back()
            except Exception as e:  # noqa: BLE001 - each one reported below, none lost
                failed.append(name)
                errors.append(e)
    if failed:
        raise RollbackError(
            f"restore failed ({type(cause).__name__}: {cause}), and {len(failed)} of the "
            f"objects it changed could not be put back: {', '.join(map(repr, failed))} "
            f"({'; '.join(f'{type(x).__name__}: {x}' for x in errors)}); they may hold the "
            "checkpoint's state: restore them again, or rebuild them",
            failed=failed, errors=errors) from cause

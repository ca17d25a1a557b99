"""Copying a snapshot into its slot: at once, or overlapped with training, whole or incremental.

Blocking mode copies every tensor inside ``submit()`` (on a side CUDA stream
into pinned slots for CUDA tensors). Overlap mode copies at once only what
the next forward() changes (buffers, plain tensors), and leaves the rest
(parameters, optimizer state) to one background thread on the CPU, or to a
side CUDA stream; :meth:`Copier.guard` makes ``optimizer.step()`` wait for
it, on CUDA without blocking the CPU (a step given a closure waits at the
closure's end, so the forward and backward inside overlap the copy).

Incremental mode (opt-in) copies into a slot again only what may have
changed since that slot last held it. ``_version`` alone is not a safe sign
of change: kernels that write a tensor directly do not bump it (BatchNorm's
running statistics in train mode, the fused Adam/AdamW/SGD steps, a
parameter that views a flat vector written through that vector). So a tensor
is skipped only if it is a *frozen parameter*: ``requires_grad=False``, no
``.grad`` (every torch optimizer, fused or not, steps only parameters with a
gradient), owning its whole storage (not a view into a larger buffer that
could be written through another tensor), and with the same tensor object,
storage pointer and ``_version`` as when the slot took it, and not stepped by
any optimizer (with a gradient) nor trainable at any submit since: a GAN's
discriminator is unfrozen, stepped by a fused Adam (no ``_version`` bump) and
frozen again between two submits, and looks untouched at both
(:func:`_watch_steps`). Buffers and trainable parameters are copied every
time. What is still missed: a frozen parameter written without a
``_version`` bump outside an optimizer step, through ``p.data`` or through
another tensor or array that shares its whole memory (``torch.from_numpy``).
``incremental="check"`` compares every skipped tensor with the slot (a full
compare, for debugging), logs each one a stale copy would have written, and
copies it.

Locking. ``_lock`` guards the in-flight future and the last copy event, so
``stage``, ``wait`` and the guard hook may run on any thread. Copies finish,
and their WRITE messages go out, in submit order because one thread runs
them.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import operator
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import staging
from .pools import Plan, Slot

__all__ = ["Copier"]

log = logging.getLogger("snapsvc")
_requires_grad = operator.attrgetter("requires_grad")

# Incremental mode's record of what may have changed unseen, process-wide: the
# tick of each parameter's last step with a gradient, or submit where it was
# trainable, by id (an id reused by another tensor only costs one more copy).
_ticks = itertools.count(1)
_touched: dict[int, int] = {}
_watching = threading.Lock()
_hook: Any = None


def _on_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    tick = next(_ticks)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:   # what torch's optimizers step
                _touched[id(p)] = tick


def _watch_steps() -> None:
    """Note every optimizer step of the process from now on (a post-step hook common
    to all optimizers): a step, fused, writes its parameters without a ``_version``
    bump, and ``zero_grad`` then leaves no trace of it."""
    global _hook
    with _watching:
        if _hook is None:
            _hook = register_optimizer_step_post_hook(_on_step)


def _frozen(sources: list[torch.Tensor], params: int) -> list[int]:
    """Indices of the parameters among ``sources`` (the first ``params``)
    that only an explicit write can change: ``requires_grad=False``, no
    gradient for an optimizer to apply, and their storage all their own."""
    if all(map(_requires_grad, sources[:params])):  # nothing frozen: the usual training case
        return []
    return [i for i, t in enumerate(sources[:params])
            if not t.requires_grad and t.grad is None and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.nbytes]


class Copier:
    """Stages sources into slots; owns the overlap thread and the side CUDA stream."""

    def __init__(self, overlap: bool, incremental: bool | str = False) -> None:
        self.overlap = overlap
        self.incremental = incremental
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: Future[None] | None = None
        self._event: Any = None
        self._stream: Any = None
        self._guarded = False
        self._warned = False
        if incremental:
            _watch_steps()

    def stage(self, slot: Slot, sources: list[torch.Tensor], plan: Plan | None = None
              ) -> tuple[Callable[[], None] | None, int]:
        """Copy ``sources`` into ``slot``: (the rest of the copy, bytes copied).

        Blocking mode copies everything and returns no rest. Overlap mode
        copies the early tensors now and returns the rest of the copy, to run
        on the copier thread (CPU) or already queued on a side stream (CUDA,
        where what is returned waits for the DMA to land). ``plan``: the
        sources are this cached plan's, so a full blocking copy may go group
        by group, and incremental mode may skip tensors the slot already holds.
        """
        picked = held = None
        if self.incremental and plan is not None:  # the slot is reserved for this thread
            picked, held = self._changed(slot, sources)
            if picked is not None and len(picked) == len(sources):
                picked = None  # all changed: a whole copy, group by group
        slot.held = None  # until this copy is done
        views, early_idx, late_idx = slot.views, slot.early, slot.late
        if picked is not None:
            sources = [sources[i] for i in picked]
            views = [views[i] for i in picked]
            early_idx = [j for j, i in enumerate(picked) if i in slot.early_set]
            late_idx = [j for j, i in enumerate(picked) if i not in slot.early_set]
        copied = sum(slot.layout.specs[i].nbytes for i in picked) if picked is not None \
            else slot.data_bytes
        if picked is None and plan is not None and not self.overlap and not slot.pinned:
            staging.copy_groups(slot.outs, plan.steps, views, sources)
            rest = None
        else:
            rest = self._copy(slot, views, sources, early_idx, late_idx)
        slot.held = held
        return rest, copied

    def _changed(self, slot: Slot, sources: list[torch.Tensor]) -> tuple[list[int] | None, Any]:
        """(indices of ``sources`` to copy into ``slot``, or None for all;
        what the slot holds after this copy). See the module docstring for
        what may be skipped."""
        params = slot.param_count
        frozen = _frozen(sources, params)
        ptrs = [sources[i].data_ptr() for i in frozen]
        versions = [sources[i]._version for i in frozen]
        tick = next(_ticks)
        # trainable now: another slot holding it frozen must copy it again
        still = set(frozen)
        _touched.update((id(sources[i]), tick) for i in range(params) if i not in still)
        held, now = slot.held, (sources, frozen, ptrs, versions, tick)
        if held is None or held[0] is not sources or not frozen:
            return None, now
        _, old_frozen, old_ptrs, old_versions, then = held
        if frozen == old_frozen and ptrs == old_ptrs and versions == old_versions:
            skipped = frozen  # one C-level pass each: the usual case
        else:
            was = dict(zip(old_frozen, zip(old_ptrs, old_versions)))
            skipped = [i for i, p, v in zip(frozen, ptrs, versions) if was.get(i) == (p, v)]
        # stepped by an optimizer, or trainable at a submit, since this slot took it
        seen = _touched.get
        skipped = [i for i in skipped if seen(id(sources[i]), 0) < then]
        if self.incremental == "check":
            stale = [i for i in skipped if not _same_bits(
                slot.views[i], sources[i].to(slot.views[i].device))]  # a CUDA source: to CPU
            for i in stale:
                log.warning("incremental staging: %r (a frozen parameter) changed without a "
                            "_version bump: it was written through .data or through another "
                            "tensor sharing its memory; a stale copy would have been written, "
                            "copying it", slot.layout.specs[i].name)
            if stale:
                skipped = sorted(set(skipped) - set(stale))
        keep = set(skipped)
        return [i for i in range(len(sources)) if i not in keep], now

    def _copy(self, slot: Slot, views: list[torch.Tensor], sources: list[torch.Tensor],
              early_idx: list[int], late_idx: list[int]) -> Callable[[], None] | None:
        if not self.overlap:
            if slot.pinned:
                stream = self._side_stream()
                stream.wait_stream(torch.cuda.current_stream())
                staging.copy_into(views, sources, stream)
                stream.synchronize()
            else:
                staging.copy_into(views, sources)
            return None
        if late_idx and not self._guarded and not self._warned:  # nothing late: nothing to mix
            self._warned = True
            log.warning("overlap=True without writer.guard(optimizer): a snapshot may mix "
                        "values from two steps")
        early = [sources[i] for i in early_idx], [views[i] for i in early_idx]
        late = [sources[i] for i in late_idx], [views[i] for i in late_idx]
        if not slot.pinned:
            staging.copy_into(early[1], early[0])
            return functools.partial(staging.copy_into, late[1], late[0])
        stream = self._side_stream()
        stream.wait_stream(torch.cuda.current_stream())
        staging.copy_into(early[1], early[0], stream)
        buffers_done = torch.cuda.Event()
        buffers_done.record(stream)
        torch.cuda.current_stream().wait_event(buffers_done)  # GPU-side wait, CPU runs on
        staging.copy_into(late[1], late[0], stream)
        copied = torch.cuda.Event()
        copied.record(stream)
        with self._lock:
            self._event = copied
        return copied.synchronize

    def later(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the copier thread, after every earlier one."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="snapsvc-copy")
            self._inflight = self._pool.submit(fn, *args)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every copy handed to the copier has finished."""
        with self._lock:
            inflight = self._inflight
        if inflight is not None:
            inflight.result(timeout)

    def hold(self) -> None:
        """Hold back what comes next until the in-flight copies are done: on CUDA the
        current stream waits for the copy's event (the CPU runs on), else the CPU waits."""
        with self._lock:
            event = self._event
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
        else:
            self.wait()

    def guard(self, optimizer: torch.optim.Optimizer) -> Any:
        """An optimizer step pre-hook that holds the step back until in-flight copies
        are done (:meth:`hold`); its handle.

        A step given a closure (Lightning's steps, LBFGS) holds at the end of the
        closure instead, so the forward and backward it runs overlap the copy, when
        the step is one of torch's own: those call the closure before they write
        anything. Any other step (a subclass's own, which may write its state
        first) holds before it starts."""
        closure_first = _calls_closure_first(optimizer)

        def hook(opt: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
            positional = len(args) > 1  # args[0] is the optimizer
            closure = args[1] if positional else kwargs.get("closure")
            if closure is None or not closure_first:
                self.hold()
                return None

            def closure_then_hold() -> Any:
                loss = closure()
                self.hold()
                return loss

            if positional:
                return (args[0], closure_then_hold, *args[2:]), kwargs
            return args, {**kwargs, "closure": closure_then_hold}

        self._guarded = True
        return optimizer.register_step_pre_hook(hook)

    def shutdown(self) -> None:
        """Finish the copies handed over (memcpy, bounded) and stop the thread."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _side_stream(self) -> "torch.cuda.Stream":
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream


def _calls_closure_first(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` is torch's own (``torch.optim``), whose closure
    runs before anything is written: a subclass's own ``step`` may write first."""
    step = inspect.unwrap(type(optimizer).step)  # torch wraps it with its hooks' caller
    return getattr(step, "__module__", "").startswith("torch.optim.")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, so an unchanged NaN is the same (``torch.equal`` says NaN != NaN)."""
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8),
                       b.reshape(-1).contiguous().view(torch.uint8))

"""Slot pools and copy plans: where each submit's tensors go, and which tensors they are.

A *slot* is an arena of shared memory (:mod:`snapsvc.engine.staging`): bytes,
laid out for one layout (names, shapes, dtypes) at a time. A *pool* holds the
slots that stage the submits of one layout, ``slots`` of them as a rule.
Memory follows a layout's bytes, not its names: a layout the pools do not
know takes, new memory last (:meth:`SlotPools._fill`),

1. an idle pool whose arenas all hold it, laid out anew;
2. else idle slots of pools still writing others (a pool of fewer slots; when
   they are all busy, it takes one more the same way);
3. else, when every arena that holds it is busy, those slots, busy: the pool
   is full, and the writer's policy waits for one of them, skips, or takes
   back the newest queued (:mod:`.slots`), exactly as for a full pool of an
   unchanged layout. A slot is laid out for its new pool once a submit
   reserves it (:meth:`Pool.take`);
4. only when no arena holds it (the first save, a grown state): new arenas,
   within ``max_slot_bytes``.

Slots are taken only from pools that no submit is using at that moment. So a
checkpoint whose names or small tensors change at every save (Lightning's
``best_k_models``), even while earlier ones are queued, never grows slot
memory and never waits for the sidecar to map a new arena (which it does
only after every write queued before): it reuses memory whose pages are
faulted in and which the sidecar has mapped; names, order and non-tensor
values travel with each write, and the sidecar rebuilds only its headers
(:mod:`snapsvc.sidecar.worker`). A *plan* caches, per model, the tensors to copy and their
pool, so a submit of an unchanged model does not walk it by name. Memory
stays bounded: the pools of layouts that the last submit did not use are
released as soon as they are idle (:meth:`SlotPools._trim`), and
``max_slot_bytes`` caps the total (``memory_limit`` caps it with the RAM
tier's copies: :meth:`SlotPools.room_for_copy`).

Locking. A :class:`SlotPools` and its slots are guarded by the lock of the
:class:`~snapsvc.engine.book.Book` of the writer that owns them: every method here
is called with that lock held, so slot states, pools and plans change
together with the writer's pending writes.
"""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

from ..errors import MemoryLimitError, SlotBudgetError
from ..format.layout import BUFFER, EARLY, PARAM, Layout
from ..state.memo import WalkMemo, Walked, walk
from . import staging

__all__ = ["Slot", "Pool", "Plan", "SlotPools", "walk", "tensor_guard",
           "python_guard", "arena_bytes", "RESERVED", "ROOM"]

RESERVED = 0  # Slot.seq while a submit is staging into it


# Room an arena has beyond its first layout: a later layout a few small
# tensors larger (one more best-k entry) still fits in it.
ROOM = 64 << 10


def arena_bytes(layout: Layout) -> int:
    """The bytes of a new arena for ``layout``: rounded up to a page, plus :data:`ROOM`
    (less where ``max_slot_bytes`` leaves less: see :meth:`SlotPools.pool`)."""
    return layout.nbytes + -layout.nbytes % 4096 + ROOM


class Slot:
    """One shared-memory arena and the layout it holds now. ``seq``: None
    free, RESERVED staging, else the write in flight; ``gen``: the sidecar
    generation that has it mapped; ``told``: (generation, layout) that
    sidecar last heard for it (the layout travels with a WRITE when it differs)."""

    def __init__(self, sid: int, layout: Layout, pin: bool, nbytes: int | None = None) -> None:
        self.id = sid
        self.pinned = pin
        nbytes = arena_bytes(layout) if nbytes is None else nbytes  # the arena's
        self.flat = staging.allocate(layout, pin=pin, room=nbytes - layout.nbytes)
        self.capacity = self.flat.numel()
        self.claim = staging.claim_word(self.flat)
        self.seq: int | None = None
        self.gen = -1
        self.registering = -1         # the generation a SLOT message was sent to
        self.told: tuple[int, Layout] | None = None
        self.copying = False          # overlap mode: the copier thread is filling it
        self.set_layout(layout)

    def set_layout(self, layout: Layout) -> None:
        """Lay the arena out for ``layout`` (idle, its pool unused, or reserved by the
        caller; the book's lock held). Where only names changed, the tensors' views
        stay as they are."""
        old = getattr(self, "layout", None)
        self.layout = layout
        # incremental mode: (sources, indices of the frozen parameters, their
        # storage pointers, their _versions, its tick) of the last copy (see
        # snapsvc.engine.copier)
        self.held: tuple[list[torch.Tensor], list[int], list[int], list[int], int] | None = None
        if old is not None and old.placed_like(layout):
            return
        self.views = staging.views(self.flat, layout)
        self.outs = staging.group_views(self.flat, layout)  # one flat tensor per group
        # overlap mode copies at submit what an optimizer step does not change
        self.early = [i for i, s in enumerate(layout.specs) if s.kind in EARLY]
        self.late = [i for i, s in enumerate(layout.specs) if s.kind not in EARLY]
        self.early_set = frozenset(self.early)
        self.data_bytes = sum(s.nbytes for s in layout.specs)
        # parameters come first in a layout: what incremental mode may skip is among them
        self.param_count = sum(1 for s in layout.specs if s.kind == PARAM)

    @property
    def busy(self) -> bool:
        return self.seq is not None or self.copying

    def release(self) -> None:
        if self.pinned:
            staging.unpin(self.flat)
            self.pinned = False


class Pool(list):
    """The slots that stage the submits of ``layout``; ``users``: submits using it
    now (never trimmed then). A slot taken busy from another pool holds that
    pool's layout until a submit reserves it (:meth:`take`)."""

    users = 0

    def __init__(self, slots: Iterable[Slot] = (), layout: Layout | None = None,
                 pin: bool | None = None) -> None:
        super().__init__(slots)
        self.pin = self[0].pinned if pin is None else pin
        self.lay_out(self[0].layout if layout is None else layout)

    def lay_out(self, layout: Layout) -> None:
        """Stage ``layout`` from now on (the caller lays out the idle slots)."""
        self.layout = layout
        # what the buffer names add to a metadata file (plan.pack_body's room)
        self.buffer_bytes = sum(len(name.encode("utf-8")) + 8
                                for name, place in zip(layout.names, layout.places)
                                if place[4] == BUFFER)

    def take(self, slot: Slot) -> None:
        """Lay ``slot``, reserved by the caller, out for this pool's layout, if it
        still holds another pool's (the book's lock held)."""
        if slot.layout is not self.layout:
            slot.set_layout(self.layout)


def _meta(tensors: list[torch.Tensor]) -> tuple[list, ...]:
    # conj and neg views too: over the same memory, at the same address, other values
    return (list(map(operator.attrgetter("shape"), tensors)), list(map(torch.Tensor.stride, tensors)),
            list(map(operator.attrgetter("dtype"), tensors)),
            list(map(operator.attrgetter("device"), tensors)),
            list(map(torch.Tensor.is_conj, tensors)), list(map(torch.Tensor.is_neg, tensors)))


def tensor_guard(tensors: list[torch.Tensor]) -> Callable[[list[torch.Tensor]], bool]:
    """A check that ``tensors`` (the same objects) still have the shapes,
    strides, dtypes and devices they have now.

    Uses torch's own C++ tensor check (dynamo's ``TensorGuards``: one call,
    about 0.1 us per tensor) when this torch has it and it accepts these
    tensors; else the same comparison from Python (about 0.3 us per tensor).
    Dynamo's check also compares ``requires_grad`` and dispatch keys; where
    it fails, the Python comparison decides.
    """
    slow = python_guard(tensors)
    try:
        from torch._C._dynamo.guards import TensorGuards
        guards = TensorGuards(*tensors, dynamic_dims_sizes=[], dynamic_dims_strides=[])
        if guards.check(*tensors):
            # It also fails under another thread-local mode (autocast,
            # inference_mode) than it was made in: ask the slow check then.
            return lambda now: guards.check(*now) or slow(now)
    except Exception:  # noqa: BLE001 - a private API: any failure means "use the fallback"
        pass
    return slow


def python_guard(tensors: list[torch.Tensor]) -> Callable[[list[torch.Tensor]], bool]:
    """:func:`tensor_guard` without torch's C++ check."""
    then = _meta(tensors)

    def check(now: list[torch.Tensor]) -> bool:
        try:
            return _meta(now) == then
        except RuntimeError:   # a sparse or nested tensor has no strides: not as then
            return False
    return check


# Below this, a tensor's copy is mostly call overhead: such tensors are
# gathered by one torch.cat per run, through aliases the plan keeps. Larger
# ones are copied one by one from the live tensor (so the plan never keeps a
# large storage alive after the model lets go of it).
SMALL = 1 << 20


@dataclass
class Plan:
    """What submit() needs of a model, valid while its tensors stay the same.

    ``steps`` holds, per slot group, how to fill it: runs of small
    contiguous sources as (1-D tensors, first and last element of the
    group's memory), each one ``torch.cat``, and other sources as their
    index, each one ``copy_`` from the live tensor. A 1-D source goes into
    its run as itself, so the cat reads its memory now, wherever that is;
    any other is there as a flat alias ``t.detach().view(-1)``, right as
    long as it still reads its source's memory, with the source's shape,
    strides and dtype: exactly what :meth:`matches` checks. Most small
    tensors (biases, norms) are 1-D: their addresses are not compared at
    every submit (issue 34: that comparison was a third of a 20,000-tensor
    model's stall).
    """

    walked: Walked                     # walk(model) when planned
    sources: list[torch.Tensor]        # params, then persistent buffers: the copy's sources
    pool: Pool
    guard: Callable[[list[torch.Tensor]], bool]
    aliased: list[torch.Tensor]        # the sources that have an alias, and
    aliases: list[torch.Tensor]        # their aliases, in the same order
    steps: list[list[staging.Step]]
    addresses: list[int]               # the aliases' data_ptr(): theirs never change

    @classmethod
    def make(cls, walked: Walked, sources: list[torch.Tensor],
             pool: Pool) -> "Plan":
        aliased: list[torch.Tensor] = []
        aliases: list[torch.Tensor] = []
        steps: list[list[staging.Step]] = []
        for group in pool.layout.groups:
            group_steps: list[staging.Step] = []
            run: list[torch.Tensor] = []
            start = end = 0
            for i in group.indices:
                t = sources[i]
                n = t.numel()
                if t.is_cpu and t.is_contiguous() and n * t.element_size() < SMALL:
                    if t.dim() != 1:
                        aliased.append(t)
                        aliases.append(t.detach().view(-1))
                    run.append(t if t.dim() == 1 else aliases[-1])
                else:
                    if run:
                        group_steps.append((run, start, end))
                    group_steps.append(i)
                    run, start = [], end + n
                end += n
            if run:
                group_steps.append((run, start, end))
            steps.append(group_steps)
        return cls(walked, sources, pool, tensor_guard(sources), aliased, aliases, steps,
                   list(map(torch.Tensor.data_ptr, aliases)))

    def matches(self, walked: Walked) -> bool:
        """Same outline (names, persistence), the same tensor objects with the
        same shapes, strides, dtypes and devices, and each alias still at its
        source's address: a renamed, deleted or inserted submodule, a buffer
        made (non-)persistent, a replaced, added, resized, cast or moved
        parameter or buffer, or one with an alias given other memory
        (``p.data = ...``, a storage freed and reallocated), fails it. Each
        comparison is one C-level pass, not a Python loop."""
        then, now = self.walked.tensors, walked.tensors
        return (len(now) == len(then) and all(map(operator.is_, now, then))
                and walked.outline == self.walked.outline
                and self.guard(self.sources)
                and list(map(torch.Tensor.data_ptr, self.aliased)) == self.addresses)


class SlotPools:
    """Pools by layout key, the plan cache, and the slot-memory budget."""

    def __init__(self, slots: int, max_slot_bytes: int | None,
                 memory_limit: int | None = None) -> None:
        self.slots = slots
        self.max_slot_bytes = max_slot_bytes
        # slots plus the RAM tier's copies (the writer's, or its service's if lower)
        self.memory_limit = memory_limit
        self._pools: dict[tuple, Pool] = {}
        self._plans: "weakref.WeakKeyDictionary[nn.Module, Plan]" = weakref.WeakKeyDictionary()
        self._by_id: dict[int, Slot] = {}
        self._next_id = 0
        self._released: list[Slot] = []  # until take_released(): the sidecar must unmap them
        # A state mapping's plan: its modules and optimizer states, walked
        # once; the guard is looked up at each use (tests swap it).
        self.memo = WalkMemo(lambda tensors: tensor_guard(tensors))

    def __iter__(self) -> Iterator[Slot]:
        for pool in self._pools.values():
            yield from pool

    def by_id(self, sid: int) -> Slot | None:
        return self._by_id.get(sid)

    @property
    def nbytes(self) -> int:
        return sum(s.capacity for s in self)

    def cap(self) -> tuple[int, str] | None:
        """The slots' budget: the lower of ``max_slot_bytes`` and ``memory_limit``,
        and that option's name; None when neither is set."""
        caps = [(v, name) for v, name in ((self.max_slot_bytes, "max_slot_bytes"),
                                          (self.memory_limit, "memory_limit")) if v is not None]
        return min(caps) if caps else None

    def room_for_copy(self, pool: Pool, ram: int) -> bool:
        """Whether a memory-only snapshot of ``pool`` (its RAM copy ``ram`` bytes) fits in
        ``memory_limit`` beside the slots held now: the sidecar evicts older RAM copies,
        oldest first, to make room; slots still in flight it never evicts. A copy that
        cannot fit even beside this pool's slots alone is refused
        (:class:`~snapsvc.errors.MemoryLimitError`), before a slot is taken."""
        limit = self.memory_limit
        if limit is None or not ram:
            return True
        own = sum(s.capacity for s in pool)
        if own + ram > limit:
            raise MemoryLimitError(
                f"this memory-only snapshot needs {own + ram} bytes: {len(pool)} slot(s) of "
                f"{own} bytes in all and about {ram} for its copy in RAM, more than "
                f"memory_limit={limit}; raise memory_limit to at least {own + ram}, use "
                "fewer slots, or persist it (persist=True: no RAM copy)")
        # other pools' slots count while busy: idle ones are released at the next submit
        busy = sum(s.capacity for s in self if s.busy and not any(s is m for m in pool))
        return own + busy + ram <= limit

    def pool(self, key: tuple, layout: Callable[[], Layout], pin: bool) -> Pool:
        """The pool for ``key``: its own, an idle pool large enough laid out
        anew, else one made of other pools' slots or new ones (see :meth:`_fill`
        and the module docstring). Other pools are released if idle, even when
        this raises: see :meth:`take_released`."""
        pool = self._pools.get(key)
        if pool is not None:
            self.use(pool)
            return pool
        lay = layout()
        pool = self._reuse(key, lay, pin)
        if pool is not None:
            self.use(pool)
            return pool
        self._trim(keep=None)
        pool = Pool(layout=lay, pin=pin)
        self._fill(pool, self.slots)
        self._pools[key] = pool
        return pool

    def _fill(self, pool: Pool, count: int) -> None:
        """Add slots for ``pool.layout`` to ``pool``, new memory last. First up to
        ``count`` idle slots of other pools, laid out anew; with none idle, every
        busy slot of other pools whose arena holds it, for the writer's policy to
        wait for, skip or take back as in a full pool (laid out once reserved);
        only if no arena holds it, ``count`` new ones within the budget. Slots
        that exist are faulted in and mapped by the sidecar already: a save never
        waits for it to map one behind the writes queued before."""
        lay, pin = pool.layout, pool.pin
        fits = self._fitting(lay, pin, pool)
        idle = [s for s in fits if not s.busy][:count]
        if idle or fits:
            self._move(idle or fits, pool)
            for slot in idle:
                slot.set_layout(lay)
            return
        need = count * lay.nbytes
        size = arena_bytes(lay)
        cap = self.cap()
        if cap is not None:
            budget, option = cap
            error = MemoryLimitError if option == "memory_limit" else SlotBudgetError
            if self.slots * lay.nbytes > budget:
                raise error(
                    f"this snapshot needs {self.slots} slots of {lay.nbytes} bytes "
                    f"({self.slots * lay.nbytes} bytes), more than {option}={budget}; "
                    f"raise {option} or use fewer slots")
            if self.nbytes + need > budget:
                raise SlotBudgetError(
                    f"this snapshot needs {need} bytes of slots and {self.nbytes} are held by "
                    f"snapshots still in flight; {option}={budget}")
            # the arenas' room is spare: only as much as the budget leaves
            size = max(lay.nbytes, min(size, (budget - self.nbytes) // count))
        made = []
        try:
            for _ in range(count):
                self._next_id += 1
                made.append(Slot(self._next_id, lay, pin, size))
        except BaseException:
            for slot in made:
                slot.release()
            raise
        pool.extend(made)
        self._by_id.update((s.id, s) for s in made)

    def _fitting(self, lay: Layout, pin: bool, pool: Pool) -> list[Slot]:
        """The slots whose arenas hold ``lay`` in the pools other than ``pool`` that
        no submit is using now (saves whose names change while earlier ones are
        queued), smallest first."""
        return sorted((s for p in self._pools.values() if p is not pool and not p.users
                       for s in p if s.pinned == pin and s.capacity >= lay.nbytes),
                      key=lambda s: s.capacity)

    def _move(self, slots: list[Slot], pool: Pool) -> None:
        """Move ``slots`` from their pools to ``pool``; a pool left empty goes, with its plans."""
        taken = set(map(id, slots))
        for key, donor in list(self._pools.items()):
            if donor is not pool and any(id(s) in taken for s in donor):
                donor[:] = [s for s in donor if id(s) not in taken]
                if not donor:
                    del self._pools[key]
                    self._forget_plans({id(donor)})
        pool.extend(slots)

    def _reuse(self, key: tuple, lay: Layout, pin: bool) -> Pool | None:
        """The smallest idle pool whose arenas all hold ``lay``, now laid out for it."""
        fits = [(k, p) for k, p in self._pools.items()
                if not p.users and p.pin == pin
                and all(not s.busy and s.capacity >= lay.nbytes for s in p)]
        if not fits:
            return None
        old, pool = min(fits, key=lambda kp: sum(s.capacity for s in kp[1]))
        del self._pools[old]
        self._forget_plans({id(pool)})
        pool.lay_out(lay)
        for slot in pool:
            slot.set_layout(lay)
        self._pools[key] = pool
        return pool

    def plan(self, model: nn.Module, walked: Walked) -> Plan | None:
        """The cached plan of ``model`` if it still holds (see :meth:`Plan.matches`)."""
        plan = self._plans.get(model)
        return plan if plan is not None and plan.matches(walked) else None

    def remember(self, model: nn.Module, plan: Plan) -> None:
        self._plans[model] = plan

    def use(self, pool: Pool) -> None:
        """``pool`` serves this submit: one of fewer than ``slots`` slots, all busy,
        takes one more, or the busy slots that hold its layout (see :meth:`_fill`);
        the other idle pools are released."""
        if len(pool) < self.slots and all(s.busy for s in pool):
            try:
                self._fill(pool, 1)
            except SlotBudgetError:
                pass  # the writer's policy waits for one of its own, as for a full pool
        self._trim(keep=pool)

    def take_released(self) -> list[Slot]:
        """The slots released since the last call, which the sidecar must be
        told to unmap. Kept here, not returned by :meth:`pool`, so a call that
        raises after releasing some (a refused budget) cannot lose them."""
        gone, self._released = self._released, []
        return gone

    def _trim(self, keep: Pool | None) -> None:
        gone: list[Slot] = []
        pools: set[int] = set()
        for key, pool in list(self._pools.items()):
            if pool is keep or pool.users or any(s.busy for s in pool):
                continue
            del self._pools[key]
            for slot in pool:
                del self._by_id[slot.id]
                slot.release()
            gone += pool
            pools.add(id(pool))
        if pools:
            self._forget_plans(pools)
        self._released += gone

    def _forget_plans(self, pools: set[int]) -> None:
        """Drop the plans of these pools (by id): laid out anew or gone."""
        for model, plan in list(self._plans.items()):
            if id(plan.pool) in pools:
                del self._plans[model]

    def clear(self) -> None:
        for slot in self:
            slot.release()
        self._released.clear()
        self._pools.clear()
        self._plans.clear()
        self._by_id.clear()
        self.memo.clear()

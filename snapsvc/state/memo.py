"""A state's kept plan: what the last walk found, reused while it still holds.

A submit of a nested state walks it (:func:`snapsvc.state.tree.flatten`).
The parts of that walk worth keeping (a module, a mapping of tensors and plain
values such as an optimizer's per-parameter state) are kept here by key path,
and the next walk takes a part as it is, without walking it, when it still
holds::

    walk N:    state["opt"]["state"]  -> part(keys, tensors, guard, node, entries)
    walk N+1:  same keys and types, the same tensors (or plain tensors over the
               same memory), guard(tensors) still true, names still free
               -> the part's node and entries, not walked again

No torch work beyond the guard: a part's check is one C-level pass per list.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch
from torch import nn


__all__ = ["Guard", "Part", "WalkMemo", "Walked", "walk", "leaves", "Held", "hold",
           "same"]

_PLAIN = (str, bytes, bool, float, type(None))


class Walked(NamedTuple):
    """What :func:`walk` finds: every tensor slot, and the outline that names them."""

    tensors: list[torch.Tensor | None]
    # per submodule: (name, id, type, parameter keys, buffer keys, non-persistent
    # buffer names): with the tensors, what state_dict() names (the type: whether
    # it has an extra state)
    outline: list[tuple]


def walk(model: nn.Module) -> Walked:
    """Every parameter and buffer slot of every submodule, and their outline, in one pass.

    Reads ``_parameters``/``_buffers`` directly: ``parameters()`` and
    ``buffers()`` would walk the tree twice and build names and sets, which
    costs milliseconds on models with thousands of tensors, on every submit.
    Two walks of one model compare equal in outline and identical in tensors
    only if ``state_dict()`` has the same names, persistence and tensors: a
    deleted, inserted or renamed submodule, a buffer made (non-)persistent,
    or a tensor moved to another name, changes one of them.
    """
    tensors: list[torch.Tensor | None] = []
    outline: list[tuple] = []
    for name, mod in model.named_modules():
        params, buffers, transient = mod._parameters, mod._buffers, mod._non_persistent_buffers_set
        tensors.extend(params.values())
        tensors.extend(buffers.values())
        # a copy of the set: the live one would compare equal to itself later
        outline.append((name, id(mod), type(mod), tuple(params), tuple(buffers),
                        frozenset(transient) if transient else None))
    return Walked(tensors, outline)


Guard = Callable[[list[torch.Tensor]], Callable[[list[torch.Tensor]], bool]]


@dataclass
class Part:
    """A walked module or leaf mapping, as the next walk may reuse it."""

    what: Any                                   # (the module, its outline), or the mapping's keys
    held: Held                                  # walk(module)'s tensors, or the mapping's values
    check: Callable[[list[torch.Tensor]], bool]  # its tensors' shapes, strides, dtypes
    picks: list[int]                            # which of the values its tensors are, in order
    node: Any                                   # its part of the tree
    # the names of its entries, in order; their tensors are the next walk's (picks)
    params: list[str]
    buffers: list[str]
    rest: list[tuple[str, str]]                 # (kind, name)
    names: dict[str, tuple]
    structural_hash: str | None
    # the parts walked inside it (an optimizer state's per-parameter ones): kept
    # with it, so a change in one parameter's state later re-walks only that one
    inner: dict[tuple, "Part"]
    geometry: tuple[list, list, list]  # of params, buffers, rest (see Flat.geometry)


class WalkMemo:
    """What the last :func:`flatten` found, by key path: modules (same
    parameter and buffer objects, as :func:`walk` lists them) and mappings
    of tensors and plain scalars (an optimizer's per-parameter state, a
    ``state_dict()``): the same objects, or plain tensors over the same memory
    (see :func:`_same`), whose tensors still have the shapes, strides, dtypes
    and devices they had, are not walked again; the part's tensors are copied.
    Only the parts of the last walk are kept. ``guard(tensors)`` makes that
    check (see :func:`snapsvc.engine.pools.tensor_guard`).

    The memo never keeps the state alive: a part holds its module weakly and
    no tensor at all (see :func:`hold`), and all parts go when any module,
    optimizer or stateful object of the walk is collected, so ``del model,
    opt``, or dropping one tensor of the state, frees it as it would without
    the memo (on CUDA, GPU memory)."""

    def __init__(self, guard: Guard) -> None:
        self.guard = guard
        self.parts: dict[tuple, Part] = {}
        self._anchors: list[weakref.ref] = []

    def keep(self, parts: dict[tuple, Part], anchors: list[Any]) -> None:
        """Keep ``parts`` (a walk's) while every object of ``anchors`` lives."""
        refs = []
        for obj in anchors:
            try:
                refs.append(weakref.ref(obj, self._gone))
            except TypeError:   # not weakly referable: it cannot say when it goes
                pass
        self.parts, self._anchors = parts, refs

    def _gone(self, ref: weakref.ref) -> None:
        if any(r is ref for r in self._anchors):   # an anchor of the parts kept now
            self.clear()

    def clear(self) -> None:
        self.parts, self._anchors = {}, []


_LEAF_TYPES = {torch.Tensor, nn.Parameter, int, *_PLAIN}
_DICT = {dict}


def _all_leaves(values: list) -> bool:
    # a leaf: a tensor, of any tensor subclass, or a plain scalar. Their types in one
    # C-level pass, then per type, not per value, the rest (DTensor: thousands of an
    # FSDP2 optimizer's moments)
    return all(issubclass(t, torch.Tensor) for t in set(map(type, values)) - _LEAF_TYPES)


def leaves(v: Mapping, kind: tuple[str, str | None] | None) -> tuple[Any, list] | None:
    """What a memo part of mapping ``v`` is checked by: (its keys, their types and
    its kind (1 == True), its leaves), where its values are all leaves (an
    optimizer's per-parameter state), or all plain dicts of leaves (an
    optimizer's whole ``state``: one part, not one per parameter); else None."""
    values = list(v.values())
    if _all_leaves(values):
        return (kind, tuple(v), tuple(map(type, v))), values
    if set(map(type, values)) != _DICT:
        return None
    held = [x for d in values for x in d.values()]
    if not _all_leaves(held):
        return None
    return (kind, tuple(v), tuple(map(type, v)),
            tuple((tuple(d), tuple(map(type, d))) for d in values)), held


class Held(NamedTuple):
    """What a part held, as :func:`same` compares it, without any tensor: the
    plain values themselves (a tensor's place None), every value's type and
    ``id``, and each plain tensor's address where kept by address (else -1).
    No weak reference either: one on a tensor makes ``torch.utils.swap_tensors``
    (``load_state_dict(assign=True)``, swapped ``module.to()``) refuse it."""

    values: list
    types: list[type]
    ids: list[int]
    ptrs: list[int]


def hold(values: list, by_address: bool) -> Held:
    """``values`` (a part's) as the part keeps them: a tensor the state lets
    go of (an ``extra`` value, an optimizer moment replaced by a new object)
    is freed then, not at the next submit."""
    ptr = torch.Tensor.data_ptr
    return Held([None if isinstance(v, torch.Tensor) else v for v in values],
                list(map(type, values)), list(map(id, values)),
                [ptr(v) if by_address and type(v) is torch.Tensor else -1 for v in values])


def same(then: Held, now: list) -> bool:
    """Whether ``now`` holds what a memo's part held (``then``): values of
    the same types, each at the same ``id``, or (where the part kept
    addresses) a plain tensor at the same data address. ``state_dict()``
    detaches every tensor anew at each call (Lightning's checkpoint holds the
    model's), so the tensors of the last call are gone by the next.

    Neither says "the same tensor" (the part keeps none alive: a new one may
    take a freed one's id or memory), and nothing relies on it: the part's
    entries take ``now``'s tensors, which its guard checks (shape, strides,
    dtype, device, layout), and their names are the part's keys (a mapping)
    or its module's outline, checked before. The plain values the part keeps
    alive, so an equal ``id`` is the same value."""
    if len(then.ids) != len(now) or list(map(type, now)) != then.types:
        return False
    if list(map(id, now)) == then.ids:
        return True
    ptr = torch.Tensor.data_ptr
    return all(i == id(b) or p >= 0 and ptr(b) == p
               for i, p, b in zip(then.ids, then.ptrs, now))



"""``stage()``'s kept plan: what the last stage() of a state planned, reused while it holds.

Planning a state at every ``stage()`` (DCP's flattening and write items per
tensor, snapsvc's walk of the state and its pieces) cost about 100 ms at 4096
tensors, more than their copy. :class:`StagePlan` keeps what a stage planned and
reuses it at the next one after a single walk of the state (in DCP's own order:
mappings, and lists that hold tensors or mappings) finds unchanged everything
``state_dict()`` would show:

- every container's type and keys (with the keys' types), in order, and which
  lists DCP walks into;
- every leaf's type (a tensor, a DTensor, a plain value);
- every tensor's shape, strides, dtype, device and ``requires_grad``;
- every DTensor's mesh and placements, and its local tensor's shape, strides and dtype.

The copy is always from the state's tensors of now (a DTensor's local tensor of
now), and plain values are taken anew at every stage. Anything else plans the
state again from scratch, as does a state the plan cannot follow (a tensor held
twice, a value DCP stores whole but snapsvc walks into).
"""

from __future__ import annotations

import copy
import dataclasses
import operator
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.planner_helpers import _create_write_items

from ..engine.pools import tensor_guard
from ..errors import SnapsvcError
from ..state.tree import Flat, check_plain, is_dtensor
from .staged import StagedTensor

__all__ = ["StagePlan"]

_IMMUTABLE = (int, float, str, bytes, bool, type(None))
_TENSORS = (torch.Tensor, torch.nn.Parameter)
_SCALARS = frozenset(_IMMUTABLE)
_LEAVES = frozenset((*_TENSORS, *_IMMUTABLE, tuple))   # never walked into by DCP
_LOCAL = operator.attrgetter("_local_tensor")
_GRAD = operator.attrgetter("requires_grad")


def _walk(state: Mapping, outline: list, leaves: list, paths: list | None) -> None:
    """``state``'s leaves in DCP's order (``traverse_state_dict``: a mapping is walked
    into, a list only when it holds a tensor or a mapping, anything else is a leaf),
    what names them in ``outline``, and (when ``paths`` is a list) their key paths."""
    def visit(node: Any, path: tuple) -> None:
        if isinstance(node, Mapping):
            outline.append((type(node), tuple(node), tuple(map(type, node))))
            items: Any = node.items()
        else:
            outline.append((type(node), len(node)))
            items = enumerate(node)
        for k, v in items:
            t = type(v)   # exact types first: isinstance of an ABC costs a microsecond
            if t in _LEAVES or t is not dict and not (
                    isinstance(v, Mapping) or isinstance(v, list) and _walked(v)):
                leaves.append(v)
                if paths is not None:
                    paths.append((*path, k))
            else:
                visit(v, (*path, k) if paths is not None else path)
    visit(state, ())


def _walked(values: list) -> bool:
    """Whether DCP walks into a list: it holds a tensor or a mapping, at any depth of lists."""
    if set(map(type, values)) <= _SCALARS:   # one C-level pass: a list of ids, of floats
        return False
    return any(isinstance(v, (torch.Tensor, Mapping)) or isinstance(v, list) and _walked(v)
               for v in values)


def _copied(v: Any) -> Any:
    """A plain value as DCP's staged state holds it: apart from the state's."""
    t = type(v)
    if t in _SCALARS:
        return v
    if t in (list, tuple) and set(map(type, v)) <= _SCALARS:
        return list(v) if t is list else v
    return copy.deepcopy(v)


def _placed(tree: Any, path: tuple) -> bool:
    """Whether ``path`` names a leaf of snapsvc's state tree (containers as in the state)."""
    for k in path:
        if not (isinstance(tree, Mapping) and k in tree
                or type(tree) in (list, tuple) and type(k) is int and k < len(tree)):
            return False
        tree = tree[k]
    return True


def _patched(tree: Any, edits: list[tuple[tuple, Any]], depth: int = 0) -> Any:
    """``tree`` with each (path, value) of ``edits`` set; only the containers on the
    edited paths are copied (the rest is shared: a tree is never changed once made)."""
    node = list(tree) if type(tree) in (list, tuple) else copy.copy(tree)
    groups: dict[Any, list[tuple[tuple, Any]]] = {}
    for path, value in edits:
        if len(path) == depth + 1:
            node[path[depth]] = value
        else:
            groups.setdefault(path[depth], []).append((path, value))
    for k, sub in groups.items():
        node[k] = _patched(tree[k], sub, depth + 1)
    return tuple(node) if type(tree) is tuple else node


@dataclass
class _Kept:
    """One stage's plan of a state (see :class:`StagePlan`)."""

    outline: list
    types: list[type]
    fqns: list[str]                       # DCP's flat keys, one per leaf
    tensors: list[int]                    # which leaves are tensors
    items: list[list[WriteItem]]          # and DCP's write items of each
    template: list[Any]                   # DCP's staged leaves: a ticketless StagedTensor
    # per tensor, shared by every stage (4096 fresh ones per stage cost their allocation
    # and the garbage collections it set off); the first one is made anew with the ticket
    grads: list[bool]
    guard: Callable[[list[torch.Tensor]], bool]
    dtensors: list[int]                   # which of the tensors are DTensors
    specs: list[tuple]                    # their meshes and placements
    local_guard: Callable[[list[torch.Tensor]], bool]
    plain: list[int]                      # which leaves are plain values
    paths: list[tuple]                    # their key paths in the state (and the tree)
    values: list[Any]                     # their values in the tree, as last staged
    sources: tuple[list[int], list[int], list[int]]   # per entry of the Flat: its leaf
    names: tuple[list, list, list, list]  # the Flat's param, buffer names; rest's kinds, names
    flat: Flat                            # its names, tree and geometry; no tensor
    records: list[dict[str, Any]]
    desc: dict[str, Any]


class StagePlan:
    """Plans a state for ``stage()``: DCP's flat staged state (a :class:`StagedTensor`
    per tensor, plain values copied) and snapsvc's Flat of the rank's pieces, kept
    from the last call while the state holds (see the module's docstring).
    ``planned``: how many plans were made (a kept one is not counted)."""

    def __init__(self) -> None:
        self._kept: _Kept | None = None
        self.planned = 0

    def __call__(self, state: Mapping[str, Any], ticket: int,
                 plan_state: Callable[[Mapping[str, Any]], tuple[Flat, list, dict]]
                 ) -> tuple[dict[str, Any], tuple[Flat, list, dict]]:
        """(DCP's staged state, (Flat, records, description) for the rank's hold);
        ``plan_state(state)`` plans what the rank stages when no kept plan holds."""
        outline: list = []
        leaves: list = []
        _walk(state, outline, leaves, None)
        kept = self._kept
        if kept is not None:
            got = self._reuse(kept, outline, leaves, ticket)
            if got is not None:
                return got
        self._kept = None
        return self._plan(state, ticket, plan_state)

    def _reuse(self, kept: _Kept, outline: list, leaves: list, ticket: int
               ) -> tuple[dict[str, Any], tuple[Flat, list, dict]] | None:
        if outline != kept.outline or list(map(type, leaves)) != kept.types:
            return None
        tensors = [leaves[i] for i in kept.tensors]
        if list(map(_GRAD, tensors)) != kept.grads or not kept.guard(tensors):
            return None
        dtensors = [tensors[i] for i in kept.dtensors]
        if dtensors and ([(d.device_mesh, d.placements) for d in dtensors] != kept.specs
                         or not kept.local_guard(list(map(_LOCAL, dtensors)))):
            return None
        edits = []
        values = list(kept.values)
        for j, i in enumerate(kept.plain):
            v = leaves[i]
            if v is kept.values[j] and type(v) in _IMMUTABLE:
                continue   # the very value staged last time: a str was checked then
            try:
                values[j] = check_plain(v, ".".join(map(str, kept.paths[j])))
            except (SnapsvcError, ValueError, TypeError):
                return None   # planned from scratch: that raises what a plan would
            edits.append((kept.paths[j], values[j]))
        kept.values = values
        if edits:   # the kept tree holds the values of now, as kept.values does: the next
            # reuse skips a value that stayed, so the tree must already have it
            kept.flat = dataclasses.replace(kept.flat, tree=_patched(kept.flat.tree, edits))
        staged = list(kept.template)
        if kept.tensors:
            staged[kept.tensors[0]] = StagedTensor(ticket, kept.items[0])
        for i in kept.plain:
            staged[i] = _copied(leaves[i])
        return dict(zip(kept.fqns, staged)), self._flat(kept, leaves)

    @staticmethod
    def _flat(kept: _Kept, leaves: list) -> tuple[Flat, list, dict]:
        """The kept Flat with the pieces of now: a leaf's tensor, or its local tensor."""
        f = kept.flat
        get = leaves.__getitem__

        def pieces(idx: list[int]) -> list[torch.Tensor]:
            if not kept.dtensors:   # no local tensor to take: one C-level pass
                return list(map(get, idx))
            return [leaves[i] if i >= 0 else _LOCAL(leaves[~i]) for i in idx]
        p, b, r = map(pieces, kept.sources)
        pn, bn, rk, rn = kept.names
        flat = Flat(list(zip(pn, p)), list(zip(bn, b)), list(zip(rk, rn, r)),
                    f.tree, f.structural_hash, f.kinds,
                    f.checked, None if f.geometry is None else
                    (list(f.geometry[0]), list(f.geometry[1]), list(f.geometry[2])))
        return flat, kept.records, copy.deepcopy(kept.desc)

    def _plan(self, state: Mapping[str, Any], ticket: int,
              plan_state: Callable[[Mapping[str, Any]], tuple[Flat, list, dict]]
              ) -> tuple[dict[str, Any], tuple[Flat, list, dict]]:
        self.planned += 1
        dcp_flat, _ = flatten_state_dict(dict(state))
        staged: dict[str, Any] = {}
        items_of: dict[str, list[WriteItem]] = {}
        for fqn, value in dcp_flat.items():
            if not isinstance(value, torch.Tensor):
                staged[fqn] = _copied(value)
                continue
            if not is_dtensor(value) and type(value) not in _TENSORS:
                raise TypeError(f"{fqn!r}: a {type(value).__name__}; SnapsvcStorageWriter "
                                "stages tensors and DTensors (convert a ShardedTensor to a "
                                "DTensor)")
            d: Any = value
            no_write = is_dtensor(value) and d.device_mesh.get_coordinate() is None
            items_of[fqn] = [] if no_write else _create_write_items(fqn, value)
            staged[fqn] = StagedTensor(ticket, items_of[fqn])
        planned = plan_state(state)
        self._kept = self._keep(state, dcp_flat, items_of, planned)
        return staged, planned

    @staticmethod
    def _keep(state: Mapping, dcp_flat: dict[str, Any], items_of: dict[str, list[WriteItem]],
              planned: tuple[Flat, list, dict]) -> _Kept | None:
        """The plan to keep, or None where it cannot follow the state."""
        outline: list = []
        leaves: list = []
        paths: list = []
        _walk(state, outline, leaves, paths)
        fqns = list(dcp_flat)
        if len(leaves) != len(fqns) or not all(map(operator.is_, leaves, dcp_flat.values())):
            return None   # not walked as DCP walks it
        tensors = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        ts = [leaves[i] for i in tensors]
        dtensors = [j for j, t in enumerate(ts) if is_dtensor(t)]
        where = {}   # a piece's leaf: ~i for a DTensor's local tensor
        for i in tensors:
            t = leaves[i]
            key = id(_LOCAL(t)) if is_dtensor(t) else id(t)
            if key in where:
                return None   # one tensor under two keys: the copy would follow one
            where[key] = ~i if is_dtensor(t) else i
        flat, records, desc = planned
        try:
            sources = ([where[id(t)] for _, t in flat.params],
                       [where[id(t)] for _, t in flat.buffers],
                       [where[id(t)] for _, _, t in flat.rest])
        except KeyError:
            return None   # a piece of no tensor leaf (a tensor inside a value DCP keeps whole)
        plain = [i for i, v in enumerate(leaves) if not isinstance(v, torch.Tensor)]
        values = []
        for i in plain:
            if not _placed(flat.tree, paths[i]):
                return None
            try:
                values.append(check_plain(leaves[i], fqns[i]))
            except (SnapsvcError, ValueError, TypeError):
                return None   # a module, an object with state_dict(): walked anew each time
        dts = [ts[j] for j in dtensors]
        items = [items_of[fqns[i]] for i in tensors]
        template: list[Any] = [None] * len(leaves)
        for i, its in zip(tensors, items):
            template[i] = StagedTensor(None, its)
        return _Kept(outline, list(map(type, leaves)), fqns, tensors, items, template,
                     list(map(_GRAD, ts)),
                     tensor_guard(ts), dtensors,
                     [(d.device_mesh, d.placements) for d in dts],
                     tensor_guard(list(map(_LOCAL, dts))), plain, [paths[i] for i in plain],
                     values, sources,
                     ([n for n, _ in flat.params], [n for n, _ in flat.buffers],
                      [k for k, _, _ in flat.rest], [n for _, n, _ in flat.rest]),
                     _without_tensors(flat), records, desc)


def _without_tensors(flat: Flat) -> Flat:
    """``flat`` with no tensor: a kept plan never keeps the state's memory alive (a
    model replaced, or FSDP2's new local tensors after ``load_state_dict()``)."""
    none: Any = None   # in each tensor's place
    return Flat([(n, none) for n, _ in flat.params], [(n, none) for n, _ in flat.buffers],
                [(k, n, none) for k, n, _ in flat.rest], flat.tree, flat.structural_hash,
                flat.kinds, flat.checked, flat.geometry)

"""Sharded tensors (DTensor: FSDP2, tensor parallelism) on the way out.

Each rank stages only its local pieces of parameters, optimizer state and
buffers; a block held by several ranks is written by one of them. A sharded
rank file's ``.meta`` extra is ``{SHARDS_KEY: its piece records, "extra":
the caller's}``: per piece, where it lies in the global tensor.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple, cast
import torch
from torch import nn

from ..files.checkpoint import persistent_buffers
from ..format import datafile, fdl
from ..engine.pools import tensor_guard
from ..engine.snapshot import ModelSnapshot
from ..state.resume import optimizer_state
from ..state.memo import WalkMemo
from ..state.paths import find, param_names
from ..state.tree import Flat, dtensor_type as _dtensor_type, flatten, is_dtensor as _is_dtensor

__all__ = ["SHARDS_KEY", "ShardMemo"]


SHARDS_KEY = "snapsvc_shards"
# A DTensor's local tensor itself: under no_grad ``to_local()`` returns it too,
# except for a Parameter, where it is a new view at every call
_LOCAL = operator.attrgetter("_local_tensor")
_SPEC = operator.attrgetter("_spec")
_TENSOR, _NAME = operator.itemgetter(-1), operator.itemgetter(-2)   # of a Flat's entry


def _itself(t: torch.Tensor) -> torch.Tensor:
    return t


def _uniform(takes: list[Callable]) -> Callable | list[Callable]:
    """How a part's pieces are taken: one function for all (one C-level map), or one each."""
    return takes[0] if len(set(takes)) == 1 else takes
# a piece's dtype: one .fdl tags, or one of the data file's (the piece is written there)
_DTYPES = {str(d).removeprefix("torch."): d for d in (*fdl.DTYPE_TO_TAG, *datafile.DTYPE_TO_TAG)}


@dataclass(frozen=True)
class _Block:
    """Where this rank's piece of a DTensor of one shape, mesh and placements lies."""

    writes: bool             # False: a replica that a rank at coordinate 0 writes
    offsets: list[int]       # in the global tensor, padding excluded
    lengths: list[int]
    mesh: list[int]
    placements: list[str]    # "S<dim>", "R"


@functools.lru_cache(maxsize=1 << 12)   # per submit, thousands of tensors share a few specs
def _block(shape: torch.Size, mesh: Any, placements: tuple[Any, ...]) -> _Block | None:
    """This rank's block of a DTensor; None when the mesh excludes this rank.

    The lengths exclude FSDP2's padding of uneven shards, as ``to_local()``
    does. Placements other than ``Shard(dim)`` and ``Replicate()`` are refused.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    texts = []
    for p in placements:
        if type(p) is Shard:   # not _StridedShard (FSDP2 over TP): its piece is not one block
            texts.append(f"S{p.dim}")
        elif type(p) is Replicate:
            texts.append("R")
        else:
            raise ValueError(f"placement {p!r} cannot be checkpointed by snapsvc (Shard(dim) and "
                             "Replicate() can); redistribute the tensor, or full_tensor() it, "
                             "first")
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    lengths, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    return _Block(not any(c != 0 and p == "R" for c, p in zip(coord, texts)),
                  [int(o) for o in offsets], [int(n) for n in lengths], list(mesh.shape), texts)


def _block_of(t: Any, name: str) -> _Block | None:
    try:
        return _block(t.shape, t.device_mesh, tuple(t.placements))
    except ValueError as e:
        raise ValueError(f"{name!r}: {e}") from None


def _piece(name: str, kind: str, t: torch.Tensor, rank: int
           ) -> tuple[torch.Tensor, dict[str, Any]] | None:
    """This rank's piece of ``t`` and its record, or None when another rank writes it.

    A block held by several ranks (``Replicate()`` on a mesh dimension, or a
    plain tensor, which every rank holds) is written once: by the rank at
    coordinate 0 of each replicating mesh dimension, or by rank 0.
    """
    shape = list(t.shape)
    if _is_dtensor(t):
        b = _block_of(t, name)
        if b is None or not b.writes:
            return None
        local = _LOCAL(t)   # the local tensor itself, staged live as any tensor is
        if list(local.shape) != b.lengths:
            raise ValueError(f"{name!r}: local shard has shape {list(local.shape)}, its placements "
                             f"{b.placements} on mesh {b.mesh} give {b.lengths}")
        offsets, lengths, mesh, placements = b.offsets, b.lengths, b.mesh, b.placements
    else:
        if rank != 0:
            return None
        # the live tensor (copied under no_grad): a memo's piece stays valid with it
        local, offsets, lengths, mesh, placements = t, [0] * len(shape), shape, None, None
    if math.prod(lengths) == 0 and math.prod(shape) != 0:
        return None             # an empty shard (more ranks than rows): nothing to write
    return local, {"name": name, "kind": kind, "shape": shape,
                   "dtype": str(t.dtype).removeprefix("torch."), "mesh": mesh,
                   "placements": placements, "offsets": offsets, "lengths": lengths}


def _is_sharded(model: nn.Module) -> bool:
    return _dtensor_type() is not None and any(_is_dtensor(p) for p in model.parameters())


@torch.no_grad()
def _shard_plan(model: nn.Module, optimizer: torch.optim.Optimizer | None, rank: int
                ) -> tuple[ModelSnapshot, list[dict[str, Any]], dict[str, Any]]:
    """What this rank stages: its pieces of parameters, optimizer state and buffers as a
    snapshot (one copy pass), their records in file order, and the model's description."""
    named = list(model.named_parameters())
    buffers = list(persistent_buffers(model))
    optim: list[tuple[str, torch.Tensor]] = []
    info: dict[str, Any] | None = None
    if optimizer is not None:
        optim, info = optimizer_state(optimizer, {id(p): n for n, p in named})
    first: dict[str, torch.Tensor] = {}    # params, then optimizer state: before the buffers
    rest: dict[str, torch.Tensor] = {}
    records: list[dict[str, Any]] = []
    for kind, pairs, out in (("param", named, first), ("optim", optim, first),
                             ("buffer", buffers, rest)):
        for name, t in pairs:
            piece = _piece(name, kind, t, rank)
            if piece is not None:
                out[name] = piece[0]
                records.append(piece[1])
    desc = {"params": [n for n, _ in named], "buffers": [n for n, _ in buffers],
            "optimizer": info}
    return ModelSnapshot(first, rest), records, desc


class _Pieces(NamedTuple):
    """One walk's entries and what this rank stages of each (see :class:`ShardMemo`).
    It holds no tensor (a dropped or replaced one, an optimizer's moment or FSDP2's
    old shards, is freed at once) and no weak reference to one (``swap_tensors``,
    which ``.to()`` uses on DTensor parameters, refuses a tensor that has one)."""

    names: list[str]                      # the flattened state's entry names, in file order,
    types: list[type]                     # their tensors' types,
    geometry: list[tuple]                 # (kind, shape, dtype) as the walk saw them,
    specs: list[Any]                      # and each DTensor's spec (mesh, placements), or None
    records: list[dict[str, Any] | None]  # this rank's record of each, or None
    staged: list[tuple[int, str, str, int, bool]]   # per piece: (params 0, buffers 1 or
    #                                       rest 2, kind, name, entry index, is a DTensor)
    # the same per part of the staged Flat (params, buffers, rest), for C-level passes:
    # (entry indices, the piece of each (_LOCAL or _itself, one for all where it is the
    # same), names, kinds), and the records
    parts: tuple[tuple[list[int], Callable | list[Callable], list[str], list[str]], ...]
    mine: list[dict[str, Any]]
    geometries: tuple[list, list, list]   # the staged Flat's geometry (as Flat has it)
    dall: list[int]                       # the DTensor entries, and their specs then:
    dspecs: list[Any]                     # a record is its spec's and its local shape's
    dindex: list[int]                     # the DTensors this rank stages a piece of,
    dguard: Callable[[list[torch.Tensor]], bool]   # whose local shapes and strides it checks


def _unchecked(tensors: list[torch.Tensor]) -> bool:
    return False   # a walk's pieces before their guard is made: never the last walk's


_NONE = _Pieces([], [], [], [], [], [], (), [], ([], [], []), [], [], [], _unchecked)


class ShardMemo:
    """What the last state submit of a rank found: its walk (:class:`WalkMemo`),
    and per entry its record. A record is a function of the entry's name, kind,
    shape and dtype as the walk saw them (its guard checked a reused part's just
    now), its tensor's type and, for a DTensor, its spec (mesh and placements: the
    same object while the DTensor is) and its local tensor's shape: an entry whose
    all of these are as the last submit's keeps its record. The walk's entries are
    new tuples at every submit (a kept part holds no tensor), so entries are
    matched by name. A piece is the local tensor (a plain tensor: itself) taken
    from the state at each submit and copied live: one given other memory in
    place (``set_``) is copied from there. When every entry is the last walk's,
    that is checked in a few C-level passes."""

    def __init__(self) -> None:
        self.walk = WalkMemo(tensor_guard)
        self.last = _NONE   # replaced whole: a submit from another thread sees one walk's

    def pieces(self, flat: Flat, rank: int) -> tuple[Flat, list[dict[str, Any]]]:
        """This rank's pieces of ``flat``'s tensors, as a Flat of its tree, and their records.
        A piece has its DTensor's name, dtype and rank: checked by the walk."""
        last, is_ = self.last, operator.is_
        entries: list[tuple] = [*flat.params, *flat.buffers, *flat.rest]
        tensors = list(map(_TENSOR, entries))
        names = list(map(_NAME, entries))
        types = list(map(type, tensors))
        assert flat.geometry is not None   # a walk's Flat has it
        geometry = [*flat.geometry[0], *flat.geometry[1], *flat.geometry[2]]
        at = tensors.__getitem__
        if names == last.names and types == last.types and geometry == last.geometry \
                and all(map(is_, map(_SPEC, map(at, last.dall)), last.dspecs)) \
                and last.dguard(list(map(_LOCAL, map(at, last.dindex)))):
            return self._flat(flat, last, tensors)
        index = {n: i for i, n in enumerate(last.names)}
        dtensor = _dtensor_type() or ()   # loaded: the state holds one
        now = _Pieces(names, types, geometry, [], [], [], (), [], ([], [], []), [], [], [],
                      _unchecked)
        locals_: list[torch.Tensor] = []
        n_params, n_buffers = len(flat.params), len(flat.params) + len(flat.buffers)
        for i, (name, t, geo) in enumerate(zip(names, tensors, geometry)):
            kind, to = ("param", 0) if i < n_params else ("buffer", 1) if i < n_buffers \
                else (entries[i][0], 2)
            is_dtensor = isinstance(t, dtensor)
            source: torch.Tensor = _LOCAL(t) if is_dtensor else t
            spec = t._spec if is_dtensor else None
            j = index.get(name)
            record = last.records[j] if j is not None else None
            if j is None or last.types[j] is not type(t) or last.geometry[j] != geo \
                    or last.specs[j] is not spec \
                    or record is not None and list(source.shape) != record["lengths"]:
                piece = _piece(name, kind, t, rank)
                record = None if piece is None else piece[1]
            now.specs.append(spec)
            now.records.append(record)
            if is_dtensor:
                now.dall.append(i)
                now.dspecs.append(spec)
            if record is None:
                continue
            now.staged.append((to, kind, name, i, is_dtensor))
            now.geometries[to].append((kind, source.shape, source.dtype))
            if is_dtensor:
                now.dindex.append(i)
                locals_.append(source)
        parts = tuple(([i for t, _, _, i, _ in now.staged if t == to],
                       _uniform([_LOCAL if d else _itself for t, _, _, _, d in now.staged
                                 if t == to]),
                       [n for t, _, n, _, _ in now.staged if t == to],
                       [k for t, k, _, _, _ in now.staged if t == to]) for to in range(3))
        self.last = now._replace(dguard=tensor_guard(locals_), parts=parts,
                                 mine=[r for r in now.records if r is not None])
        return self._flat(flat, self.last, tensors)

    @staticmethod
    def _flat(flat: Flat, p: _Pieces, tensors: list[torch.Tensor]
              ) -> tuple[Flat, list[dict[str, Any]]]:
        """The staged Flat of ``p``'s pieces, each taken from this submit's ``tensors``
        (a DTensor's local tensor), in C-level passes."""
        at, staged = tensors.__getitem__, cast("list[list[Any]]", [])
        for to, (index, take, names, kinds) in enumerate(p.parts):
            got = map(at, index)
            pieces = map(take, got) if callable(take) else (f(t) for f, t in zip(take, got))
            staged.append(list(zip(kinds, names, pieces)) if to == 2 else list(zip(names, pieces)))
        return Flat(staged[0], staged[1], staged[2], flat.tree, flat.structural_hash,
                    flat.kinds, flat.checked,
                    cast("tuple[list, list, list]", tuple(map(list, p.geometries)))
                    ), list(p.mine)


@torch.no_grad()
def _state_plan(state: Mapping, rank: int, memo: ShardMemo
                ) -> tuple[Flat, list[dict[str, Any]], dict[str, Any]]:
    """What this rank stages of a state mapping: its pieces of every tensor (DTensor
    shards, and the plain tensors on rank 0) as a flattened state (one copy pass),
    their records in file order, and the description for the manifest.
    ``memo``: what the last call found (its walk, its pieces), kept while it holds.

    The description lists the model's parameter and buffer names (the module
    that keeps its own names: ``consolidate`` writes it) and, per optimizer,
    its parameters' entry names in ``param_groups`` order (None when one is in
    no module of the state), so a restore maps its state by name.
    """
    flat = flatten(state, memo.walk, sharded=True)
    mine, records = memo.pieces(flat, rank)
    pnames = param_names(state)
    optimizers = {}
    for where, opt in find(state, torch.optim.Optimizer):
        listed = list(map(pnames.get, map(id, [p for g in opt.param_groups
                                                for p in g["params"]])))
        optimizers[where] = None if None in listed else listed
    first = operator.itemgetter(0)
    desc = {"params": list(map(first, flat.params)), "buffers": list(map(first, flat.buffers)),
            "optimizer": None, "state": {"optimizers": optimizers}}
    return mine, records, desc


def _holds_dtensor(state: Mapping) -> bool:
    """Whether a tensor of ``state`` (bare, a module's, an optimizer's parameter) is a
    DTensor. Only such a state is saved as pieces of global tensors, the same
    structure on every rank; any other state is each rank's own file (as the HF
    Trainer's DDP save has it: the model on the main process, RNG states on all)."""
    for _, v in find(state, (nn.Module, torch.optim.Optimizer, torch.Tensor)):  # one walk
        if isinstance(v, nn.Module):
            if _is_sharded(v):
                return True
        elif isinstance(v, torch.optim.Optimizer):
            if any(_is_dtensor(p) for g in v.param_groups for p in g["params"]):
                return True
        elif _is_dtensor(v):
            return True
    return False

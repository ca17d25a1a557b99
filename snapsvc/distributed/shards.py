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
    """One walk's entries and what this rank stages of each (see :class:`ShardMemo`)."""

    tensors: list[torch.Tensor]           # the flattened state's, in file order
    names: list[str]                      # their entry names,
    geometry: list[tuple]                 # and (kind, shape, dtype) as the walk saw them
    sources: list[torch.Tensor]           # each one's local tensor then (a plain tensor: itself)
    pieces: list[tuple[torch.Tensor, dict[str, Any]] | None]   # (piece, record), or None
    dtensors: list[Any]                   # the DTensors this rank stages a piece of,
    dsources: list[torch.Tensor]          # and their local tensors then (those pieces),
    dguard: Callable[[list[torch.Tensor]], bool]   # whose shapes and strides it checks
    staged: tuple[list, ...]   # params, buffers, rest, their geometry (as Flat has them), records


def _unchecked(tensors: list[torch.Tensor]) -> bool:
    return False   # a walk's pieces before their guard is made: never the last walk's


_NONE = _Pieces([], [], [], [], [], [], [], _unchecked, ([], [], [], [], [], [], []))


class ShardMemo:
    """What the last state submit of a rank found: its walk (:class:`WalkMemo`),
    and per entry its piece. An entry of the same name, kind, shape and dtype as
    the walk saw them (its guard checked a reused part's just now) whose tensor is
    the same object keeps its piece and record while a DTensor's local tensor is
    still the same object of the same shape (FSDP2 puts a new one in the same
    DTensor on ``load_state_dict()`` and ``.to()``). The walk's entries are new
    tuples at every submit (a kept part holds no tensor), so entries are matched
    by name, not by tuple. A piece is that local tensor itself, copied live: one
    given other memory in place (``set_``) is copied from there. When every entry
    is the last walk's, that is checked in a few C-level passes."""

    def __init__(self) -> None:
        self.walk = WalkMemo(tensor_guard)
        self.last = _NONE   # replaced whole: a submit from another thread sees one walk's

    def pieces(self, flat: Flat, rank: int) -> tuple[Flat, list[dict[str, Any]]]:
        """This rank's pieces of ``flat``'s tensors, as a Flat of its tree, and their records.
        A piece has its DTensor's name, dtype and rank: checked by the walk."""
        last, is_ = self.last, operator.is_
        entries: list[tuple] = [*flat.params, *flat.buffers, *flat.rest]
        tensors = [e[-1] for e in entries]
        names = [e[-2] for e in entries]
        assert flat.geometry is not None   # a walk's Flat has it
        geometry = [*flat.geometry[0], *flat.geometry[1], *flat.geometry[2]]
        if len(tensors) == len(last.tensors) and all(map(is_, tensors, last.tensors)) \
                and names == last.names and geometry == last.geometry \
                and all(map(is_, map(_LOCAL, last.dtensors), last.dsources)) \
                and last.dguard(last.dsources):
            return self._flat(flat, last)
        index = {n: i for i, n in enumerate(last.names)}
        dtensor = _dtensor_type() or ()   # loaded: the state holds one
        now = _Pieces(tensors, names, geometry, [], [], [], [], _unchecked,
                      ([], [], [], [], [], [], []))
        *staged, records = now.staged
        n_params, n_buffers = len(flat.params), len(flat.params) + len(flat.buffers)
        for i, (name, t, geo) in enumerate(zip(names, tensors, geometry)):
            kind, to = ("param", 0) if i < n_params else ("buffer", 1) if i < n_buffers \
                else (entries[i][0], 2)
            is_dtensor = isinstance(t, dtensor)
            source = _LOCAL(t) if is_dtensor else t
            j = index.get(name)
            piece = last.pieces[j] if j is not None else None
            if j is None or last.tensors[j] is not t or last.geometry[j] != geo \
                    or last.sources[j] is not source \
                    or piece is not None and list(source.shape) != piece[1]["lengths"]:
                piece = _piece(name, kind, t, rank)
            now.sources.append(source)
            now.pieces.append(piece)
            if piece is None:
                continue
            staged[to].append((kind, name, piece[0]) if to == 2 else (name, piece[0]))
            staged[to + 3].append((kind, piece[0].shape, piece[0].dtype))
            records.append(piece[1])
            if is_dtensor:
                now.dtensors.append(t)
                now.dsources.append(source)
        self.last = now._replace(dguard=tensor_guard(now.dsources))
        return self._flat(flat, now)

    @staticmethod
    def _flat(flat: Flat, pieces: _Pieces) -> tuple[Flat, list[dict[str, Any]]]:
        params, buffers, rest, *geometry, records = map(list, pieces.staged)
        return Flat(params, buffers, rest, flat.tree, flat.structural_hash, flat.kinds,
                    flat.checked, cast("tuple[list, list, list]", tuple(geometry))), records


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
        listed = [pnames.get(id(p)) for g in opt.param_groups for p in g["params"]]
        optimizers[where] = None if None in listed else listed
    desc = {"params": [n for n, _ in flat.params], "buffers": [n for n, _ in flat.buffers],
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

"""``restore_distributed``: load a multi-rank checkpoint into this rank's model,
or into a mapping of live objects.

A plain checkpoint is restored rank by rank; a sharded one (a sharded model,
or any state mapping) is resharded to this rank's placements at any world
size, reading only the entries it needs. Everything is checked before
anything changes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any, cast
import torch
from torch import nn

from ..files.checkpoint import LoadReport, model_tensors, persistent_buffers
from ..errors import ArchitectureMismatchError, FormatError, ShapeMismatchError, \
    StrictLoadError, WorldSizeMismatchError
from ..files.meta import read_meta
from ..format.protocol import ObjectNode, TensorRef
from ..state.resume import optimizer_state_dict, restore
from ..state.readback import rebuild, restore_tree
from ..state.paths import param_names, path_name
from .coord import _rank_and_world
from .manifest import _committed
from .shards import _dtensor_type, _is_dtensor
from .pieces import _PieceReader, _globals, _region, _user_extra
from .replicas.ramsteps import _manifest, ram_step
from .tier import LocalStep, open_step
from ..remote.store import is_url

__all__ = ["restore_distributed"]

log = logging.getLogger("snapsvc")


def restore_distributed(path: str | os.PathLike[str], model: nn.Module | Mapping[Any, Any],
                        optimizer: torch.optim.Optimizer | None = None,
                        process_group: Any = None, *, strict: bool = False,
                        verify: bool = True, timeout: float | None = None,
                        remote: str | os.PathLike[str] | None = None) -> LoadReport:
    """Restore this rank's part of a complete multi-rank checkpoint.

    ``restore_distributed(path, state_mapping, process_group=None, *, strict,
    verify)``: a checkpoint submitted as a state mapping, into a mapping of
    live objects, as :func:`snapsvc.restore` does (see :func:`_restore_state`).

    ``path`` is a ``step_<N>`` directory or a remote step's URL
    (``s3://bucket/run/step_<N>``; as :func:`latest_checkpoint` returns): from
    the remote tier, each rank fetches its own files, or for a sharded
    checkpoint the byte ranges it needs, with the same checks. Local: no
    collective is run; a rank that raises should stop the job. Nothing in the model or optimizer changes unless every check
    passes. The report's ``epoch``, ``metrics`` and ``extra`` are this rank's
    (rank 0's for a rank the checkpoint did not have).

    A checkpoint saved from a sharded model (FSDP2, DTensor) restores at any
    world size and mesh, into a sharded model or a plain one: each DTensor
    gets the block of the global tensor its placements give this rank, a
    plain tensor the whole global tensor. Only the entries overlapping those
    blocks are read (byte ranges of the rank files, from the manifest), each
    checked against its recorded CRC-32 with ``verify``; the optimizer state
    (``optimizer``) is resharded like its parameters.

    Any other checkpoint restores only at the world size that saved it
    (``dist.get_world_size(process_group)``, 1 when torch.distributed is not
    initialized; else :class:`WorldSizeMismatchError`): this rank's metadata
    must record the size and CRC-32 the manifest committed, and
    :func:`snapsvc.restore` loads the file, checking both while it reads
    (always: ``verify`` applies to the sharded path's ranged reads).

    ``timeout``: from the remote tier, the deadline of each read
    (:data:`snapsvc.remote.fetch.TIMEOUT` by default).

    A local step whose rank files are not all on disk (a memory-only step, or a
    lost node's files) is read from RAM: each rank file this rank needs comes
    from its first good source, in the order its own RAM, a peer's replica
    (sent over a gloo group), the disk, and last ``remote`` (the remote tier as
    given to ``DistributedSnapshotWriter``: a URL, fetched within ``timeout``, or
    a mounted directory), its copy of the same step. Each copy is checked (its
    CRC-32s, and that it is the one the manifest committed) before it is used: a
    bad one is logged with the rank and the source and skipped for the next.
    This is a collective: every rank must call it (see docs/distributed.md).
    """
    # (path, state_mapping, process_group): the third argument is the group
    group = optimizer if isinstance(model, Mapping) and optimizer is not None else process_group
    if is_url(path):
        return _restore(open_step(path, timeout), model, optimizer, process_group, strict,
                        verify)
    # a step not wholly on disk: each needed rank file from its first live copy (RAM)
    with ram_step(os.fspath(path), group, _sharded(os.fspath(path)), remote,
                  timeout) as in_ram:
        step = open_step(path, timeout) if in_ram is None else LocalStep(in_ram)
        return _restore(step, model, optimizer, process_group, strict, verify)


def _sharded(path: str) -> bool:
    """The step at ``path`` is read by byte ranges from every rank's file."""
    m = _manifest(path)
    return m is not None and m.sharded is not None


def _restore(step: LocalStep, model: nn.Module | Mapping[Any, Any],
             optimizer: torch.optim.Optimizer | None, process_group: Any, strict: bool,
             verify: bool) -> LoadReport:
    m = step.manifest
    if isinstance(model, Mapping):   # (path, state_mapping, process_group): the third is the group
        if isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("restore_distributed(path, state_mapping) takes optimizers inside "
                            "the mapping")
        if optimizer is not None and process_group is not None:
            raise TypeError("restore_distributed(path, state_mapping, process_group) takes "
                            "one process group")
        rank, world = _rank_and_world(process_group if optimizer is None else optimizer)
        optimizer = None
        if m.sharded is not None:
            return _restore_state(step, model, rank, strict, verify)
        # no DTensor in it: each rank's state is its own file, read rank by rank below
    else:
        rank, world = _rank_and_world(process_group)
        if m.sharded is not None:
            return _restore_sharded(step, model, optimizer, rank, strict, verify)
    if m.world_size != world:
        raise WorldSizeMismatchError(
            f"{m.path}: checkpoint was saved by {m.world_size} ranks but the current world size "
            f"is {world}; a checkpoint without DTensors is restored rank by rank from its "
            "own file",
            saved=m.world_size, current=world)
    entry = m.ranks[rank]
    with step.rank_file(entry.file) as file:
        # restore() reads each file once, checking it against its .meta; the .meta
        # must record what the manifest committed, so the file is the committed one.
        meta = read_meta(file)
        for role, name, in_meta, in_manifest in _committed(entry, meta):
            p = os.path.join(os.path.dirname(file), name)
            if role == "optim" and optimizer is None:
                continue   # not read
            if in_meta != in_manifest:
                raise FormatError(f"its metadata records size {in_meta[0]} and CRC-32 "
                                  f"{in_meta[1]}, the manifest {in_manifest[0]} and "
                                  f"{in_manifest[1]}: the file changed after the checkpoint "
                                  "was committed", path=p)
        return restore(file, model, optimizer, strict=strict)


def _restore_sharded(step: LocalStep, model: nn.Module,
                     optimizer: torch.optim.Optimizer | None, rank: int, strict: bool,
                     verify: bool) -> LoadReport:
    m = step.manifest
    saved = _globals(m)
    # read before anything changes: a corrupt metadata file must leave the model as it was
    meta = step.meta(m.ranks[min(rank, m.world_size - 1)].file)
    report = LoadReport()
    model_kinds = ("param", "buffer")
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    optim_tensors: dict[str, torch.Tensor] = {}
    named = dict(model.named_parameters())
    with step.pieces(verify) as reader:
        wanted: list[tuple[torch.Tensor, Any, tuple[list[int], list[int]]]] = []
        for name, t in model_tensors(model):
            g = saved.get(name)
            if g is None or g.kind not in model_kinds:
                report.missing.append(name)
                continue
            if list(t.shape) != g.shape:
                raise ShapeMismatchError(f"{m.path}: entry {name!r}: checkpoint shape {g.shape} "
                                         f"but model shape {list(t.shape)}")
            report.loaded.append(name)
            region = _region(t)
            if region is not None:
                wanted.append((t, g, region))
        have = set(report.loaded) | set(report.missing)
        report.skipped = [n for n, g in saved.items() if g.kind in model_kinds and n not in have]
        if strict and (report.skipped or report.missing):
            raise StrictLoadError(
                f"{m.path}: strict load: {len(report.skipped)} entries not in the model "
                f"{report.skipped[:5]}, {len(report.missing)} model tensors not in the checkpoint "
                f"{report.missing[:5]}; pass strict=False to load the overlap")
        reader.prefetch([(g, *region) for _, g, region in wanted])
        copies.extend((t, reader.assemble(g, *region)) for t, g, region in wanted)
        optim_sd = None
        if optimizer is not None:
            info = (m.sharded or {}).get("optimizer")
            if not info:
                raise FormatError("no optimizer state was saved with this checkpoint "
                                  "(submit(..., optimizer=opt) saves it)", path=m.path)
            states = [(name, g, named.get(name.rpartition(":")[0])) for name, g in saved.items()
                      if g.kind == "optim"]
            blocks = [(name, g, p, _optim_region(p, g)) for name, g, p in states]
            reader.prefetch([(g, *region) for _, g, _, region in blocks if region is not None])
            for name, g, p, region in blocks:
                if region is None:
                    continue
                if p is not None and _is_dtensor(p) and list(p.shape) == g.shape:
                    local = reader.assemble(g, *region).to(p.to_local().device)
                    optim_tensors[name] = _dtensor_type().from_local(
                        local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                        stride=p.stride())
                else:
                    optim_tensors[name] = reader.assemble(g, *region)
            optim_sd = optimizer_state_dict(optimizer, model, optim_tensors, info, m.path)
    with torch.no_grad():   # in place: the optimizer keeps its references
        for dst, src in copies:
            (dst.to_local() if _is_dtensor(dst) else dst).copy_(src)
    if optimizer is not None and optim_sd is not None:   # optim_sd: only with an optimizer
        optimizer.load_state_dict(optim_sd)
    report.epoch, report.metrics = meta.epoch, dict(meta.metrics)
    report.extra = _user_extra(meta.extra)
    return report


def _optim_region(p: torch.Tensor | None, g: Any) -> tuple[list[int], list[int]] | None:
    """The block of optimizer state ``g`` to read for its parameter ``p``: a state shaped
    like a sharded parameter is sharded like it (None: this rank holds none of it)."""
    if p is not None and _is_dtensor(p) and list(p.shape) == g.shape:
        return _region(p)
    return [0] * len(g.shape), g.shape


def _restore_state(step: LocalStep, target: Mapping, rank: int, strict: bool,
                   verify: bool) -> LoadReport:
    """A state checkpoint into a mapping of live objects, at any world size.

    The saved tree is rank 0's (each rank's non-tensor leaves are in its own
    ``.meta``; the manifest's ``differs`` lists the ranks whose differed).
    Each saved tensor is read for the live object it lands in: a DTensor
    (a module's parameter or buffer, a tensor in the mapping, an optimizer's
    state shaped like its parameter) gets the block its placements give this
    rank, anything else the whole global tensor. An optimizer's state is
    mapped to its parameters by their names in the state's modules, so its
    parameters may be sharded differently, or listed in another order.
    Then :func:`snapsvc.state.readback.restore_tree` checks it all and applies it.
    """
    m = step.manifest
    info = (m.sharded or {}).get("state")
    if info is None:
        raise FormatError("not saved from a state mapping (it was submit(model, step)): use "
                          "restore_distributed(path, model, optimizer)", path=m.path)
    meta = step.meta(m.ranks[0].file)
    if meta.state is None:
        raise FormatError("rank 0's metadata holds no state tree", path=m.path)
    if rank in info.get("differs", ()):
        log.warning("%s: rank %d saved non-tensor values that differ from rank 0's; the "
                    "report's state holds rank 0's (this rank's are in its own .meta)",
                    m.path, rank)
    resolve = _Resolve(info.get("optimizers") or {}, param_names(target), m.path)
    tree = resolve.match(target, meta.state, ())
    saved = _globals(m)
    unknown = sorted(set(saved) - resolve.names)
    if unknown:
        raise FormatError(f"entries {unknown[:3]} are not in rank 0's state tree: the "
                          "metadata does not belong to this checkpoint", path=m.path)
    entries: dict[str, torch.Tensor] = {}
    with step.pieces(verify) as reader:
        names = sorted(resolve.names & set(saved))
        reader.prefetch([(saved[n], *_wanted(saved[n], resolve.targets.get(n))) for n in names])
        for name in names:
            entries[name] = _read_for(reader, saved[name], resolve.targets.get(name))
    full, _ = rebuild(tree, entries, m.path)
    return restore_tree(m.path, meta, full, target, strict=strict)


def _wanted(g: Any, live: torch.Tensor | None) -> tuple[list[int], list[int]]:
    """The block of saved tensor ``g`` that :func:`_read_for` reads for ``live``."""
    if live is None or not _is_dtensor(live) or list(live.shape) != g.shape:
        return [0] * len(g.shape), g.shape
    # None: this rank is not in the tensor's mesh, it holds nothing of it
    return _region(live) or ([0] * len(g.shape), [0] * len(g.shape))


def _read_for(reader: _PieceReader, g: Any, live: torch.Tensor | None) -> torch.Tensor:
    """Saved tensor ``g`` read for ``live``: as a DTensor like it, else whole."""
    local = reader.assemble(g, *_wanted(g, live))
    if live is None or not _is_dtensor(live) or list(live.shape) != g.shape:
        return local
    return cast(torch.Tensor, _dtensor_type().from_local(
        local.to(live.to_local().device), live.device_mesh, live.placements, run_check=False,
        shape=live.shape, stride=live.stride()))


class _Resolve:
    """Walks the live mapping beside the saved tree: which live tensor each saved
    tensor lands in, and each optimizer's state renumbered by parameter name."""

    def __init__(self, saved_params: dict[str, Any], live_names: dict[int, str],
                 where: str) -> None:
        self.saved_params = saved_params   # optimizer path -> its params' names, or None
        self.live_names = live_names
        self.where = where
        self.targets: dict[str, torch.Tensor] = {}
        self.names: set[str] = set()       # every tensor entry the tree names

    def match(self, live: Any, node: Any, path: tuple) -> Any:
        """``node`` (a saved subtree), for ``live``; the optimizers' renumbered."""
        t = type(node)
        if t is TensorRef:
            self.names.add(node.name)
            if isinstance(live, torch.Tensor):
                self.targets[node.name] = live
            return node
        if t is ObjectNode:
            value = node.value
            if isinstance(live, torch.optim.Optimizer) and isinstance(value, dict):
                value = self.by_name(live, value, path)
                params = [p for g in live.param_groups for p in g["params"]]
                saved_state = value.get("state")
                state = saved_state if isinstance(saved_state, dict) else {}
                live = {"state": {i: dict.fromkeys(keys, params[i]) for i, keys in state.items()
                                  if type(i) is int and 0 <= i < len(params)
                                  and isinstance(keys, dict)}}
            elif isinstance(live, nn.Module):
                live = {**dict(live.named_parameters()), **dict(persistent_buffers(live))}
            elif not isinstance(live, (Mapping, list, tuple)):
                live = None   # a stateful object: its tensors come back whole
            return ObjectNode(node.kind, node.cls, self.match(live, value, path))
        if t is dict:
            get = live.get if isinstance(live, Mapping) else (lambda k: None)
            return {k: self.match(get(k), v, path + (k,)) for k, v in node.items()}
        if t in (list, tuple):
            same = isinstance(live, (list, tuple)) and len(live) == len(node)
            return t(self.match(live[i] if same else None, v, path + (i,))
                     for i, v in enumerate(node))
        return node

    def by_name(self, live: torch.optim.Optimizer, saved: dict[str, Any], path: tuple
                ) -> dict[str, Any]:
        """``saved`` (a state_dict) renumbered for ``live``'s parameters by name, when
        every parameter of both has one; else as saved (by position)."""
        names = self.saved_params.get(path_name(path))
        live_groups = [[self.live_names.get(id(p)) for p in g["params"]]
                       for g in live.param_groups]
        groups, state = saved.get("param_groups"), saved.get("state")
        if names is None or any(None in g for g in live_groups) \
                or not isinstance(groups, list) or not isinstance(state, dict):
            return saved
        try:
            saved_groups = [[names[i] for i in g["params"]] for g in groups]
        except (TypeError, KeyError, IndexError):
            raise FormatError(f"optimizer at {path_name(path)!r}: param_groups do not match the "
                              "parameter names recorded in the manifest", path=self.where) from None
        if len(saved_groups) != len(live_groups) or any(
                sorted(a) != sorted(cast("list[str]", b))   # None: returned above
                for a, b in zip(saved_groups, live_groups)):
            raise ArchitectureMismatchError(
                f"{self.where}: the optimizer at {path_name(path)!r} has param groups of "
                f"{[len(g) for g in live_groups]} parameters, the checkpoint's "
                f"{[len(g) for g in saved_groups]}, or other parameters in them; build it "
                "over the same parameters")
        index = {n: i for i, n in enumerate(n for g in live_groups for n in g)}
        renumbered = {}
        for i, value in state.items():
            if type(i) is not int or not 0 <= i < len(names):
                raise FormatError(f"optimizer at {path_name(path)!r}: state for parameter {i!r}, "
                                  "which it lacks", path=self.where)
            renumbered[index[names[i]]] = value
        start = 0
        new_groups = []
        for g, lg in zip(groups, live_groups):
            new_groups.append({**g, "params": list(range(start, start + len(lg)))})
            start += len(lg)
        return {**saved, "state": renumbered, "param_groups": new_groups}

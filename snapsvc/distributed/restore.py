"""``restore_distributed``: load a multi-rank checkpoint into this rank's model.

A plain checkpoint is restored rank by rank; a sharded one is resharded to
this rank's placements at any world size, reading only the entries it needs.
Everything is checked before anything changes.
"""

from __future__ import annotations

import os
from typing import Any
import torch
from torch import nn

from ..files.checkpoint import LoadReport, model_tensors
from ..errors import FormatError, ShapeMismatchError, StrictLoadError, WorldSizeMismatchError
from ..files.meta import read_meta
from ..state.resume import optimizer_state_dict, restore
from .coord import _rank_and_world
from .manifest import Manifest, read_manifest
from .shards import _dtensor_type, _is_dtensor
from .pieces import _PieceReader, _globals, _region, _sizes, _user_extra

__all__ = ["restore_distributed"]


def restore_distributed(path: str | os.PathLike[str], model: nn.Module,
                        optimizer: torch.optim.Optimizer | None = None,
                        process_group: Any = None, *, strict: bool = False,
                        verify: bool = True) -> LoadReport:
    """Restore this rank's part of a complete multi-rank checkpoint.

    ``path`` is a ``step_<N>`` directory (as :func:`latest_checkpoint`
    returns). Local: no collective is run; a rank that raises should stop
    the job. Nothing in the model or optimizer changes unless every check
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
    """
    m = read_manifest(path)
    rank, world = _rank_and_world(process_group)
    if m.sharded is not None:
        return _restore_sharded(m, model, optimizer, rank, strict, verify)
    if m.world_size != world:
        raise WorldSizeMismatchError(
            f"{m.path}: checkpoint was saved by {m.world_size} ranks but the current world size "
            f"is {world}; a checkpoint of a model that is not sharded (DTensor) is restored "
            "rank by rank from its own file",
            saved=m.world_size, current=world)
    entry = m.ranks[rank]
    file = os.path.join(m.path, entry.file)
    # restore() reads each file once, checking it against its .meta; the .meta
    # must record what the manifest committed, so the file is the committed one.
    meta = read_meta(file)
    records = [(file, (meta.size, meta.crc32), (entry.size, entry.crc32))]
    if optimizer is not None and entry.optim is not None:
        saved = meta.optimizer or {}
        records.append((os.path.join(m.path, entry.optim["file"]),
                        (saved.get("size"), saved.get("crc32")),
                        (entry.optim["size"], entry.optim["crc32"])))
    for p, in_meta, in_manifest in records:
        if in_meta != in_manifest:
            raise FormatError(f"its metadata records size {in_meta[0]} and CRC-32 {in_meta[1]}, "
                              f"the manifest {in_manifest[0]} and {in_manifest[1]}: the file "
                              "changed after the checkpoint was committed", path=p)
    return restore(file, model, optimizer, strict=strict)


def _restore_sharded(m: Manifest, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                     rank: int, strict: bool, verify: bool) -> LoadReport:
    saved = _globals(m)
    # read before anything changes: a corrupt metadata file must leave the model as it was
    meta = read_meta(os.path.join(m.path, m.ranks[min(rank, m.world_size - 1)].file))
    report = LoadReport()
    model_kinds = ("param", "buffer")
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    optim_tensors: dict[str, torch.Tensor] = {}
    named = dict(model.named_parameters())
    with _PieceReader(_sizes(m), verify) as reader:
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
                copies.append((t, reader.assemble(g, *region)))
        have = set(report.loaded) | set(report.missing)
        report.skipped = [n for n, g in saved.items() if g.kind in model_kinds and n not in have]
        if strict and (report.skipped or report.missing):
            raise StrictLoadError(
                f"{m.path}: strict load: {len(report.skipped)} entries not in the model "
                f"{report.skipped[:5]}, {len(report.missing)} model tensors not in the checkpoint "
                f"{report.missing[:5]}; pass strict=False to load the overlap")
        optim_sd = None
        if optimizer is not None:
            info = (m.sharded or {}).get("optimizer")
            if not info:
                raise FormatError("no optimizer state was saved with this checkpoint "
                                  "(submit(..., optimizer=opt) saves it)", path=m.path)
            for name, g in saved.items():
                if g.kind != "optim":
                    continue
                p = named.get(name.rpartition(":")[0])
                if p is not None and _is_dtensor(p) and list(p.shape) == g.shape:
                    region = _region(p)   # shaped like its parameter: sharded like it
                    if region is None:
                        continue
                    local = reader.assemble(g, *region).to(p.to_local().device)
                    optim_tensors[name] = _dtensor_type().from_local(
                        local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                        stride=p.stride())
                else:
                    optim_tensors[name] = reader.assemble(g, [0] * len(g.shape), g.shape)
            optim_sd = optimizer_state_dict(optimizer, model, optim_tensors, info, m.path)
    with torch.no_grad():   # in place: the optimizer keeps its references
        for dst, src in copies:
            (dst.to_local() if _is_dtensor(dst) else dst).copy_(src)
    if optim_sd is not None:
        optimizer.load_state_dict(optim_sd)
    report.epoch, report.metrics = meta.epoch, dict(meta.metrics)
    report.extra = _user_extra(meta.extra)
    return report

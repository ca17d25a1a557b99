"""``migrate_checkpoint``: a checkpoint rewritten under a renamed model's names.

Entries are matched by flodl's two passes. A snapsvc checkpoint (one with a
``.meta``) is migrated whole: the model file, its data file (tensors ``.fdl``
has no tag for, a bool buffer), the optimizer file, whose entries and param
groups name parameters (``"<param>:<state key>"``, see
:mod:`snapsvc.state.resume`), and the metadata, whose extra states are keyed
by module. It lives in ``state`` because the optimizer's naming is
:mod:`~snapsvc.state.resume`'s.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ..errors import FormatError
from ..files.checkpoint import Checkpoint, encode_to, model_tensors, persistent_buffers, read_checkpoint
from ..files.meta import Meta, meta_path, optim_path, read_meta, read_with_data, write_with_meta
from ..format import fdl
from ..format.streams import PathOrFile
from .resume import OPTIM_SEP, read_optim_file
from .tree import extra_states

__all__ = ["MigrateReport", "migrate_checkpoint"]


@dataclass
class MigrateReport:
    """How :func:`migrate_checkpoint` mapped old entries onto the model.

    A snapsvc checkpoint's extra states (``"<module>._extra_state"``) are
    listed too: they follow their module's renamed tensors.
    """

    unchanged: list[str] = field(default_factory=list)
    remapped: list[tuple[str, str]] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    def is_complete(self) -> bool:
        """True when nothing was dropped and nothing is missing."""
        return not self.dropped and not self.missing

    def __str__(self) -> str:
        lines = [f"Migration: {len(self.unchanged)} unchanged, {len(self.remapped)} remapped, "
                 f"{len(self.dropped)} dropped, {len(self.missing)} missing"
                 + (" (complete)" if self.is_complete() else " (incomplete)")]
        lines += [f"  remapped: {old} -> {new}" for old, new in self.remapped]
        lines += [f"  dropped:  {name}" for name in self.dropped]
        lines += [f"  missing:  {name}" for name in self.missing]
        return "\n".join(lines)


def migrate_checkpoint(src: PathOrFile, dst: PathOrFile, model: nn.Module) -> MigrateReport:
    """Rewrite a checkpoint under ``model``'s names (flodl's two passes).

    Pass 1 keeps entries whose name and shape match a model tensor. Pass 2
    gives each unmatched model tensor, in model order, the first unused entry
    (file order) of the same shape and dtype. The output is in model order
    with a zero structural hash.

    A ``src`` path with metadata (a ``submit(model, path, optimizer=)``) is
    checked while read and migrated with its companions: the data file, the
    optimizer state (keyed by parameter name, renamed the same way; that of a
    dropped parameter goes with it) and the extra states; ``dst`` must then
    be a path, and gets metadata of its own (``verify`` and ``restore`` take
    it). A nested-state checkpoint (``submit(state, path)``) is refused.
    """
    meta = _meta_of(src)
    if meta is None:  # a flodl file, or a file object: the .fdl alone
        entries = read_checkpoint(src).entries
        report, out, _ = _match(entries, model)
        encode_to(dst, out, bytes(fdl.HASH_LEN))
        return report
    src = os.fspath(src)  # type: ignore[arg-type]  # _meta_of returns None for a file object
    if meta.state is not None:
        raise FormatError("a nested-state checkpoint (submit(state, path)); migrate rewrites "
                          "a model checkpoint: snapsvc.load it, rename its keys, and submit "
                          "the result", path=src)
    report, out, names = _match(read_with_data(src, meta).entries, model)
    extra_state = _extra_states(meta.extra_state, model, names, report)
    has_companions = meta.optimizer or meta.data or meta.extra_state
    if not isinstance(dst, (str, os.PathLike)):
        if has_companions:
            raise TypeError(f"{src} has an optimizer file, data file or extra states beside "
                            "its .fdl, which a file object cannot take; give migrate a path")
        encode_to(dst, out, bytes(fdl.HASH_LEN))
        return report
    dst = os.fspath(dst)
    optim = None
    info = meta.optimizer
    if info:
        tensors, info = _rename_optimizer(read_optim_file(src, meta), info, names)
        optim = (optim_path(dst), tensors)
    buffers = {n for n, _ in persistent_buffers(model)}
    write_with_meta(dst, out, replace(
        meta, structural_hash=None, optimizer=info, extra_state=extra_state, data=None,
        buffers=[n for n, _ in out if n in buffers]), optim=optim)
    return report


def _meta_of(src: PathOrFile) -> Meta | None:
    """The metadata beside a ``src`` path, None for a file object or a path without."""
    if isinstance(src, (str, os.PathLike)) and os.path.exists(meta_path(src)):
        return read_meta(src)
    return None


def _match(entries: dict[str, torch.Tensor], model: nn.Module
           ) -> tuple[MigrateReport, list[tuple[str, torch.Tensor]], dict[str, str]]:
    """flodl's two passes: (report, entries under the model's names in model
    order, old name -> new name of each entry kept)."""
    targets = model_tensors(model)
    report = MigrateReport()
    chosen: dict[str, str] = {}  # model name -> checkpoint name
    for name, t in targets:
        old = entries.get(name)
        if old is not None and old.shape == t.shape:
            chosen[name] = name
            report.unchanged.append(name)
    used = set(chosen.values())
    for name, t in targets:
        if name in chosen:
            continue
        for old_name, old in entries.items():
            if old_name not in used and old.shape == t.shape and old.dtype == t.dtype:
                chosen[name] = old_name
                used.add(old_name)
                report.remapped.append((old_name, name))
                break
        else:
            report.missing.append(name)
    report.dropped = [n for n in entries if n not in used]
    out = [(name, entries[chosen[name]]) for name, _ in targets if name in chosen]
    return report, out, {old: new for new, old in chosen.items()}


def _rename_optimizer(tensors: Checkpoint, info: dict[str, Any], names: dict[str, str]
                      ) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
    """The optimizer file's entries and description under the new parameter
    names; the state of a parameter the migration drops is dropped with it."""
    out = []
    for entry, t in tensors.entries.items():
        name, _, key = entry.rpartition(OPTIM_SEP)
        if name in names:
            out.append((f"{names[name]}{OPTIM_SEP}{key}", t))
    groups = [{**g, "params": [names[n] for n in g["params"] if n in names]}
              for g in info["groups"]]
    scalars = {names[n]: s for n, s in info["scalars"].items() if n in names}
    kept = {k: v for k, v in info.items() if k not in ("file", "size", "crc32", "entries")}
    return out, {**kept, "groups": groups, "scalars": scalars}


_EXTRA = "_extra_state"


def _extra_states(saved: dict[str, Any] | None, model: nn.Module, names: dict[str, str],
                  report: MigrateReport) -> dict[str, Any] | None:
    """``saved`` extra states under the new module names: a module whose
    tensors (its own or its submodules') all moved to one new module takes
    its extra state there."""
    if not saved:
        return saved
    moves: dict[str, set[str]] = {}  # old module -> where its tensors went
    for old, new in names.items():
        o, n = old.split(".")[:-1], new.split(".")[:-1]
        moves.setdefault(".".join(o), set()).add(".".join(n))
        while o and n and o[-1] == n[-1]:  # encoder.lin -> enc.lin: encoder -> enc too
            o, n = o[:-1], n[:-1]
            moves.setdefault(".".join(o), set()).add(".".join(n))
    live = {key for key, _ in extra_states(model)}
    out: dict[str, Any] = {}
    for key, value in saved.items():
        module = key[: -len(_EXTRA)].rstrip(".")
        to = moves.get(module, {module})
        new = f"{next(iter(to))}.{_EXTRA}".lstrip(".") if len(to) == 1 else ""
        if new not in live:
            report.dropped.append(key)
            continue
        out[new] = value
        if new == key:
            report.unchanged.append(key)
        else:
            report.remapped.append((key, new))
    report.missing += [key for key in live if key not in out]
    return out or None

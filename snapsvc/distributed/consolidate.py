"""``consolidate``: a sharded checkpoint's full, unsharded model as one ``.fdl``
(or ``.safetensors`` / ``.pt``, the model's tensors only).
"""

from __future__ import annotations

import logging
import math
import os
import torch

from ..files.checkpoint import layout_hash
from ..errors import FormatError
from ..files.convert import TensorFile, file_format, write_tensors
from ..files.meta import Meta, optim_path, read_meta, write_with_meta
from ..files.tensors import Progress, _no_progress
from .manifest import read_manifest
from .pieces import _PieceReader, _globals, _sizes, _user_extra

__all__ = ["consolidate"]

log = logging.getLogger("snapsvc")


def consolidate(step: str | os.PathLike[str], dst: str | os.PathLike[str], *,
                compress_level: int | None = None, progress: Progress | None = None) -> str:
    """Write a sharded checkpoint's full, unsharded model as one file, in the format
    ``dst``'s suffix names.

    ``step`` is a complete ``step_<N>`` directory saved from a sharded model
    (FSDP2, DTensor), or from a state mapping (then its model: the module
    under ``"model"``, or the only top-level module; a state without one, as
    ``SnapsvcStorageWriter`` saves it, gives every tensor of the state under
    its entry name, the key path joined with ``/``). ``dst`` gets the global
    tensors under the model's own parameter and buffer names (gzip on
    ``.gz``), its ``.meta`` (rank 0's epoch, metrics and extra), and, when the
    optimizer was saved with ``submit(model, step, optimizer=)``, the
    optimizer file beside it (``x.optim.fdl``), so :func:`snapsvc.restore`
    loads it into a plain model and optimizer. Every piece is checked against
    the manifest's CRC-32 first. Holds the whole model in memory. Returns
    ``dst``'s absolute path.

    ``.safetensors`` and ``.pt`` (``.pth``) get the model's tensors only, as
    :func:`snapsvc.convert_file` writes them (the structural hash in
    ``.safetensors``' metadata); the optimizer state, epoch, metrics and extra
    are not written, and a warning says so. Any other suffix is a
    ``ValueError`` before anything is read. ``progress(phase, done, total)`` is
    told the bytes assembled ("reading") and written ("writing").
    """
    progress = progress or _no_progress
    kind = file_format(dst)   # an unknown suffix: refused before any work
    m = read_manifest(step)
    if m.sharded is None:
        raise ValueError(f"{m.path} was not saved from a sharded model: each rank<r> file "
                         "already holds that rank's whole model (snapsvc.restore reads it)")
    saved = _globals(m)
    model = m.sharded["params"] or m.sharded["buffers"]
    if not model and "state" not in m.sharded:
        raise ValueError(f"{m.path}: the saved model has no parameters or buffers")
    # a state without a model (a DCP save): every tensor of it, under its entry name
    names = m.sharded["params"] if model else list(saved)
    info = m.sharded.get("optimizer")
    wanted = names + m.sharded["buffers"] + (
        [n for n, g in saved.items() if g.kind == "optim"] if info else [])
    total = sum(math.prod(g.shape) * g.dtype.itemsize for n, g in saved.items() if n in wanted)
    done = 0

    def whole(names: list[str]) -> list[tuple[str, torch.Tensor]]:
        nonlocal done
        missing = [n for n in names if n not in saved]
        if missing:
            raise FormatError(f"no pieces of {missing[:5]} in any rank's file", path=m.path)
        out = []
        for n in names:
            g = saved[n]
            out.append((n, reader.assemble(g, [0] * len(g.shape), g.shape)))
            done += math.prod(g.shape) * g.dtype.itemsize
            progress("reading", done, total)
        return out

    dst = os.path.abspath(os.fspath(dst))
    with _PieceReader(_sizes(m), True) as reader:
        params, buffers = whole(names), whole(m.sharded["buffers"])
        optim = whole([n for n, g in saved.items() if g.kind == "optim"]) if info else None
    meta0 = read_meta(os.path.join(m.path, m.ranks[0].file))
    if kind != "fdl":
        log.warning("%s: a .%s file holds the model's tensors only; the optimizer state, "
                    "epoch, metrics and extra are kept in .fdl only", dst, kind)
        write_tensors(dst, TensorFile(params + buffers, layout_hash(params, buffers)),
                      progress=progress)
        return dst
    meta = Meta(buffers=[n for n, _ in buffers], epoch=int(m.epoch or 0), metrics=m.metrics,
                structural_hash=layout_hash(params, buffers), extra=_user_extra(meta0.extra),
                optimizer=info)
    progress("writing", 0, total)
    write_with_meta(dst, params + buffers, meta, compress_level=compress_level,
                    optim=None if optim is None else (optim_path(dst), optim))
    progress("writing", total, total)
    return dst

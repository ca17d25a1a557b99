"""``ModelSnapshot`` and ``snapshot_cpu``: a model's state, on the CPU, in shared memory.

Python port of flodl's ``graph/snapshot.rs`` (``shared/seed``). The tensors of
a snapshot are views into one flat shared-memory storage, so a snapshot
pickles through ``torch.multiprocessing`` queues by handle, not by value.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import BinaryIO, Mapping

import torch
from torch import nn

from ..errors import EncodeError, FormatError, UnsupportedStateError
from ..files.checkpoint import layout_hash, persistent_buffers
from ..files.meta import Meta, read_meta, read_with_data, write_with_meta
from ..format import datafile, fdl
from ..format.layout import Layout
from . import staging

__all__ = ["ModelSnapshot", "snapshot_cpu", "load_snapshot", "model_sources", "as_metrics"]


@dataclass
class ModelSnapshot:
    """A frozen copy of a model's state with every tensor on the CPU."""

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    metrics: dict[str, float] = field(default_factory=dict)
    epoch: int = 0

    def entries(self) -> list[tuple[str, torch.Tensor]]:
        """File order: parameters, then buffers."""
        return list(self.params.items()) + list(self.buffers.items())

    def save(self, fileobj: BinaryIO) -> None:
        """Write the ``.fdl`` stream to a binary writer, with a zero hash (as flodl does)."""
        fdl.encode(fileobj, self.entries())

    def save_file(self, path: str | os.PathLike[str], *, compress_level: int | None = None) -> None:
        """Write durably to ``path`` (gzip on ``.gz``; a bool buffer, say, to its data
        file), then its metadata."""
        write_with_meta(path, self.entries(),
                        Meta(buffers=list(self.buffers), epoch=self.epoch,
                             metrics=dict(self.metrics)),
                        compress_level=compress_level)


def model_sources(model: nn.Module) -> tuple[list[tuple[str, torch.Tensor]],
                                               list[tuple[str, torch.Tensor]]]:
    """(params, persistent buffers) of ``model``, params detached from autograd."""
    params = [(name, p.detach()) for name, p in model.named_parameters()]
    return params, list(persistent_buffers(model))


def as_metrics(metrics: Mapping[str, float] | None) -> dict[str, float]:
    """``metrics`` as the metadata keeps them: str keys, float values (a
    1-element tensor or numpy scalar converts); anything else is refused."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise UnsupportedStateError(f"metrics must be a mapping of names to numbers, not a "
                                    f"{type(metrics).__name__}", path="metrics")
    out = {}
    for k, v in metrics.items():
        try:
            out[str(k)] = float(v)
        except TypeError:
            raise UnsupportedStateError(f"metrics[{k!r}] is a {type(v).__name__}; metrics are "
                                        "numbers (put other values in extra=)",
                                        path=f"metrics[{k!r}]") from None
        except (ValueError, RuntimeError):  # a str, a tensor of several elements
            raise EncodeError(f"metrics[{k!r}] = {v!r:.60} is not a number; metrics are numbers "
                              "(put other values in extra=)") from None
    return out


def snapshot_cpu(model: nn.Module, *, metrics: Mapping[str, float] | None = None,
                 epoch: int = 0) -> ModelSnapshot:
    """Copy ``model``'s parameters (detached) and persistent buffers into shared CPU memory."""
    params, buffers = model_sources(model)
    datafile.check_entries(params + buffers)  # refused before anything is allocated
    layout = Layout.of(params, buffers, layout_hash(params, buffers))
    views = staging.views(staging.allocate(layout), layout)
    staging.copy_into(views, [t for _, t in params + buffers])
    names = [s.name for s in layout.specs]
    n = len(params)
    return ModelSnapshot(dict(zip(names[:n], views[:n])), dict(zip(names[n:], views[n:])),
                         as_metrics(metrics), int(epoch))


def load_snapshot(path: str | os.PathLike[str]) -> ModelSnapshot:
    """Read a ``.fdl``/``.fdl.gz`` and its metadata back into a :class:`ModelSnapshot`.

    The file's size and CRC-32 are checked against the metadata as it is read;
    a mismatch is a :class:`FormatError`.
    """
    meta = read_meta(path)
    ckpt = read_with_data(path, meta)  # a bool buffer, say, is in the data file
    unknown = [b for b in meta.buffers if b not in ckpt.entries]
    if unknown or meta.entries + ((meta.data or {}).get("entries") or 0) != len(ckpt.entries):
        raise FormatError(f"metadata does not describe this checkpoint (it lists {meta.entries} "
                          f"entries and buffers {unknown[:3]} the file lacks)",
                          path=os.fspath(path))
    buffers = set(meta.buffers)
    return ModelSnapshot({k: v for k, v in ckpt.entries.items() if k not in buffers},
                         {k: v for k, v in ckpt.entries.items() if k in buffers},
                         as_metrics(meta.metrics), int(meta.epoch))

"""What a tensor file holds, described without its data, and the progress callback.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable
import torch

from ..format import fdl

__all__ = ["Progress", "EntryInfo", "FileInfo", "TensorFile"]


# (phase, bytes done, bytes in all or None when unknown); called as work proceeds.
Progress = Callable[[str, int, "int | None"], None]


def _no_progress(phase: str, done: int, total: int | None) -> None:
    pass


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _byte_view(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy (empty tensors have none)."""
    if t.numel() == 0:
        return memoryview(b"")
    return fdl._byte_view(t)  # noqa: SLF001 - the codec's own zero-copy view


def _cpu_contiguous(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous()


# -- what a file holds ------------------------------------------------------------
@dataclass(frozen=True)
class EntryInfo:
    """One tensor of a file, described without its data.

    ``offset`` is where the entry starts in the uncompressed ``.fdl`` stream
    (its name length), or where its data starts in a ``.safetensors`` file;
    None for ``.pt``.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    offset: int | None = None


@dataclass
class FileInfo:
    """What :func:`describe_file` found."""

    path: str
    format: str                          # one of FORMATS
    file_bytes: int                      # on disk
    entries: list[EntryInfo]
    version: int | None = None           # .fdl only
    structural_hash: str | None = None   # hex, None when absent or zero
    gzip: bool = False
    metadata: dict[str, str] = field(default_factory=dict)  # safetensors __metadata__

    @property
    def tensor_bytes(self) -> int:
        """Bytes of tensor data in the file, every entry together."""
        return sum(e.nbytes for e in self.entries)


@dataclass
class TensorFile:
    """Tensors in file order, with what the formats can carry beside them."""

    entries: list[tuple[str, torch.Tensor]]
    structural_hash: str | None = None           # hex; only .fdl (and our .safetensors) keep it
    metadata: dict[str, str] = field(default_factory=dict)  # only .safetensors keeps it

    @property
    def tensor_bytes(self) -> int:
        """Bytes of tensor data, every entry together."""
        return sum(t.numel() * t.element_size() for _, t in self.entries)

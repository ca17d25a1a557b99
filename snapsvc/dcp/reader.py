"""``SnapsvcStorageReader``: ``dcp.load`` from a checkpoint :class:`SnapsvcStorageWriter` wrote.

DCP's ``Metadata`` is rebuilt from the plain values kept in rank 0's file
(never from the ``.metadata`` pickle), so DCP's own planner reshards onto any
world size. Every file a rank needs is read and CRC-checked before anything in
the rank's ``state_dict`` is written: a damaged file fails with
:class:`~snapsvc.errors.FormatError` and leaves the state as it was.
"""

from __future__ import annotations

import io
import os
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, LoadItemType
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..distributed.manifest import read_manifest
from ..errors import FormatError
from ..state.readback import load
from .layout import META_KEY, entry_key, is_step_path, meta_from, step_of

__all__ = ["SnapsvcStorageReader"]


class SnapsvcStorageReader(StorageReader):
    """A DCP ``StorageReader`` for a snapsvc ``step_<N>`` directory (``path``)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__()
        self.path = os.path.abspath(os.fspath(path))
        self._ranks: dict[tuple[str, tuple[int, ...]], int] = {}
        self._files: dict[int, dict[Any, Any]] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a load, from ``checkpoint_id`` when given."""
        if checkpoint_id is not None:
            self.path = os.path.abspath(os.fspath(checkpoint_id))
        self._files = {}

    def _file(self, rank: int) -> dict[Any, Any]:
        """Rank ``rank``'s entries, read whole and CRC-checked (kept for this load)."""
        if rank not in self._files:
            self._files[rank] = load(os.path.join(self.path, f"rank{rank}.fdl"))
        return self._files[rank]

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's metadata, from snapsvc's manifest and rank 0's file (msgpack, no pickle)."""
        step_of(self.path)
        read_manifest(self.path)   # a step without a complete manifest is refused here
        raw = self._file(0).get(META_KEY)
        if raw is None:
            raise FormatError(f"{self.path}: rank0.fdl holds no DCP metadata ({META_KEY!r}): "
                              "it was not written by SnapsvcStorageWriter; read it with "
                              "snapsvc.restore_distributed")
        md, self._ranks = meta_from(raw, os.path.join(self.path, "rank0.fdl"))
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool,
                              *args: Any, **kwargs: Any) -> None:
        """Nothing to set up: the chunk owners came with the metadata."""

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """The rank's plan, unchanged."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """The plans, unchanged."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read and check every needed file first, then fill the state."""
        if not self._ranks:   # a reader used on a rank that did not read the metadata
            self.read_metadata()
        sources = []
        for item in plan.items:
            idx = item.storage_index
            is_tensor = item.type != LoadItemType.BYTE_IO
            owner = self._ranks.get((idx.fqn, tuple(idx.offset or ()) if is_tensor else ()))
            if owner is None:
                raise FormatError(f"{self.path}: no stored item {idx.fqn!r} at offsets "
                                  f"{list(idx.offset or ())}; the metadata and files disagree")
            entries = self._file(owner)
            key = entry_key(idx, is_tensor)
            if key not in entries:
                raise FormatError(f"{self.path}/rank{owner}.fdl has no entry {key!r}, which "
                                  "the metadata names; the checkpoint is damaged")
            sources.append((item, entries[key]))
        # every file read and checked: only now is the caller's state written
        for item, value in sources:
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(value))
                continue
            src: torch.Tensor = value
            for dim, (o, n) in enumerate(zip(item.storage_offsets, item.lengths)):
                src = src.narrow(dim, int(o), int(n))
            target = planner.resolve_tensor(item).detach()
            if target.size() != src.size():
                raise FormatError(f"{self.path}: item {item.storage_index.fqn!r} is "
                                  f"{list(src.size())} in the file, {list(target.size())} "
                                  "wanted")
            target.copy_(src)
            planner.commit_tensor(item, target)
        self._files = {}
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """A local ``step_<N>`` directory path."""
        return is_step_path(checkpoint_id)

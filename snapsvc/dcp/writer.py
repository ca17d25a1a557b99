"""``SnapsvcStorageWriter``: DCP's ``StorageWriter`` over :class:`DistributedSnapshotWriter`.

``dcp.save`` plans, then on every rank calls :meth:`write_data` with the
rank's items: they are handed as one flat state to the rank's
:class:`DistributedSnapshotWriter` (its shared-memory slots and sidecar,
started once and kept across saves), whose coordinator commits snapsvc's
manifest once every rank's file is durable. The future resolves then.
:meth:`finish` (the coordinator) writes DCP's ``.metadata`` last.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..distributed.writer import DistributedSnapshotWriter
from .layout import META_KEY, _Refusal, entry_key, is_step_path, plans_meta, step_of

__all__ = ["SnapsvcStorageWriter"]

METADATA_NAME = ".metadata"


class SnapsvcStorageWriter(StorageWriter):
    """A DCP ``StorageWriter`` that saves through snapsvc's per-rank sidecars.

    ``path``: the step directory ``<root>/step_<N>`` (``checkpoint_id=`` of
    ``dcp.save`` overrides it per save; the root must stay the same). The
    rank's :class:`DistributedSnapshotWriter` on ``<root>`` is made at the
    first save (a collective: every rank saves) and kept; ``slots``,
    ``remote``, ``remote_keep_last`` and ``writer_options`` go to it.
    ``persist=False`` closes it after each save. Call :meth:`close` on every
    rank before ``dist.destroy_process_group()``.
    """

    def __init__(self, path: str | os.PathLike[str], *, slots: int = 2,
                 remote: str | os.PathLike[str] | None = None,
                 remote_keep_last: int | None = None, persist: bool = True,
                 **writer_options: Any) -> None:
        super().__init__()
        self.path = os.path.abspath(os.fspath(path))
        step_of(self.path)   # refuses a path that is no step directory, here
        self.persist = persist
        self._options = dict(writer_options, slots=slots, remote=remote,
                             remote_keep_last=remote_keep_last)
        self._writer: DistributedSnapshotWriter | None = None
        self._coordinator = False
        self._rank = 0

    # -- DCP's StorageWriter ---------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a save, into ``checkpoint_id`` when given."""
        if checkpoint_id is not None:
            step_of(checkpoint_id)
            self.path = os.path.abspath(os.fspath(checkpoint_id))

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Make (once) this rank's DistributedSnapshotWriter on the checkpoint root."""
        self._coordinator = is_coordinator
        self._rank = int(kwargs.get("rank", 0) or 0)
        root, _ = step_of(self.path)
        if self._writer is not None and self._writer.directory != root:
            raise ValueError(f"this SnapsvcStorageWriter saves under {self._writer.directory}, "
                             f"not {root}: make another one for another root")
        if self._writer is None:
            self._writer = DistributedSnapshotWriter(root, **self._options)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """The rank's plan, unchanged."""
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Keep DCP's metadata in plain values, for rank 0's ``.meta`` (never a pickle)."""
        return [dataclasses.replace(plans[0], storage_data=plans_meta(plans)), *plans[1:]]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Hand the rank's items to its sidecar; the future resolves once the step committed."""
        assert self._writer is not None, "set_up_storage_writer first"
        state: dict[str, Any] = {}
        results = []
        for item in plan.items:
            data = planner.resolve_data(item)
            is_tensor = item.type != WriteItemType.BYTE_IO
            key = entry_key(item.index, is_tensor)
            if is_tensor:
                assert isinstance(data, torch.Tensor)
                state[key] = data.detach()
                size = data.numel() * data.element_size()
            else:
                assert isinstance(data, io.BytesIO)   # what resolve_data gives a BYTE_IO item
                state[key] = data.getvalue()
                size = len(state[key])
            results.append(WriteResult(index=item.index, size_in_bytes=size,
                                       storage_data=key))
        if isinstance(plan.storage_data, dict):   # rank 0's plan carries the metadata
            state[META_KEY] = plan.storage_data
        _, step = step_of(self.path)
        fut: Future[list[WriteResult]] = Future()
        try:
            handle = self._writer.submit(state, step)
            handle.result(timeout=self._writer.write_timeout + 2 * self._writer.coord_timeout)
        except BaseException as e:
            self._done()
            # torch's stub types the argument as the result type; it takes an exception
            fut.set_exception(e)  # type: ignore[arg-type]
            return fut
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """(coordinator) Write DCP's ``.metadata`` last, after every rank's files are durable.

        It is a pickle that DCP's default reader refuses with a message naming
        :class:`SnapsvcStorageReader`; snapsvc reads the manifest instead.
        """
        try:
            if self._coordinator:
                path = os.path.join(self.path, METADATA_NAME)
                tmp = path + ".tmp"
                with open(tmp, "wb") as f:
                    pickle.dump(_Refusal(), f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
                fd = os.open(self.path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        finally:
            self._done()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """A local ``step_<N>`` directory path."""
        return is_step_path(checkpoint_id)

    def storage_meta(self) -> StorageMeta | None:
        """Where this save goes."""
        return StorageMeta(checkpoint_id=self.path)

    # -- lifecycle -------------------------------------------------------------------
    def _done(self) -> None:
        if not self.persist:
            self.close()

    def close(self) -> None:
        """Drain and stop this rank's sidecar (every rank; before destroying the group)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

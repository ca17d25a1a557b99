"""``SnapsvcStorageReader``: ``dcp.load`` from a snapsvc step, local or on the remote tier.

DCP's ``Metadata`` is rebuilt from rank 0's state tree and the manifest's
piece table (:mod:`.layout`; never from the ``.metadata`` pickle), so DCP's
own planner reshards onto any world size and mesh. Each rank reads only the
pieces that overlap the blocks it asks for, each by its byte range and
checked against the CRC-32 the manifest recorded, and only once every read
is checked does anything in the rank's ``state_dict`` change: a damaged or
missing file fails with :class:`~snapsvc.errors.FormatError` and leaves the
state as it was.
"""

from __future__ import annotations

import io
import os
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..distributed.pieces import _Global, _globals
from ..distributed.tier import LocalStep, open_step
from ..errors import FormatError
from ..format.protocol import TensorRef
from ..remote.url import is_url
from .layout import dcp_items, dcp_metadata, is_step_path, metadata_token, step_of

__all__ = ["SnapsvcStorageReader"]

METADATA_NAME = ".metadata"


class SnapsvcStorageReader(StorageReader):
    """A DCP ``StorageReader`` for a snapsvc ``step_<N>`` directory or step URL (``path``).

    ``verify``: check each piece read against its CRC-32 (default). ``timeout``:
    from the remote tier, the deadline of each read.
    """

    def __init__(self, path: str | os.PathLike[str], *, verify: bool = True,
                 timeout: float | None = None) -> None:
        super().__init__()
        self.path = self._checked(path)
        self.verify = verify
        self.timeout = timeout
        self._step: LocalStep | None = None
        self._items: dict[str, Any] = {}
        self._saved: dict[str, _Global] = {}
        self._failed: FormatError | None = None

    @staticmethod
    def _checked(path: str | os.PathLike[str]) -> str:
        step_of(path)
        return os.fspath(path) if is_url(path) else os.path.abspath(os.fspath(path))

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a load, from ``checkpoint_id`` when given."""
        if checkpoint_id is not None:
            self.path = self._checked(checkpoint_id)
        self._step = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's metadata, from the manifest and rank 0's state tree (msgpack, no pickle).

        A step that cannot be read gives metadata that raises its
        :class:`~snapsvc.errors.FormatError` at first use, and
        :meth:`set_up_storage_reader` raises it: ``dcp.load`` turns an error
        raised here into an ``AssertionError`` holding only its text.
        """
        self._failed = None
        try:
            return self._read_metadata()
        except FormatError as e:
            self._failed = e
            return _Unreadable(e)

    def _read_metadata(self) -> Metadata:
        try:
            step = open_step(self.path, self.timeout)
            m = step.manifest
            if not is_url(self.path):
                self._check_metadata_file(step_of(self.path)[1])
            tree = step.meta(m.ranks[0].file).state
            if tree is None:
                raise FormatError("rank 0's metadata holds no state tree: the step was not "
                                  "saved from a state mapping (read it with "
                                  "snapsvc.restore_distributed)", path=self.path)
            if isinstance(tree, dict) and "snapsvc.dcp" in tree:
                raise FormatError(
                    "written by snapsvc 0.5.0's SnapsvcStorageWriter, whose layout (entries "
                    "'<key>@<offsets>' in whole rank files) this reader does not read: load it "
                    "with snapsvc 0.5.0 and save it again, or read each rank file with "
                    "snapsvc.load", path=self.path)
            self._saved = _globals(m)
            self._items = dcp_items(tree, self.path)
            md = dcp_metadata(self._items, self._saved, self.path)
        except OSError as e:
            raise FormatError(f"cannot read the step ({e}); it is incomplete or was moved",
                              path=self.path) from e
        self._step = step
        return md

    def _check_metadata_file(self, step: int) -> None:
        """A ``.metadata`` beside the manifest must be this step's (finish writes it last)."""
        path = os.path.join(self.path, METADATA_NAME)
        if not os.path.exists(path):
            return   # a DistributedSnapshotWriter step, or one whose finish did not run
        with open(path, "rb") as f:
            raw = f.read(1 << 16)
        if metadata_token(self.path, step).encode() not in raw:
            raise FormatError(f"{METADATA_NAME} does not name this step and manifest: it "
                              "belongs to another checkpoint; remove it, or restore the "
                              "step's own", path=path)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool,
                              *args: Any, **kwargs: Any) -> None:
        """Raise what made the step unreadable; else nothing to set up."""
        if self._failed is not None:
            raise self._failed

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """The rank's plan, unchanged."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """The plans, unchanged."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read and check every piece the plan needs first, then fill the state."""
        if self._step is None:   # a reader used on a rank that did not read the metadata
            self._read_metadata()
        assert self._step is not None
        sources = self._read(self._step, plan)
        # every piece read and checked: only now is the caller's state written
        for item, value in sources:
            if item.type == LoadItemType.BYTE_IO:
                buf = io.BytesIO()
                torch.save(value, buf)   # the value itself: the file held no pickle
                buf.seek(0)
                planner.load_bytes(item, buf)
                continue
            target = planner.resolve_tensor(item).detach()
            if target.size() != value.size():
                raise FormatError(f"item {item.storage_index.fqn!r} is {list(value.size())} in "
                                  f"the file, {list(target.size())} wanted", path=self.path)
            target.copy_(value)
            planner.commit_tensor(item, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read(self, step: LocalStep, plan: LoadPlan) -> list[tuple[Any, Any]]:
        """(item, value) for each of the plan's items: each tensor block assembled from
        the pieces it overlaps, read by byte range and CRC-checked."""
        blocks, sources = [], []
        for item in plan.items:
            fqn = item.storage_index.fqn
            if fqn not in self._items:
                raise FormatError(f"no saved item {fqn!r}; the metadata and the files disagree",
                                  path=self.path)
            value = self._items[fqn]
            if item.type == LoadItemType.BYTE_IO or type(value) is not TensorRef:
                sources.append((item, value))
                continue
            chunk = item.storage_index.offset or torch.Size([0] * len(item.lengths))
            offsets = [int(c) + int(o) for c, o in zip(chunk, item.storage_offsets)]
            blocks.append((item, self._saved[value.name], offsets, [int(n) for n in item.lengths]))
        try:
            with step.pieces(self.verify) as reader:
                reader.prefetch([(g, o, n) for _, g, o, n in blocks])
                for item, g, o, n in blocks:
                    sources.append((item, reader.assemble(g, o, n)))
        except OSError as e:
            raise FormatError(f"cannot read a piece ({e}); the step is incomplete",
                              path=self.path) from e
        return sources

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """A ``step_<N>`` directory path, or a step's URL on the remote tier."""
        return is_step_path(checkpoint_id)


class _Unreadable(Metadata):
    """The metadata of a step that cannot be read: any use of its items raises why."""

    def __init__(self, error: FormatError) -> None:   # no fields: they raise below
        self._error = error

    def __getattr__(self, name: str) -> Any:
        if name == "state_dict_metadata":
            raise self._error
        raise AttributeError(name)

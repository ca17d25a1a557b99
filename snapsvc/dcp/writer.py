"""``SnapsvcStorageWriter``: DCP's ``StorageWriter`` and ``AsyncStager`` over snapsvc's sidecars.

``dcp.async_save`` calls :meth:`stage` on the training thread: the state's
tensors (DTensors as their local shards) are copied into one of the rank's
shared-memory slots, through the pools and kept walks that
:class:`DistributedSnapshotWriter` uses, and DCP gets the state back with
each tensor a :class:`~.staged.StagedTensor` ticket. DCP then plans and, on
its thread (THREAD) or in its checkpoint process (PROCESS, through the
:mod:`.relay`), calls :meth:`write_data`, which hands the held slot to the
rank's sidecar with DCP's bytes items and resolves once the step is durable
on every rank. ``dcp.save`` (no stage) copies in :meth:`write_data`.
:meth:`finish` (the coordinator) writes DCP's ``.metadata`` last.
"""

from __future__ import annotations

import math
import os
import pickle
import threading
from typing import Any, Mapping, cast

from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE, Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..distributed.shards import ShardMemo, _state_plan
from ..distributed.writer import DistributedSnapshotWriter
from ..engine.dispatch import Held, release_held
from .layout import _Refusal, is_step_path, metadata_token, step_of
from ..remote.url import is_url
from .relay import Relay, call
from .kept import StagePlan
from .staged import ticket_of

__all__ = ["SnapsvcStorageWriter"]

METADATA_NAME = ".metadata"


class SnapsvcStorageWriter(StorageWriter, AsyncStager):
    """A DCP ``StorageWriter`` and ``AsyncStager`` that saves through snapsvc's per-rank sidecars.

    ``path``: the step directory ``<root>/step_<N>`` (``checkpoint_id=`` of
    ``dcp.save``/``dcp.async_save`` overrides it per save; the root must stay
    the same). The rank's :class:`DistributedSnapshotWriter` on ``<root>`` is
    made at the first :meth:`stage` or save (a collective: every rank saves)
    and kept, with its sidecar, across saves; ``slots``, ``remote``,
    ``remote_keep_last`` and ``writer_options`` go to it. With ``remote``, a
    ``checkpoint_id`` may be a step URL on it (``s3://bucket/run/step_<N>``:
    saved under ``<root>/step_<N>``, then uploaded), and ``wait_upload=True``
    resolves each save only once the step is complete on the remote tier too.
    ``persist=False`` closes it after each ``dcp.save``. As the ``async_save`` stager it copies
    at :meth:`stage` and returns once copied. Call :meth:`close` on every
    rank before ``dist.destroy_process_group()``.
    """

    # stage() returns once copied: async_save has nothing to wait for after it
    _synchronize_after_execute = False

    def __init__(self, path: str | os.PathLike[str], *, slots: int = 2,
                 remote: str | os.PathLike[str] | None = None,
                 remote_keep_last: int | None = None, persist: bool = True,
                 wait_upload: bool = False, **writer_options: Any) -> None:
        super().__init__()
        if writer_options.get("overlap") or writer_options.get("policy", "block") != "block":
            raise ValueError("SnapsvcStorageWriter copies before stage() returns and waits for "
                             "a slot: overlap and policy are not options here")
        if is_url(path):
            raise ValueError(f"{path}: the path is the local step directory; the remote tier "
                             "is remote=<url> (and checkpoint_id may then be a step URL)")
        self.path = os.path.abspath(os.fspath(path))
        step_of(self.path)   # refuses a path that is no step directory, here
        self.persist = persist
        self.wait_upload = wait_upload
        if wait_upload and remote is None:
            raise ValueError("wait_upload=True needs remote=<url or directory>")
        self._options = dict(writer_options, slots=slots, remote=remote,
                             remote_keep_last=remote_keep_last)
        self._writer: DistributedSnapshotWriter | None = None
        self._coordinator = False
        self._lock = threading.Lock()
        self._held: dict[int, Held] = {}   # staged copies by ticket, not yet written
        self._ticket = 0
        self._plan = StagePlan()   # kept across stage() calls while the state holds
        self._relay: Relay | None = None
        self._remote_call: tuple[str, bytes, float] | None = None   # in DCP's checkpoint process

    # -- DCP's AsyncStager ---------------------------------------------------------
    def stage(self, state_dict: STATE_DICT_TYPE) -> STATE_DICT_TYPE:
        """Copy the rank's pieces of the state into a slot; return once copied, with
        tickets in place of the tensors (DCP's flattened state: ``{"a.b": ...}``)."""
        writer = self._ensure_writer()
        with self._lock:
            self._ticket += 1
            ticket = self._ticket
        # planned first: what DCP cannot plan is refused before a slot is taken
        # a ShardMemo of its own, dropped after: the kept plan holds no tensor, and
        # the writer's memo would hold this state's until its next submit
        staged, planned = self._plan(
            state_dict, ticket, lambda state: _state_plan(state, writer.rank, ShardMemo()))
        held = writer._hold(state_dict, planned)
        with self._lock:
            self._held[ticket] = held
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns once copied."""

    # -- DCP's StorageWriter ---------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a save, into ``checkpoint_id`` when given."""
        if checkpoint_id is not None:
            self.path = self._local(checkpoint_id)

    def _local(self, checkpoint_id: str | os.PathLike[str]) -> str:
        """The local step directory of ``checkpoint_id``: a path, or a step URL under
        ``remote`` (saved locally under this writer's root first, then uploaded)."""
        root, step = step_of(checkpoint_id)
        if not is_url(checkpoint_id):
            return os.path.abspath(os.fspath(checkpoint_id))
        remote = self._options.get("remote")
        if remote is None or os.fspath(remote).rstrip("/") != root:
            raise ValueError(f"{checkpoint_id}: a URL checkpoint_id names a step of this "
                             f"writer's remote tier (remote={remote!r}): pass "
                             f"checkpoint_id=<remote>/step_<N>, or a local step directory")
        return os.path.join(step_of(self.path)[0], f"step_{step}")

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Make (once) this rank's DistributedSnapshotWriter on the checkpoint root."""
        self._coordinator = is_coordinator
        if self._remote_call is None:   # in DCP's checkpoint process, the trainer writes
            self._ensure_writer()

    def _ensure_writer(self) -> DistributedSnapshotWriter:
        root, _ = step_of(self.path)
        if self._writer is not None and self._writer.directory != root:
            raise ValueError(f"this SnapsvcStorageWriter saves under {self._writer.directory}, "
                             f"not {root}: make another one for another root")
        if self._writer is None:
            self._writer = DistributedSnapshotWriter(root, **self._options)
        return self._writer

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """The rank's plan, unchanged."""
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """The plans, unchanged: DCP's metadata is rebuilt from snapsvc's at load."""
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Hand the rank's staged slot (or its state, copied now) to its sidecar; the
        future resolves once the step is durable on every rank."""
        fut: Future[list[WriteResult]] = Future()
        try:
            ticket = ticket_of(getattr(planner, "state_dict", None))
            if self._remote_call is not None:
                address, authkey, timeout = self._remote_call
                if ticket is None:
                    raise ValueError("a SnapsvcStorageWriter in DCP's checkpoint process writes "
                                     "only what its stage() staged (use dcp.async_save)")
                call(address, authkey, (ticket, self.path), timeout)
            else:
                self._write(ticket, None if ticket is not None else _planned_state(planner),
                            self.path)
        except BaseException as e:
            self._done()
            # torch's stub types the argument as the result type; it takes an exception
            fut.set_exception(e)  # type: ignore[arg-type]
            return fut
        fut.set_result([WriteResult(index=item.index, size_in_bytes=_nbytes(item),
                                    storage_data=None) for item in plan.items])
        return fut

    def _write(self, ticket: int | None, state: Mapping[str, Any] | None, path: str) -> None:
        """(the trainer) Write ticket's held slot, or ``state`` copied now, as the step
        ``path`` names; return once it is durable on every rank."""
        writer = self._writer
        root, step = step_of(path)
        if writer is None or writer.directory != root:
            raise ValueError(f"{path}: this SnapsvcStorageWriter saves under "
                             f"{writer.directory if writer else 'nothing (closed)'}")
        if ticket is None:
            assert state is not None
            held = writer._hold(state)
        else:
            with self._lock:
                held_or_none = self._held.pop(ticket, None)
                # saves run in order: an earlier ticket not written by now never will be
                stale = [self._held.pop(t) for t in [t for t in self._held if t < ticket]]
            for h in stale:
                release_held(writer.writer, h)
            if held_or_none is None:
                raise ValueError(f"staged copy {ticket} is gone: written already, or the "
                                 "writer was closed since stage()")
            held = held_or_none
        try:
            handle = writer.submit(cast(Any, held), step)
        finally:
            release_held(writer.writer, held)   # a no-op once submit sent it
        handle.result(timeout=writer.write_timeout + 2 * writer.coord_timeout)
        if self.wait_upload:   # every rank's upload, then rank 0's remote manifest
            handle.uploaded(timeout=self._options.get("remote_timeout", 300.0)
                            + 2 * writer.coord_timeout)

    # -- PROCESS mode: DCP pickles the writer into its checkpoint process -------------
    def __getstate__(self) -> dict[str, Any]:
        if self._writer is None:
            raise TypeError("a SnapsvcStorageWriter is pickled only by dcp.async_save in "
                            "PROCESS mode, after its stage()")
        with self._lock:
            if self._relay is None:
                self._relay = Relay(lambda ticket, path: self._write(ticket, None, path))
        w = self._writer
        return {"path": self.path, "persist": self.persist, "remote": self._options["remote"],
                "remote_call": (self._relay.address, self._relay.authkey,
                                w.write_timeout + 2 * w.coord_timeout + 30.0)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], persist=state["persist"],  # type: ignore[misc]
                      remote=state["remote"])
        self._remote_call = state["remote_call"]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """(coordinator) Write DCP's ``.metadata`` last, after every rank's files are durable.

        It is a pickle that DCP's default reader refuses with a message naming
        :class:`SnapsvcStorageReader`; snapsvc reads the manifest instead.
        """
        try:
            if self._coordinator:
                path = os.path.join(self.path, METADATA_NAME)
                tmp = path + ".tmp"
                token = metadata_token(self.path, step_of(self.path)[1])
                with open(tmp, "wb") as f:
                    pickle.dump(_Refusal(token), f)
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
        """A local ``step_<N>`` directory path, or a step URL of the remote tier."""
        return is_step_path(checkpoint_id)

    def storage_meta(self) -> StorageMeta | None:
        """Where this save goes."""
        return StorageMeta(checkpoint_id=self.path)

    # -- lifecycle -------------------------------------------------------------------
    def _done(self) -> None:
        if not self.persist and self._remote_call is None:
            self.close()

    def close(self) -> None:
        """Give back staged slots, drain and stop this rank's sidecar (every rank; before
        destroying the group)."""
        with self._lock:
            held, self._held = list(self._held.values()), {}
            relay, self._relay = self._relay, None
        if relay is not None:
            relay.close()
        if self._writer is not None:
            for h in held:
                release_held(self._writer.writer, h)
            self._writer.close()
            self._writer = None


def _nbytes(item: WriteItem) -> int:
    """The bytes of a tensor write item's chunk (0 for a bytes item: in the state tree)."""
    td = item.tensor_data
    return 0 if td is None else math.prod(td.chunk.sizes) * td.properties.dtype.itemsize


def _planned_state(planner: SavePlanner) -> Mapping[str, Any]:
    """The state ``dcp.save`` planned, nested again (DefaultSavePlanner flattens it)."""
    state = getattr(planner, "state_dict", None)
    if not isinstance(state, Mapping):
        raise TypeError(f"{type(planner).__name__} keeps no state_dict: SnapsvcStorageWriter "
                        "saves with DCP's DefaultSavePlanner or one derived from it")
    mappings = getattr(planner, "mappings", None)
    if getattr(planner, "flatten_state_dict", False) and mappings:
        return unflatten_state_dict(dict(state), mappings)
    return state

"""The snapsvc exception hierarchy.

Everything snapsvc raises on purpose derives from :class:`SnapsvcError`, so a
training loop can catch one type. Errors about the bytes of a file also derive
from :class:`ValueError`; a writer process that died derives from
:class:`RuntimeError` (as ``concurrent.futures``' ``BrokenProcessPool`` does).
"""

from __future__ import annotations

__all__ = [
    "SnapsvcError",
    "FormatError",
    "EncodeError",
    "UnsupportedStateError",
    "ArchitectureMismatchError",
    "ShapeMismatchError",
    "StrictLoadError",
    "BrokenWriterError",
    "SlotBudgetError",
    "MemoryLimitError",
    "UnsafeCallError",
    "WriteFailedError",
    "DistributedCheckpointError",
    "WorldSizeMismatchError",
    "PathError",
    "CheckpointNotFoundError",
    "TargetNotWritableError",
    "RollbackError",
    "WriterClosedError",
    "UploadError",
    "UnsafePathError",
]


class SnapsvcError(Exception):
    """Root of every error snapsvc raises on purpose."""


class FormatError(SnapsvcError, ValueError):
    """A checkpoint's bytes are not a valid ``.fdl`` stream.

    The message names the file (when known), the byte offset in the
    uncompressed stream, and the entry being read.
    """

    def __init__(self, message: str, *, path: str | None = None,
                 offset: int | None = None, entry: str | None = None) -> None:
        self.reason = message
        self.path = path
        self.offset = offset
        self.entry = entry
        where = []
        if path is not None:
            where.append(str(path))
        if offset is not None:
            where.append(f"offset {offset}")
        if entry is not None:
            where.append(f"entry {entry!r}")
        super().__init__(": ".join(where + [message]))


class EncodeError(SnapsvcError, ValueError):
    """A tensor or name cannot be written in the ``.fdl`` format."""


class UnsupportedStateError(SnapsvcError, TypeError):
    """A value of a submitted state is of a kind snapsvc does not store.

    ``path`` is where it sits in the state (``state['opt']['state'][0]``).
    Nothing is pickled, so anything beyond tensors, modules, optimizers,
    stateful objects, containers and plain scalars is refused at submit.
    """

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class ArchitectureMismatchError(SnapsvcError, ValueError):
    """The file's structural hash differs from the model's."""


class ShapeMismatchError(SnapsvcError, ValueError):
    """A checkpoint entry's shape differs from the model tensor of that name."""


class StrictLoadError(SnapsvcError, KeyError):
    """``strict=True`` and the checkpoint and the model do not name the same tensors."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class BrokenWriterError(SnapsvcError, RuntimeError):
    """The writer sidecar died (or never started); pending writes are lost to it.

    Like ``concurrent.futures``' ``BrokenProcessPool``. The message names the
    exit code or the signal. With ``restart=True`` the next submit starts a
    new sidecar.
    """


class SlotBudgetError(SnapsvcError, ValueError):
    """A snapshot's slots do not fit in the writer's ``max_slot_bytes``."""


class MemoryLimitError(SlotBudgetError):
    """A snapshot that cannot fit in the writer's (or its service's) ``memory_limit``
    even with nothing else held: its slots, plus its RAM copy when memory-only."""


class UnsafeCallError(SnapsvcError, RuntimeError):
    """A writer call made where it cannot work: in a forked child of the
    process that owns the writer (it would act on the parent's sidecar), or a
    wait from the thread that delivers reports, i.e. inside a done-callback
    (it would wait for itself)."""


class WriteFailedError(SnapsvcError, OSError):
    """The sidecar could not write a checkpoint; ``errno`` and ``filename`` say why and where.

    The temp file is removed, and the previous checkpoint of that name and its
    metadata are untouched.
    """


class DistributedCheckpointError(SnapsvcError, RuntimeError):
    """A multi-rank checkpoint was not committed: no manifest was written.

    Raised by every rank's handle. ``failures`` maps each rank that reported
    a problem to its reason; ``timed_out`` is True when the ranks could not
    even exchange their results (a rank died or hung past ``coord_timeout``).
    """

    def __init__(self, message: str, *, step: int | None = None,
                 failures: dict[int, str] | None = None, timed_out: bool = False) -> None:
        super().__init__(message)
        self.step = step
        self.failures = dict(failures or {})
        self.timed_out = timed_out


class WorldSizeMismatchError(SnapsvcError, ValueError):
    """A multi-rank checkpoint was restored at a different world size (no resharding)."""

    def __init__(self, message: str, *, saved: int, current: int) -> None:
        super().__init__(message)
        self.saved = saved
        self.current = current


class PathError(SnapsvcError, ValueError):
    """A checkpoint path that cannot be written as given (e.g. a file name longer
    than the file system allows); raised before anything is written."""


class CheckpointNotFoundError(SnapsvcError, FileNotFoundError):
    """No checkpoint at the path given: neither the file nor its metadata (nor, for a
    multi-rank checkpoint, its step directory) exists. ``filename`` is the path.

    A ``FileNotFoundError``, as Lightning's and torch's own loaders raise; a
    checkpoint file without its metadata is an unfinished write instead
    (:class:`FormatError`).
    """


class TargetNotWritableError(SnapsvcError, ValueError):
    """A live tensor that a restore would copy into cannot be written in place
    (an inference tensor, an ``expand()``ed view); found before anything changes."""


class RollbackError(SnapsvcError):
    """A restore failed while applying, and undoing it failed too for some objects.

    Every other object was put back as it was; ``failed`` names (as the
    restore's report does) each one that could not be, and may hold the
    checkpoint's state or a mix. The error that made the restore fail is
    ``__cause__``; each undo's own error is in ``errors``.
    """

    def __init__(self, message: str, *, failed: list[str],
                 errors: list[BaseException]) -> None:
        super().__init__(message)
        self.failed = list(failed)
        self.errors = list(errors)


class WriterClosedError(SnapsvcError, RuntimeError):
    """A call on a :class:`~snapsvc.SnapshotWriter` that was closed; make a new one."""


class UploadError(SnapsvcError):
    """A checkpoint durable locally was not copied to the remote tier: the upload
    failed for good (after retries, or past ``remote_timeout``), was skipped
    (uploads fell behind; newer ones went first), or the writer stopped first.

    The local checkpoint is unaffected. ``path`` is the local file, ``url``
    its remote name; ``skipped`` is True when it was passed over, not tried.
    """

    def __init__(self, message: str, *, path: str | None = None, url: str | None = None,
                 skipped: bool = False) -> None:
        super().__init__(message)
        self.path = path
        self.url = url
        self.skipped = skipped


class UnsafePathError(SnapsvcError, PermissionError):
    """A directory snapsvc keeps private state in (the RAM tier under
    ``/dev/shm``) is a symlink, is owned by another user, or is open to others:
    refused, never followed. The message names the path and the fix."""

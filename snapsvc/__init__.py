"""snapsvc: checkpoints for PyTorch training that never make the GPU wait on disk.

Files are flodl's ``.fdl`` format (version 2), byte for byte.
"""

import warnings

# torch warns "Failed to initialize NumPy" at import when numpy is absent,
# which snapsvc never needs (a fresh install has no numpy). Silence exactly
# that warning, only while torch is first imported here, so every snapsvc
# process (the CLI, each sidecar) starts quietly and the user's own warning
# filters are left as they were.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch  # noqa: F401

from .files.checkpoint import (
    Checkpoint,
    LoadReport,
    checkpoint_keys,
    checkpoint_version,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
    structural_hash,
)
from .files.convert import (
    EntryInfo,
    FileInfo,
    TensorFile,
    convert_file,
    describe_file,
    read_safetensors,
    write_safetensors,
)
from .engine.writer import SnapshotWriter, WriteHandle, WriteReport
from .engine.life import AttachReport
from .distributed import (
    DistributedSnapshotWriter,
    DistributedWriteHandle,
    DistributedWriteReport,
    latest_checkpoint,
    read_manifest,
    restore_distributed,
)
from .errors import (
    ArchitectureMismatchError,
    BrokenWriterError,
    DistributedCheckpointError,
    EncodeError,
    FormatError,
    PathError,
    RollbackError,
    UnsupportedStateError,
    ShapeMismatchError,
    SlotBudgetError,
    MemoryLimitError,
    UnsafeCallError,
    SnapsvcError,
    StrictLoadError,
    TargetNotWritableError,
    UploadError,
    UnsafePathError,
    WorldSizeMismatchError,
    WriteFailedError,
    WriterClosedError,
)
from .engine.snapshot import ModelSnapshot, load_snapshot, snapshot_cpu
from .files.verify import VerifyReport
from .remote.fetch import accepts_url, verify
from .state.resume import checkpoint_files, restore as _restore
from .state.migrate import MigrateReport, migrate_checkpoint
from .state.readback import load as _load
from .files.ramtier import read_first
from .remote.listing import latest

# A URL of the remote tier (s3://, gs://, az://) is read through a checked local copy.
# A local path the sidecar holds in RAM (persist=False) is read from there first.
load = accepts_url(read_first(_load))
restore = accepts_url(read_first(_restore))
verify = read_first(verify)
read_checkpoint = accepts_url(read_checkpoint)

__version__ = "0.5.0"

__all__ = [
    "__version__",
    "Checkpoint",
    "LoadReport",
    "MigrateReport",
    "checkpoint_keys",
    "checkpoint_version",
    "load_checkpoint",
    "migrate_checkpoint",
    "read_checkpoint",
    "save_checkpoint",
    "structural_hash",
    "ModelSnapshot",
    "snapshot_cpu",
    "load_snapshot",
    "SnapshotWriter",
    "WriteHandle",
    "WriteReport",
    "AttachReport",
    "latest",
    "verify",
    "VerifyReport",
    "convert_file",
    "describe_file",
    "read_safetensors",
    "write_safetensors",
    "EntryInfo",
    "FileInfo",
    "TensorFile",
    "restore",
    "load",
    "checkpoint_files",
    "SnapsvcError",
    "FormatError",
    "EncodeError",
    "PathError",
    "UnsupportedStateError",
    "ArchitectureMismatchError",
    "ShapeMismatchError",
    "StrictLoadError",
    "SlotBudgetError",
    "MemoryLimitError",
    "UnsafeCallError",
    "BrokenWriterError",
    "WriteFailedError",
    "WriterClosedError",
    "TargetNotWritableError",
    "RollbackError",
    "UploadError",
    "UnsafePathError",
    "DistributedCheckpointError",
    "WorldSizeMismatchError",
    "DistributedSnapshotWriter",
    "DistributedWriteHandle",
    "DistributedWriteReport",
    "latest_checkpoint",
    "read_manifest",
    "restore_distributed",
]

"""snapsvc: checkpoints for PyTorch training that never make the GPU wait on disk.

Files are flodl's ``.fdl`` format (version 2), byte for byte.
"""

from .checkpoint import (
    Checkpoint,
    LoadReport,
    MigrateReport,
    checkpoint_keys,
    checkpoint_version,
    load_checkpoint,
    migrate_checkpoint,
    read_checkpoint,
    save_checkpoint,
    structural_hash,
)
from .client import SnapshotWriter, WriteHandle, WriteReport
from .errors import (
    ArchitectureMismatchError,
    BrokenWriterError,
    EncodeError,
    FormatError,
    ShapeMismatchError,
    SnapsvcError,
    StrictLoadError,
    WriteFailedError,
)
from .resume import restore
from .snapshot import ModelSnapshot, load_snapshot, snapshot_cpu
from .verify import VerifyReport, verify

__version__ = "0.1.0"

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
    "verify",
    "VerifyReport",
    "restore",
    "SnapsvcError",
    "FormatError",
    "EncodeError",
    "ArchitectureMismatchError",
    "ShapeMismatchError",
    "StrictLoadError",
    "BrokenWriterError",
    "WriteFailedError",
]

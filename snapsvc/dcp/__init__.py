"""snapsvc as a ``torch.distributed.checkpoint`` (DCP) backend: see docs/dcp.md."""

from .writer import SnapsvcStorageWriter
from .reader import SnapsvcStorageReader

__all__ = ["SnapsvcStorageReader", "SnapsvcStorageWriter"]

"""Lightning's CheckpointIO plugin; the code lives in :mod:`snapsvc.integrations.lightning`."""

from .integrations.lightning import SnapsvcCheckpointIO

__all__ = ["SnapsvcCheckpointIO"]

"""The HF Trainer drop-in; the code lives in :mod:`snapsvc.integrations.transformers`."""

from .integrations.transformers import STAGING_PREFIX, STATE_FILE, SnapsvcTrainer

__all__ = ["SnapsvcTrainer", "STATE_FILE", "STAGING_PREFIX"]

"""Trainer plugins: Lightning's ``CheckpointIO`` and the HF ``Trainer``.

What each module holds::

    lightning.py      SnapsvcCheckpointIO (snapsvc.lightning re-exports it)
    transformers.py   SnapsvcTrainer (snapsvc.transformers re-exports it)

Each imports its trainer library, so neither is imported by ``snapsvc`` itself.
Imports: ``distributed``, the engine, ``state``, ``files``, ``errors``.
"""

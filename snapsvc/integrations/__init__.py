"""Trainer plugins: Lightning's ``CheckpointIO`` and the HF ``Trainer``.

What each module holds::

    lightning.py      SnapsvcCheckpointIO (snapsvc.lightning re-exports it)
    transformers.py   SnapsvcTrainer (snapsvc.transformers re-exports it)
    hf_commit.py      its committer thread: a checkpoint-<N> directory appears whole or not at all
    wraps.py          wrap(): a library's own function wrapped once, where stock behaviour is decided

Each imports its trainer library, so neither is imported by ``snapsvc`` itself.
Imports: ``distributed``, the engine, ``state``, ``files``, ``errors``.
"""

"""Trainer plugins: Lightning's ``CheckpointIO`` and the HF ``Trainer``.

What each module holds::

    lightning/        SnapsvcCheckpointIO (snapsvc.lightning re-exports it): the plugin,
                      hyper-parameters without pickling, the Lightning functions it wraps
    transformers/     SnapsvcTrainer (snapsvc.transformers re-exports it): saves, resumes,
                      the committer that makes a checkpoint-<N> directory appear whole
    wraps.py          wrap(): a library's own function wrapped once, where stock behaviour is decided

Each imports its trainer library, so neither is imported by ``snapsvc`` itself.
Imports: ``distributed``, the engine, ``state``, ``files``, ``errors``.
"""

"""Training state beyond one model: nested mappings, optimizers, restore.

What each module holds::

    tree.py     flatten a nested state (models, optimizers, schedulers, tensors,
                plain values) into entries plus a msgpack tree; load and restore it
    resume.py   optimizer state as file entries; restore(path, model | mapping)

Imports: ``files``, ``format`` and ``errors``.
"""

from .resume import checkpoint_files, restore
from .tree import check_plain, flatten, load

__all__ = ["check_plain", "checkpoint_files", "flatten", "load", "restore"]

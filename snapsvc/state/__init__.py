"""Training state beyond one model: nested mappings, optimizers, restore.

What each module holds::

    paths.py    key paths and entry names; find, param_names, outline
    tree.py     flatten a nested state (models, optimizers, schedulers, tensors,
                plain values) into entries plus a msgpack tree
    memo.py     the parts of the last walk that the next may take as they are
    readback.py that tree back: load() into values, restore into live objects
    resume.py   optimizer state as file entries; restore(path, model | mapping)
    apply.py    a checked restore applied to live objects, all or nothing
    migrate.py  a checkpoint and its companions under a renamed model's names

Imports: ``files``, ``format`` and ``errors``.
"""

from .resume import checkpoint_files, restore
from .readback import load
from .tree import check_plain, flatten

__all__ = ["check_plain", "checkpoint_files", "flatten", "load", "restore"]

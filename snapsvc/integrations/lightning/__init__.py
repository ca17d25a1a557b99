"""``SnapsvcCheckpointIO``: Lightning's checkpoint IO through the snapsvc sidecar.

    trainer = pytorch_lightning.Trainer(plugins=[SnapsvcCheckpointIO(slots=2)])

``save_checkpoint`` stages Lightning's checkpoint dict into a shared-memory
slot (one ``SnapshotWriter.submit``) and returns; the sidecar writes the
``.fdl`` and its ``.meta`` at the path Lightning chose. ``load_checkpoint``
gives back the dict, so ``fit(ckpt_path=...)`` resumes.

The class works with both ``pytorch_lightning`` and ``lightning.pytorch``:
each ships its own ``CheckpointIO`` abstract base class and the Trainer
checks ``isinstance`` against its own, so the class is registered as a
virtual subclass of every one installed. Lightning is imported here only,
never by ``import snapsvc``; install it with ``pip install 'snapsvc[lightning]'``.

What a user of stock Lightning relies on, and what importing this module
adds so that it holds with the plugin too (a ``CheckpointIO`` sees neither
the trainer nor its callbacks, so three Lightning functions of each
installed flavour are wrapped; each wrapper changes nothing unless the
trainer's ``CheckpointIO`` is a ``SnapsvcCheckpointIO``):

- ``ModelCheckpoint.file_exists``: a path whose write is still in the
  sidecar exists, so ``ModelCheckpoint`` picks the next ``-vN`` name instead
  of saving over a checkpoint it already counts in ``best_k_models``.
- ``Trainer.fit``: the hyper-parameters of the model and datamodule are
  checked before training starts; one that cannot be stored fails there,
  not at the first checkpoint after an epoch. The plugin learns the trainer
  here, whose optimizers overlap mode guards.
- ``LightningModule.load_from_checkpoint`` (and the datamodule's) read a
  snapsvc checkpoint as ``load_checkpoint`` does; other files go to
  Lightning's own loader as before. Lightning never consults a
  ``CheckpointIO`` there, so this needs ``snapsvc.lightning`` imported.

What each module holds::

    plugin.py    SnapsvcCheckpointIO: save, load, remove, teardown; paths
    hparams.py   hyper-parameters stored without pickling, and read back
    wraps.py     the Lightning functions wrapped at import (listed above)
"""

from .plugin import SnapsvcCheckpointIO
from .wraps import register

__all__ = ["SnapsvcCheckpointIO"]

register()

"""``SnapsvcCheckpointIO``: Lightning's checkpoint IO through the snapsvc sidecar.

    trainer = pytorch_lightning.Trainer(plugins=[SnapsvcCheckpointIO(slots=2)])

``save_checkpoint`` stages Lightning's checkpoint dict into a shared-memory
slot (one ``SnapshotWriter.submit``) and returns; the sidecar writes the
``.fdl`` and its ``.meta`` at the path Lightning chose. ``load_checkpoint``
gives back the dict (``snapsvc.load``), so ``fit(ckpt_path=...)`` resumes.

The class works with both ``pytorch_lightning`` and ``lightning.pytorch``:
each ships its own ``CheckpointIO`` abstract base class and the Trainer
checks ``isinstance`` against its own, so the class is registered as a
virtual subclass of every one installed. Lightning is imported here only,
never by ``import snapsvc``; install it with ``pip install 'snapsvc[lightning]'``.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

import torch

from ..engine.writer import SnapshotWriter, WriteHandle
from ..state.resume import checkpoint_files
from ..state.tree import load

__all__ = ["SnapsvcCheckpointIO"]

log = logging.getLogger("snapsvc")

_BASES = ("lightning_fabric.plugins.io.checkpoint_io", "lightning.fabric.plugins.io.checkpoint_io")


class SnapsvcCheckpointIO:
    """A Lightning ``CheckpointIO`` plugin that writes through a snapsvc sidecar.

    ``writer_options`` go to :class:`snapsvc.SnapshotWriter`; the sidecar starts
    at the first save and stops at ``teardown`` (the end of each ``fit``).
    ``timeout``: seconds that a load, a removal or the teardown waits for
    pending writes. A failed write raises on the next ``save_checkpoint``,
    load or ``teardown``, once.

    Lightning's checkpoint dict is stored as it is; hyper-parameter values the
    state API refuses (an ``argparse.Namespace`` inside ``hparams``, say) are
    refused at save with :class:`snapsvc.errors.UnsupportedStateError` naming
    the key: ``load_from_checkpoint`` hands them back to ``__init__`` as
    stored, so turning them into dicts would change what it builds. Loads never
    unpickle, so ``weights_only`` has no effect and a file Lightning's default
    IO wrote (a pickle) is refused with ``FormatError``; tensors load on the
    CPU unless ``map_location`` names a device.
    """

    def __init__(self, *, timeout: float = 600.0, **writer_options: Any) -> None:
        # Lightning records every saved path (best_model_path, top-k): a dropped
        # snapshot or a copy still running after save returns would be a silent loss.
        if writer_options.get("policy", "block") != "block":
            raise ValueError(f"SnapsvcCheckpointIO needs policy='block', got "
                             f"{writer_options['policy']!r}: Lightning expects every save to land")
        if writer_options.get("overlap"):
            raise ValueError("SnapsvcCheckpointIO cannot use overlap=True: it needs writer.guard() on "
                             "the optimizer, which the plugin cannot reach; use the default overlap=False")
        SnapshotWriter(**writer_options)  # bad options fail here, not at the first save (starts nothing)
        self.timeout = timeout
        self._options = writer_options
        self._writer: SnapshotWriter | None = None
        self._handles: list[WriteHandle] = []

    @property
    def writer(self) -> SnapshotWriter | None:
        """The running sidecar's client (None before the first save and after teardown)."""
        return self._writer

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike[str],
                        storage_options: Any | None = None) -> None:
        """Stage ``checkpoint`` for ``path`` and return; the sidecar writes it."""
        if storage_options is not None:
            raise TypeError(f"SnapsvcCheckpointIO.save_checkpoint takes no storage_options, got "
                            f"{storage_options!r}; pass writer options to SnapsvcCheckpointIO() instead")
        self._raise_failed()
        path = _abs(path)
        os.makedirs(os.path.dirname(path), exist_ok=True)  # as Lightning's own IO does: no one else makes it
        if self._writer is None:
            self._writer = SnapshotWriter(**self._options).start()
        self._handles.append(self._writer.submit(checkpoint, path))

    def load_checkpoint(self, path: str | os.PathLike[str], map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The dict saved at ``path``, once any pending write to it is done."""
        if map_location is not None and not isinstance(map_location, (str, torch.device)):
            raise TypeError(f"SnapsvcCheckpointIO.load_checkpoint: map_location must be None, a str or "
                            f"a torch.device, got {type(map_location).__name__}")
        self._wait(path)
        self._raise_failed()
        state = load(_abs(path))
        if map_location is None:
            return state
        from lightning_utilities.core.apply_func import apply_to_collection
        return apply_to_collection(state, torch.Tensor, lambda t: t.to(map_location))

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Remove every file of the checkpoint at ``path``, after its pending write."""
        self._wait(path)
        for name in checkpoint_files(_abs(path)):
            try:
                os.remove(name)
            except FileNotFoundError:
                pass

    def teardown(self) -> None:
        """Drain pending writes and stop the sidecar; raise the first failed write."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.finish(timeout=self.timeout)
        self._raise_failed()

    def _wait(self, path: str | os.PathLike[str]) -> None:
        if self._writer is not None:
            self._writer.wait_path(_abs(path), timeout=self.timeout)

    def _raise_failed(self) -> None:
        """Raise the first failed write (each only once); forget finished ones."""
        done = [h for h in self._handles if h.done()]  # once: a handle may finish meanwhile
        self._handles = [h for h in self._handles if h not in done]
        failed = [h for h in done if h.exception() is not None]
        for h in failed[1:]:
            log.error("snapsvc: checkpoint %s failed too: %s", h.path, h.exception())
        if failed:
            raise failed[0].exception()


def _abs(path: str | os.PathLike[str]) -> str:
    """Lightning's paths resolve against the working directory, as its own IO does."""
    return os.path.abspath(path)


def _register() -> None:
    """Make the class a ``CheckpointIO`` for every Lightning flavour installed."""
    found = False
    for name in _BASES:
        try:
            base = importlib.import_module(name).CheckpointIO
        except ImportError:
            continue
        base.register(SnapsvcCheckpointIO)
        found = True
    if not found:
        raise ImportError("snapsvc.lightning needs Lightning (pytorch_lightning or lightning): "
                          "pip install 'snapsvc[lightning]'")


_register()

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

Hyper-parameters. Nothing is pickled, so ``hyper_parameters`` (and the
datamodule's) are stored as follows, and come back so from
``load_checkpoint`` and ``load_from_checkpoint``:

- ``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``, tensors, and
  dicts (str or int keys), lists and tuples of these: as they are
  (``OrderedDict`` and ``AttributeDict`` come back as ``dict``).
- NumPy scalars and arrays (``np.float64`` from Optuna, say): their dtype
  and bytes; they come back as the same NumPy type, bit for bit. Arrays of
  ``object`` dtype are refused.
- ``pathlib`` paths, ``set``, ``frozenset``, ``torch.dtype``,
  ``torch.device``, ``argparse.Namespace``: as that type, equal to the
  original (a set's items are encoded one by one).
- ``Enum`` members and dataclass instances: the class's module and name,
  and the member's name or the fields (encoded one by one). Loading finds
  the class in a module the process has already imported (snapsvc never
  imports what a file names) and raises ``UnsupportedStateError`` saying
  which module to import when it is not there; a dataclass is rebuilt by
  calling it with its ``init`` fields, the others are set after. A class
  that its module and name do not find again (one defined in a function)
  is refused.
- ``nn.Module``, optimizers and other objects with ``state_dict()``: refused,
  as they would come back as a dict of tensors. Lightning warns about
  module hyper-parameters too: ``save_hyperparameters(ignore=[...])`` them,
  their weights are in the model's ``state_dict`` already.
- Anything else is refused, naming its key.

Each encoded value is a dict holding the key ``"__snapsvc_type__"``; a
hyper-parameter dict of one's own with that key is refused.

Paths. Lightning's paths resolve against the working directory, as with its
own IO; ``file://`` URLs are local paths. Other URLs (``s3://``, ``gs://``)
are refused with :class:`~snapsvc.errors.PathError` when ``fit`` starts
(a ``ModelCheckpoint`` directory), and at save, load and removal: they
belong to a remote tier (a ``remote=`` option), which this version does not
have, and writing them under a local folder named ``s3:`` would lose them.
A symlink (``ModelCheckpoint(save_last="link")``) is read through to the
checkpoint it points at.

Overlap (``SnapsvcCheckpointIO(overlap=True)``). ``save_checkpoint``
copies the parameters, buffers and everything else at once, and returns
before each optimizer's per-parameter state (Adam's moments: two thirds of
an AdamW checkpoint) is copied; that copy runs on behind the next step.
Each optimizer of the fitting trainer gets ``SnapshotWriter.guard``: its
next ``step`` waits for the copy. Lightning calls ``step`` with a closure
that runs ``training_step`` and the backward (automatic optimization) or
nothing (``self.optimizers().step()``, manual optimization); for torch's own
optimizers the wait comes at the end of that closure, after the forward and
backward, before the optimizer writes its state. An optimizer whose class
has its own ``step`` waits before the step starts. Batches that accumulate
gradients do not step, so the copy runs on through them. Only the
optimizer's step writes its per-parameter state, which is why only that
part waits: parameters change outside a step too (``StochasticWeightAveraging``
and EMA callbacks write them in their hooks), as BatchNorm's buffers do in
every forward. A save outside ``fit`` (``trainer.save_checkpoint`` after
it) copies everything before it returns. Loads, removals and ``teardown``
wait for pending copies as for pending writes.

Multi-process (DDP): only rank 0 saves. ``load_checkpoint`` waits for rank
0's pending write of that path, then for every rank (``torch.distributed``
barrier), so no rank reads before the file is whole; Lightning has every
rank load a checkpoint, as this needs.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import importlib
import logging
import os
import pathlib
import re
import sys
import queue
import threading
import weakref
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch import nn

from ..engine.writer import SnapshotWriter, WriteHandle
from ..errors import FormatError, PathError, UnsupportedStateError
from ..files.checkpoint import checkpoint_version
from ..state.resume import checkpoint_files
from ..state.readback import load
from ..state.tree import StepState, flatten
from .wraps import wrap

__all__ = ["SnapsvcCheckpointIO"]

log = logging.getLogger("snapsvc")

_BASES = ("lightning_fabric.plugins.io.checkpoint_io", "lightning.fabric.plugins.io.checkpoint_io")
_FLAVOURS = ("pytorch_lightning", "lightning.pytorch")
_HPARAM_KEYS = ("hyper_parameters", "datamodule_hyper_parameters")  # Lightning's CHECKPOINT_HYPER_PARAMS_KEYs
_TAG = "__snapsvc_type__"
_PATHS = ("PurePath", "PurePosixPath", "PureWindowsPath", "Path", "PosixPath", "WindowsPath")
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


class SnapsvcCheckpointIO:
    """A Lightning ``CheckpointIO`` plugin that writes through a snapsvc sidecar.

    ``writer_options`` go to :class:`snapsvc.SnapshotWriter` (``overlap=True``: see
    the module docstring); the sidecar starts
    at the first save and stops at ``teardown`` (the end of each ``fit``).
    ``timeout``: seconds that a load, a removal or the teardown waits for
    pending writes. A failed write raises on the next ``save_checkpoint``,
    load or ``teardown``, once.

    Lightning's checkpoint dict is stored as it is, hyper-parameters as the
    module docstring lists. Loads never unpickle, so ``weights_only`` has no
    effect and a file Lightning's default IO wrote (a pickle) is refused with
    ``FormatError``; tensors load on the CPU unless ``map_location`` names a
    device.
    """

    def __init__(self, *, timeout: float = 600.0, **writer_options: Any) -> None:
        if "keep_last" in writer_options:
            raise ValueError("SnapsvcCheckpointIO does not take keep_last: retention belongs to "
                             "ModelCheckpoint (save_top_k, save_last), which lists the files it keeps, "
                             "the best one included; a writer pruning beside it deletes them")
        # Lightning records every saved path (best_model_path, top-k): a dropped
        # snapshot or a copy still running after save returns would be a silent loss.
        if writer_options.get("policy", "block") != "block":
            raise ValueError(f"SnapsvcCheckpointIO needs policy='block', got "
                             f"{writer_options['policy']!r}: Lightning expects every save to land")
        SnapshotWriter(**writer_options)  # bad options fail here, not at the first save (starts nothing)
        self.timeout = timeout
        self._options = writer_options
        self._writer: SnapshotWriter | None = None
        self._handles: list[WriteHandle] = []
        # path -> its removal, until its files are gone (see remove_checkpoint)
        self._doomed: dict[str, _Removal] = {}
        self._lock = threading.Lock()   # _doomed: the removals' thread changes it too
        # one thread runs the removals, in turn, started at the first: not a thread
        # per removal, whose start() waits until the new thread is scheduled
        self._removals: queue.SimpleQueue[_Removal | None] = queue.SimpleQueue()
        self._remover: threading.Thread | None = None
        self._trainer: Callable[[], Any] | None = None  # weakref to the fitting trainer (overlap)
        self._guards: list[tuple[torch.optim.Optimizer, Any]] = []  # (optimizer, its step hook)

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
        path = _local(path)
        self._settle(path)   # a removal of this path behind its old write: done first
        self._raise_failed()
        checkpoint = _encode_hparams(checkpoint)
        os.makedirs(os.path.dirname(path), exist_ok=True)  # as Lightning's own IO does: no one else makes it
        if self._writer is None:
            self._writer = SnapshotWriter(**self._options).start()
        if self._writer.overlap and self._guard_optimizers():
            checkpoint = _mark_step_state(checkpoint)
        self._handles.append(self._writer.submit(checkpoint, path))

    def load_checkpoint(self, path: str | os.PathLike[str], map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The dict saved at ``path``, once any pending write to it is done (on every rank)."""
        if map_location is not None and not isinstance(map_location, (str, torch.device)):
            raise TypeError(f"SnapsvcCheckpointIO.load_checkpoint: map_location must be None, a str or "
                            f"a torch.device, got {type(map_location).__name__}")
        path = _local(path)
        self._wait(path)
        _all_ranks_here()
        self._raise_failed()
        return _read(path, map_location)

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Remove every file of the checkpoint at ``path``, on a thread of its own.

        Neither a write to ``path`` still in the sidecar nor the removal itself
        is waited for: ``ModelCheckpoint`` drops a top-k file right after the
        next save, often while it is still being written, and unlinking a large
        file that was written durably can take as long as copying it (a file
        system that discards the freed blocks). The files go once written; from
        now on ``path`` exists for nobody (:meth:`pending` is False; a save or
        load of it, and ``teardown``, first finish the removal, and raise its
        error). A symlink is removed, not what it points at (as Lightning's own
        IO does)."""
        path = _local(path)
        writes = [h for h in self._handles if h.path == path and not h.done()]
        removal = _Removal(path, writes[-1] if writes else None)
        with self._lock:
            if path in self._doomed:  # removed already, not saved since (a save settles it first)
                return
            self._doomed[path] = removal
            if self._remover is None:   # a daemon: teardown finishes what it has not
                self._remover = threading.Thread(target=self._remove_all, args=(self._removals,),
                                                 name="snapsvc-remove", daemon=True)
                self._remover.start()
            self._removals.put(removal)

    def _remove_all(self, removals: "queue.SimpleQueue[_Removal | None]") -> None:
        """The removals' thread: each removal in turn, until teardown's None."""
        while (removal := removals.get()) is not None:
            self._bury(removal, False)

    def _bury(self, removal: _Removal, raise_error: bool = True) -> None:
        """Run ``removal`` (or wait for the thread running it); forget it once its files are gone.
        A failed one stays due, so the next save or load of its path and ``teardown`` raise it."""
        try:
            removal.run(self.timeout)
        except Exception as e:
            if not raise_error:
                log.warning("snapsvc: removing %s failed (raised at its next save or load, or at "
                            "teardown): %s", removal.path, e)
                return
            if removal.finished:  # raised once; a write still pending keeps it due
                self._forget(removal)
            raise
        self._forget(removal)

    def _forget(self, removal: _Removal) -> None:
        with self._lock:
            if self._doomed.get(removal.path) is removal:
                del self._doomed[removal.path]

    def _settle(self, path: str) -> None:
        """Finish a removal of ``path`` now: wait for its write, then remove."""
        removal = self._doomed.get(path)
        if removal is not None:
            self._bury(removal)

    def teardown(self) -> None:
        """Drain pending writes and stop the sidecar; raise the first failed write."""
        writer, self._writer = self._writer, None
        try:
            if writer is not None:
                writer.finish(timeout=self.timeout)  # overlap copies finish first
            for removal in list(self._doomed.values()):  # written now: removed here or by their thread
                self._bury(removal)
        finally:
            with self._lock:   # its thread stops once through what it holds (done by now)
                if self._remover is not None:
                    self._removals.put(None)
                    self._remover = None
            for _, hook in self._guards:
                hook.remove()
            self._guards = []
        self._raise_failed()

    def pending(self, path: str | os.PathLike[str]) -> bool:
        """Whether a write to ``path`` is still in the sidecar."""
        path = _local(path)
        return path not in self._doomed and any(h.path == path and not h.done()
                                                for h in self._handles)

    def removing(self, path: str | os.PathLike[str]) -> bool:
        """Whether ``path`` was removed while its write is still landing (gone once written)."""
        return _local(path) in self._doomed

    def _guard_optimizers(self) -> bool:
        """Overlap mode: guard every optimizer of the fitting trainer (once each), so
        that its next step waits for this save's copy. False when there is no such
        trainer (a save outside ``fit``) or an optimizer is not a torch one: then
        the whole checkpoint is copied before ``save_checkpoint`` returns."""
        trainer = self._trainer() if self._trainer is not None else None
        optimizers = list(getattr(trainer, "optimizers", None) or [])
        if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
            return False
        guarded = {id(o) for o, _ in self._guards}
        for opt in optimizers:
            if id(opt) not in guarded:
                self._guards.append((opt, self._writer.guard(opt)))
        return True

    def _wait(self, path: str) -> None:
        self._settle(path)
        if self._writer is not None:
            for name in {path, os.path.realpath(path)}:  # a link's target may be the pending one
                self._writer.wait_path(name, timeout=self.timeout)

    def _raise_failed(self) -> None:
        """Raise the first failed write (each only once); forget finished ones."""
        done = [h for h in self._handles if h.done()]  # once: a handle may finish meanwhile
        self._handles = [h for h in self._handles if h not in done]
        failed = [h for h in done if h.exception() is not None]
        for h in failed[1:]:
            log.error("snapsvc: checkpoint %s failed too: %s", h.path, h.exception())
        if failed:
            raise failed[0].exception()


def _remove_files(path: str) -> None:
    for name in checkpoint_files(path):  # metadata first
        try:
            os.remove(name)
        except FileNotFoundError:
            pass


class _Removal:
    """Removing the files of the checkpoint at ``path`` once ``write`` (its write still
    in the sidecar, or None) is done, by whichever thread comes first; the others wait."""

    def __init__(self, path: str, write: WriteHandle | None) -> None:
        self.path = path
        self.write = write
        self._claim = threading.Lock()   # taken once, never released: by the remover
        self._finished = threading.Event()
        self._error: BaseException | None = None

    @property
    def finished(self) -> bool:
        """Whether the files were removed, or their removal failed."""
        return self._finished.is_set()

    def run(self, timeout: float) -> None:
        """Remove the files, or wait up to ``timeout`` s for the thread removing them;
        raise the removal's error (a failed write is raised by the plugin, not here)."""
        if self.write is not None:
            self.write.exception(timeout=timeout)
        if self._claim.acquire(blocking=False):
            try:
                _remove_files(self.path)
            except BaseException as e:
                self._error = e
            finally:
                self._finished.set()
        elif not self._finished.wait(timeout):
            raise TimeoutError(f"{self.path}: its removal did not finish within {timeout} s "
                               "(SnapsvcCheckpointIO(timeout=...))")
        if self._error is not None:
            raise self._error


def _mark_step_state(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint`` (a copy of Lightning's) with each optimizer's per-parameter state
    marked as written only by its step, the part overlap mode copies behind the next
    step. The parameters, buffers and the rest are copied before the save returns:
    they change outside a step too (BatchNorm in a forward, weight averaging and EMA
    callbacks in their hooks, a scheduler's tensor ``lr`` in ``param_groups``)."""
    states = checkpoint.get("optimizer_states")
    if isinstance(states, list):
        checkpoint["optimizer_states"] = [
            {**s, "state": StepState(s["state"])} if type(s) is dict and "state" in s else s
            for s in states]  # a dict, as state_dict() gives it: stored as the same type
    return checkpoint


def _is_snapsvc_file(path: Any) -> bool:
    """Whether ``path`` is a local ``.fdl`` file (its magic and version read)."""
    if not isinstance(path, (str, os.PathLike)):
        return False
    try:
        checkpoint_version(_local(path))
    except (OSError, FormatError, PathError):
        return False
    return True


# -- paths ------------------------------------------------------------------------------------

def _local(path: str | os.PathLike[str]) -> str:
    """The absolute local path Lightning means; a URL other than ``file://`` is refused."""
    text = os.fspath(path)
    url = _URL.match(text)
    if url and url.group(1).lower() == "file":
        text = text[url.end():]
    elif url:
        raise PathError(f"{text}: SnapsvcCheckpointIO writes to the local file system, and "
                        f"{url.group(1)}:// is not one. URLs go to snapsvc's remote tier through its "
                        "remote= option, which this version does not have: give ModelCheckpoint a local "
                        "dirpath (Lightning's default IO writes URLs through fsspec)")
    return os.path.abspath(text)


def _read(path: str, device: str | torch.device | None) -> dict[str, Any]:
    """The checkpoint at ``path`` (a link read through), hyper-parameters decoded, on ``device``."""
    state = _decode_hparams(load(os.path.realpath(path)))
    if device is None:
        return state
    from lightning_utilities.core.apply_func import apply_to_collection
    return apply_to_collection(state, torch.Tensor, lambda t: t.to(device))


def _all_ranks_here() -> None:
    """A barrier over the default process group, when there is one of more than one rank."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


# -- hyper-parameters ---------------------------------------------------------------------------

def _encode_hparams(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """``checkpoint`` with its hyper-parameters in storable form (see the module docstring)."""
    out = dict(checkpoint)
    for key in _HPARAM_KEYS:
        if key in out:
            out[key] = _Encoder(key).value(out[key], ())
    return out


def _check_hparams(key: str, hparams: Mapping[str, Any]) -> None:
    """Raise ``UnsupportedStateError`` naming the first value of ``hparams`` a save would refuse."""
    flatten({key: _Encoder(key).value(dict(hparams), ())})


def _decode_hparams(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Undo :func:`_encode_hparams` in place; returns ``checkpoint``."""
    for key in _HPARAM_KEYS:
        if key in checkpoint:
            checkpoint[key] = _decode(checkpoint[key], key)
    return checkpoint


class _Encoder:
    def __init__(self, root: str) -> None:
        self.root = root
        self.open: set[int] = set()  # containers on the current path: a cycle revisits one

    def refuse(self, path: tuple, what: str) -> UnsupportedStateError:
        where = self.root + "".join(f"[{k!r}]" for k in path)
        return UnsupportedStateError(f"{where}: {what}", path=where)

    def value(self, v: Any, path: tuple) -> Any:
        t = type(v)
        if v is None or t in (bool, int, float, str, bytes) or isinstance(v, torch.Tensor):
            return v  # the state API stores (and checks) these itself
        if isinstance(v, Mapping) or t in (list, tuple):
            if id(v) in self.open:
                raise self.refuse(path, "a cycle: this container contains itself")
            self.open.add(id(v))
            try:
                return self.container(v, path)
            finally:
                self.open.discard(id(v))
        if t in (set, frozenset):
            return _tagged(t.__name__, items=[self.value(item, path + ("<item>",)) for item in v])
        if not isinstance(v, type) and (isinstance(v, nn.Module) or hasattr(v, "state_dict")):
            kind = "an nn.Module" if isinstance(v, nn.Module) else "an object with state_dict()"
            raise self.refuse(path, f"a {t.__name__} ({kind}) would come back as a dict of tensors "
                                    "(snapsvc never pickles); leave it out with save_hyperparameters("
                                    f"ignore=[{path[0] if path else '...'!r}])")
        np = sys.modules.get("numpy")
        if np is not None and isinstance(v, (np.generic, np.ndarray)):
            if v.dtype.hasobject:
                raise self.refuse(path, f"a NumPy value of dtype {v.dtype} (objects are not stored)")
            scalar = isinstance(v, np.generic)
            return _tagged("numpy", dtype=v.dtype.str, shape=None if scalar else list(v.shape),
                           data=np.ascontiguousarray(v).tobytes())
        if isinstance(v, pathlib.PurePath):
            return _tagged("path", cls=t.__name__ if t.__name__ in _PATHS else "Path", value=str(v))
        if t is torch.dtype:
            return _tagged("torch.dtype", value=str(v).removeprefix("torch."))
        if t is torch.device:
            return _tagged("torch.device", value=str(v))
        if t is argparse.Namespace:
            return _tagged("namespace", attrs=self.value(vars(v), path))
        if isinstance(v, enum.Enum):
            return _tagged("enum", cls=self.class_ref(t, path), name=v.name)
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            fields = {f.name: self.value(getattr(v, f.name), path + (f.name,))
                      for f in dataclasses.fields(v)}
            return _tagged("dataclass", cls=self.class_ref(t, path), fields=fields)
        raise self.refuse(path, f"a value of type {t.__name__} is not storable: hyper-parameters may be "
                                "None, bool, int, float, str, bytes, tensors, NumPy values, paths, sets, "
                                "torch dtypes and devices, Namespaces, Enums, dataclasses, and dicts, "
                                "lists and tuples of these")

    def container(self, v: Any, path: tuple) -> Any:
        if not isinstance(v, Mapping):
            return type(v)(self.value(item, path + (i,)) for i, item in enumerate(v))
        if _TAG in v:
            raise self.refuse(path, f"a dict with the key {_TAG!r}, which snapsvc reserves")
        return {k: self.value(item, path + (k,)) for k, item in v.items()}

    def class_ref(self, cls: type, path: tuple) -> str:
        """``module:qualname``, refused unless loading can find the class by it."""
        ref = f"{cls.__module__}:{cls.__qualname__}"
        if _lookup(ref) is not cls:
            raise self.refuse(path, f"{cls.__qualname__} cannot be found again by its module and name "
                                    f"({ref}): define it at the top level of a module")
        return ref


def _tagged(kind: str, **fields: Any) -> dict[str, Any]:
    return {_TAG: kind, **fields}


def _lookup(ref: str) -> Any:
    """The object ``module:qualname`` in a module already imported, or None."""
    module, _, qualname = ref.partition(":")
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


def _find_class(ref: str, where: str, kind: Callable[[Any], bool]) -> Any:
    """The class ``module:qualname`` from a module already imported (never imports one)."""
    obj = _lookup(ref)
    if obj is None or not kind(obj):
        module, _, qualname = ref.partition(":")
        raise UnsupportedStateError(f"{where}: the class {qualname} of module {module} is not loaded; "
                                    f"import {module} before loading (snapsvc never imports modules "
                                    "a checkpoint names)", path=where)
    return obj


def _decode(v: Any, where: str) -> Any:
    if isinstance(v, dict):
        kind = v.get(_TAG)
        if kind is None:
            return {k: _decode(item, f"{where}[{k!r}]") for k, item in v.items()}
        if kind not in _DECODERS:
            raise FormatError(f"{where}: unknown encoded hyper-parameter kind {kind!r} (a newer snapsvc "
                              "wrote it?)")
        return _DECODERS[kind](v, where)
    if type(v) in (list, tuple):
        return type(v)(_decode(item, f"{where}[{i}]") for i, item in enumerate(v))
    return v


def _numpy(v: dict, where: str) -> Any:
    import numpy as np
    array = np.frombuffer(v["data"], dtype=np.dtype(v["dtype"])).copy()  # a writable array of its own
    return array[0] if v["shape"] is None else array.reshape(v["shape"])


def _dataclass(v: dict, where: str) -> Any:
    cls = _find_class(v["cls"], where, lambda c: isinstance(c, type) and dataclasses.is_dataclass(c))
    fields = {k: _decode(item, f"{where}.{k}") for k, item in v["fields"].items()}
    init = {f.name for f in dataclasses.fields(cls) if f.init}
    obj = cls(**{k: item for k, item in fields.items() if k in init})
    for k, item in fields.items():
        if k not in init:
            object.__setattr__(obj, k, item)  # a frozen dataclass too
    return obj


def _is_enum(c: Any) -> bool:
    return isinstance(c, type) and issubclass(c, enum.Enum)


def _torch_dtype(v: dict, where: str) -> torch.dtype:
    dtype = getattr(torch, v["value"], None)
    if not isinstance(dtype, torch.dtype):
        raise UnsupportedStateError(f"{where}: torch has no dtype {v['value']!r}", path=where)
    return dtype


_DECODERS: dict[str, Callable[[dict, str], Any]] = {
    "set": lambda v, w: {_decode(item, w) for item in v["items"]},
    "frozenset": lambda v, w: frozenset(_decode(item, w) for item in v["items"]),
    "numpy": _numpy,
    "path": lambda v, w: getattr(pathlib, v["cls"] if v["cls"] in _PATHS else "Path")(v["value"]),
    "torch.dtype": _torch_dtype,
    "torch.device": lambda v, w: torch.device(v["value"]),
    "namespace": lambda v, w: argparse.Namespace(**_decode(v["attrs"], w)),
    "enum": lambda v, w: _find_class(v["cls"], w, _is_enum)[v["name"]],
    "dataclass": _dataclass,
}


# -- Lightning's side -------------------------------------------------------------------------

def _plugin(trainer: Any) -> SnapsvcCheckpointIO | None:
    """The trainer's ``SnapsvcCheckpointIO``, also inside a wrapper such as ``AsyncCheckpointIO``."""
    io = getattr(trainer.strategy, "_checkpoint_io", None)
    while io is not None and not isinstance(io, SnapsvcCheckpointIO):
        io = getattr(io, "_checkpoint_io", None)
    return io


def _file_exists(original: Callable[..., bool]) -> Callable[..., bool]:
    @functools.wraps(original)
    def file_exists(self: Any, filepath: Any, trainer: Any) -> bool:
        io = _plugin(trainer)
        if io is None:
            return original(self, filepath, trainer)
        # Asked before the file system, so a write landing in between is seen by one or the
        # other; reduced across ranks as Lightning reduces its own answer (rank 0 saves).
        # A removed path whose write is still landing exists for no one, as with stock.
        reduce = trainer.strategy.reduce_boolean_decision
        pending = reduce(trainer.is_global_zero and io.pending(filepath), all=False)
        removed = reduce(trainer.is_global_zero and io.removing(filepath), all=False)
        return pending or (not removed and original(self, filepath, trainer))
    return file_exists


def _fit(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def fit(self: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        io = _plugin(self)
        if io is not None:
            io._trainer = weakref.ref(self)  # overlap mode guards its optimizers at each save
            for callback in self.checkpoint_callbacks:  # a URL fails now, not at the first save
                _local(getattr(callback, "dirpath", None) or self.default_root_dir)
            for obj in (model, *args, *kwargs.values()):  # the model and a datamodule, however passed
                key = getattr(type(obj), "CHECKPOINT_HYPER_PARAMS_KEY", None)
                if key in _HPARAM_KEYS and getattr(obj, "hparams", None):
                    _check_hparams(key, obj.hparams)
        return original(self, model, *args, **kwargs)
    return fit


def _pl_load(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def pl_load(path_or_url: Any, map_location: Any = None, weights_only: Any = None) -> Any:
        if not _is_snapsvc_file(path_or_url):
            return original(path_or_url, map_location=map_location, weights_only=weights_only)
        if callable(map_location):  # torch's form: where a CPU storage goes (None: stays) is where all go
            moved = map_location(torch.UntypedStorage(0), "cpu")
            map_location = None if moved is None else moved.device
        elif isinstance(map_location, dict):
            map_location = map_location.get("cpu")
        return _read(_local(path_or_url), map_location)
    return pl_load


def _register() -> None:
    """Make the class a ``CheckpointIO`` for every Lightning flavour installed, and wrap
    the Lightning functions the module docstring lists."""
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
    for flavour in _FLAVOURS:
        try:
            checkpoint = importlib.import_module(f"{flavour}.callbacks.model_checkpoint")
            trainer = importlib.import_module(f"{flavour}.trainer.trainer")
            saving = importlib.import_module(f"{flavour}.core.saving")
        except ImportError:
            continue
        wrap(checkpoint.ModelCheckpoint, "file_exists", _file_exists)
        wrap(trainer.Trainer, "fit", _fit)
        wrap(saving, "pl_load", _pl_load)


_register()

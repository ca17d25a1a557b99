"""Lightning's hyper-parameters, stored without pickling (``snapsvc.integrations.lightning``).

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

The top-level keys a user adds in ``on_save_checkpoint`` are stored the same
way (a ``set``, ``np.random.get_state()``), as stock's pickle stores them.

Each encoded value is a dict holding the key ``"__snapsvc_type__"``; a
hyper-parameter dict of one's own with that key is refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import pathlib
import sys
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch import nn

from ...errors import FormatError, UnsupportedStateError
from ...state.tree import flatten

__all__ = ["HPARAM_KEYS", "encode_hparams", "check_hparams", "decode_hparams"]

HPARAM_KEYS = ("hyper_parameters", "datamodule_hyper_parameters")  # Lightning's CHECKPOINT_HYPER_PARAMS_KEYs
# The keys Lightning's own checkpoint dict holds; every other top-level key was added by
# the user (on_save_checkpoint) and is stored as hyper-parameters are: a set or NumPy's
# random state comes back as with stock's pickle.
_LIGHTNING_KEYS = frozenset({"epoch", "global_step", "pytorch-lightning_version", "state_dict", "loops",
                             "callbacks", "optimizer_states", "lr_schedulers", "hparams_name"})
_TAG = "__snapsvc_type__"
_PATHS = ("PurePath", "PurePosixPath", "PureWindowsPath", "Path", "PosixPath", "WindowsPath")


def encode_hparams(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """``checkpoint`` with its hyper-parameters in storable form (see the module docstring)."""
    out = dict(checkpoint)
    for key in out:
        if key in HPARAM_KEYS or (isinstance(key, str) and key not in _LIGHTNING_KEYS
                                  and not key[:1].isupper()):  # a precision plugin's state: its class name
            out[key] = _Encoder(key).value(out[key], ())
    return out


def check_hparams(key: str, hparams: Mapping[str, Any]) -> None:
    """Raise ``UnsupportedStateError`` naming the first value of ``hparams`` a save would refuse."""
    flatten({key: _Encoder(key).value(dict(hparams), ())})


def decode_hparams(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Undo :func:`encode_hparams` in place; returns ``checkpoint``."""
    for key in checkpoint:
        if key not in _LIGHTNING_KEYS:  # changes only what encode_hparams tagged
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

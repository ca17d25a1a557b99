"""``.pt`` / ``.pth`` state dicts.

A plain ``dict`` of ``str -> Tensor`` written with ``torch.save``
(atomically); read with ``torch.load(weights_only=True, map_location="cpu")``
only, so no arbitrary object is ever unpickled. A ``{"state_dict": {...}}``
or ``{"model": {...}}`` wrapper is unwrapped when exactly one of those keys
is present.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
import torch

from ..errors import EncodeError, FormatError
from ..format import fdl
from .durable import atomic_write
from .tensors import _cpu_contiguous

__all__ = ["read_state_dict", "write_state_dict"]

log = logging.getLogger("snapsvc.convert")


# -- .pt ----------------------------------------------------------------------------
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _torch_load_reason(e: BaseException) -> str:
    """One line from torch.load's error: for a weights-only refusal, the reason
    (not the advice to load with ``weights_only=False``)."""
    text = _ANSI.sub("", str(e)).strip()
    lines = [ln.strip() for ln in text.splitlines()]
    if lines and lines[0].startswith("Weights only load failed"):
        for ln in lines[1:]:
            if ln.startswith(("(1)", "(2)", "Check the documentation", "Please file an issue")):
                continue
            ln = ln.partition("WeightsUnpickler error:")[2].strip() or ln
            ln = ln.split(" Please use ")[0].strip()
            if ln and not ln.startswith("WeightsUnpickler error"):
                return f"torch refused to unpickle it with weights_only=True: {ln}"
        return "torch refused to unpickle it with weights_only=True"
    return next((ln for ln in lines if ln), type(e).__name__)


def _tensor_mapping(obj: object, path: str, where: str = "") -> dict[str, torch.Tensor] | None:
    """``obj`` as str -> Tensor, None if it is no mapping; FormatError on a bad value."""
    if not isinstance(obj, Mapping):
        return None
    out: dict[str, torch.Tensor] = {}
    for k, v in obj.items():
        name = f"{where}{k}" if isinstance(k, str) else repr(k)
        if not isinstance(k, str):
            raise FormatError(f"key {k!r} is not a str; a state dict maps names to tensors",
                              path=path)
        if not isinstance(v, torch.Tensor):
            raise FormatError(f"expected a torch.Tensor, got {type(v).__name__}; a state "
                              "dict maps names to tensors", path=path, entry=name)
        out[k] = fdl.check_bools(v, path=path, entry=name, offset=None)
    return out


def read_state_dict(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Load a ``.pt`` state dict with ``torch.load(weights_only=True)``, on the CPU.

    The file must hold a mapping of str to Tensor, or a mapping with exactly
    one of the keys ``state_dict`` and ``model`` whose value is one (the
    other keys, such as an optimizer's state, are ignored and logged).
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        try:
            obj = torch.load(f, weights_only=True, map_location="cpu")
        except Exception as e:  # torch raises many unrelated types for a bad file
            raise FormatError(f"not a loadable weights-only torch file: {_torch_load_reason(e)}",
                              path=path) from None
    if not isinstance(obj, Mapping):
        raise FormatError(f"holds a {type(obj).__name__}, not a mapping of names to tensors",
                          path=path)
    if all(isinstance(v, torch.Tensor) for v in obj.values()):
        return _tensor_mapping(obj, path) or {}
    wrappers = [k for k in ("state_dict", "model") if k in obj]
    if len(wrappers) == 1 and isinstance(obj[wrappers[0]], Mapping):
        key = wrappers[0]
        others = [str(k) for k in obj if k != key]
        if others:
            log.info("%s: using %r, ignoring the other keys %s", path, key, others[:10])
        return _tensor_mapping(obj[key], path, f"{key}.") or {}
    if len(wrappers) == 2:
        raise FormatError("holds both 'state_dict' and 'model'; cannot tell which is the "
                          "state dict", path=path)
    return _tensor_mapping(obj, path) or {}  # raises, naming the first non-tensor


def write_state_dict(path: str | os.PathLike[str], entries: list[tuple[str, torch.Tensor]]) -> None:
    """``torch.save`` a plain dict of CPU tensors, atomically."""
    sd: dict[str, torch.Tensor] = {}
    for name, t in entries:
        if not isinstance(name, str):
            raise EncodeError(f"entry name {name!r} is not a str")
        if not isinstance(t, torch.Tensor):
            raise EncodeError(f"entry {name!r}: expected a torch.Tensor, got {type(t).__name__}")
        if name in sd:
            raise EncodeError(f"entry {name!r} appears twice; names must be unique")
        t = _cpu_contiguous(t)
        if t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()  # a view: save its own bytes, not the whole storage behind it
        sd[name] = t
    with atomic_write(path) as out:
        # torch.save writes to any object with write(); its annotation says IO[bytes]
        torch.save(sd, out)  # type: ignore[arg-type]

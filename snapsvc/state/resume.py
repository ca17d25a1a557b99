"""Resuming training: optimizer state and ``extra`` beside the model checkpoint.

Layout on disk, for ``submit(model, "run/step10.fdl", optimizer=opt, extra=...)``::

    run/step10.fdl          the model, exactly as flodl writes it (params, buffers)
    run/step10.optim.fdl    the optimizer's tensors, named "<param name>:<state key>"
    run/step10.fdl.meta     msgpack: epoch, metrics, extra, and the optimizer's
                            class, param groups (hyperparameters by param name),
                            non-tensor state, and the optimizer file's size and CRC

Why a second file and not extra entries in the model file: flodl, and anyone
loading the model alone, should see exactly the model. Extra entries would
show up as ``skipped`` in every load report and make ``strict`` loads fail;
a separate ``.fdl`` keeps the model file byte-identical to one written
without an optimizer while still reusing the same codec, checks and tools.
The files are committed in the order model, optimizer, metadata, so the
metadata (written last) vouches for both: :func:`restore` checks each file's
size and CRC-32 against it while reading.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..errors import ArchitectureMismatchError, FormatError, StrictLoadError, \
    UnsupportedStateError
from ..files.checkpoint import Checkpoint, LoadReport, model_tensors, plan_load
from ..files.meta import Meta, checkpoint_names, optim_path, read_companion, read_meta, \
    read_with_data
from .apply import Plan, apply
from .readback import OPTIM_SEP, restore_state, saved_optimizer
from .tree import plan_model_extra_states

__all__ = ["OPTIM_SEP", "optim_path", "optimizer_state", "optimizer_state_dict",
           "checkpoint_files", "read_optim_file", "restore"]


def _plain(value: Any, where: str) -> Any:
    """A hyperparameter or state value as msgpack can hold it."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (tuple, list)):
        return [_plain(v, where) for v in value]
    raise UnsupportedStateError(
        f"{where} is a {type(value).__name__}; submit(model, optimizer=) stores an optimizer's "
        "hyperparameters and non-tensor state as numbers, str and lists of them; "
        "submit({'model': model, 'opt': opt}, path) stores any optimizer state", path=where)


def optimizer_state(optimizer: torch.optim.Optimizer, names: dict[int, str]
                    ) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
    """Split ``optimizer``'s state into named tensors and a msgpack-able description.

    ``names`` maps ``id(param)`` to the parameter's name in the model.
    """
    groups = []
    for i, group in enumerate(optimizer.param_groups):
        try:
            params = [names[id(p)] for p in group["params"]]
        except KeyError:
            raise ArchitectureMismatchError(
                f"param group {i} of the optimizer holds a tensor that is not a parameter of "
                "the submitted model; pass the optimizer of this model") from None
        hyper = {k: _plain(v, f"param group {i} key {k!r}") for k, v in group.items()
                 if k != "params"}
        groups.append({"params": params, "hyper": hyper})
    tensors: list[tuple[str, torch.Tensor]] = []
    scalars: dict[str, dict[str, Any]] = {}
    for p, state in optimizer.state.items():
        name = names[id(p)]
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors.append((f"{name}{OPTIM_SEP}{key}", value))
            else:
                scalars.setdefault(name, {})[key] = _plain(value, f"state {name!r} key {key!r}")
    info = {"class": type(optimizer).__name__, "groups": groups, "scalars": scalars}
    return tensors, info


def optimizer_state_dict(optimizer: torch.optim.Optimizer, model: nn.Module,
                         tensors: dict[str, torch.Tensor], info: dict[str, Any],
                         where: str) -> dict[str, Any]:
    """Rebuild, and check, a ``state_dict`` for ``optimizer`` from saved names."""
    if info.get("class") != type(optimizer).__name__:
        raise ArchitectureMismatchError(
            f"{where}: the saved optimizer is a {info.get('class')}, the live one a "
            f"{type(optimizer).__name__}; restore into the optimizer class that saved it")
    names = {id(p): n for n, p in model.named_parameters()}
    current = [[names.get(id(p)) for p in g["params"]] for g in optimizer.param_groups]
    saved = [g["params"] for g in info["groups"]]
    if current != saved:
        raise ArchitectureMismatchError(
            f"{where}: the optimizer's param groups {_shape(current)} do not match the saved "
            f"ones {_shape(saved)}; build the optimizer the same way")
    sd = saved_optimizer(tensors, info, where)
    # msgpack has no tuple: a hyperparameter the live group holds as one (Adam's
    # betas) comes back as one, as after torch.save/torch.load
    for group, live in zip(sd["param_groups"], optimizer.param_groups):
        for k, v in group.items():
            if type(v) is list and type(live.get(k)) is tuple:
                group[k] = tuple(v)
    return sd


def _shape(groups: list[list[Any]]) -> str:
    return "[" + ", ".join(f"{len(g)} params" for g in groups) + "]"


def checkpoint_files(path: str | os.PathLike[str]) -> list[str]:
    """Every file of the checkpoint at ``path`` that exists, metadata first:
    removing them in this order never leaves a checkpoint that looks whole."""
    return [p for p in checkpoint_names(path) if os.path.exists(p)]


def _read_model_file(path: str, meta: Meta, model: nn.Module) -> Checkpoint:
    """``path`` checked against ``meta``, its entries views of one mapping of
    the file for copying into ``model`` (of a page-locked buffer when
    ``model`` is on CUDA), then its data file's (a bool buffer, say)."""
    return read_with_data(path, meta, shared_buffer=True, pin_memory=_on_cuda(model))


def read_optim_file(path: str, meta: Meta) -> Checkpoint:
    """The optimizer file the metadata names beside ``path``, checked against
    ``meta.optimizer`` while read; its tensors are the optimizer's new state,
    so each is its own."""
    found = read_companion(path, meta, "optimizer file")
    if found is None:
        raise FormatError("no optimizer state was saved with this checkpoint", path=path)
    return found


def _on_cuda(model: nn.Module) -> bool:
    return any(t.is_cuda for _, t in model_tensors(model))


def restore(path: str | os.PathLike[str], target: nn.Module | Mapping[Any, Any],
            optimizer: torch.optim.Optimizer | None = None, *, strict: bool = False
            ) -> LoadReport:
    """Bring back what a submit saved, into live objects.

    ``target`` a model: loads it (flodl's rules), the optimizer's state when
    ``optimizer`` is given (``submit(model, ..., optimizer=)``). ``target`` a
    mapping of live objects (``submit(state, ...)``): tensors are copied in
    place, modules loaded, ``load_state_dict`` called on optimizers and
    stateful objects; non-tensor values come back in ``report.state``.
    The :class:`LoadReport`'s ``epoch``, ``metrics`` and ``extra`` come from
    the metadata. Everything is read and checked (each file's size and CRC-32
    against the metadata too) before anything changes; what fails while
    applying (a ``set_extra_state`` that raises) undoes every change.
    """
    path = os.fspath(path)
    if isinstance(target, Mapping):
        if optimizer is not None:
            raise TypeError("restore(path, state_mapping) takes optimizers inside the mapping")
        return restore_state(path, target, strict=strict)
    model = target
    meta = read_meta(path)
    ckpt = _read_model_file(path, meta, model)
    optim_sd = None
    if optimizer is not None:
        if not meta.optimizer:
            raise FormatError("no optimizer state was saved with this checkpoint "
                              "(submit(..., optimizer=opt) saves it)", path=path)
        optim_sd = optimizer_state_dict(optimizer, model, read_optim_file(path, meta).entries,
                                        meta.optimizer, optim_path(path))
    report, targets = plan_load(ckpt, model, strict=strict)  # checks every tensor
    plan = Plan(report=report)
    plan.extras = plan_model_extra_states(model, meta.extra_state, report)
    if strict and (report.skipped or report.missing):  # the extra states' names
        raise StrictLoadError(
            f"{path}: strict load: extra states {report.skipped[:5]} not in the model, "
            f"{report.missing[:5]} not in the checkpoint; pass strict=False to load the overlap")
    plan.copies = [(name, t, ckpt.entries[name]) for name, t in targets]
    if optim_sd is not None:
        plan.loads.append(("optimizer", optimizer, optim_sd))
    apply(plan)  # nothing has changed before this; it undoes what it did if it fails
    report.epoch, report.metrics, report.extra = meta.epoch, dict(meta.metrics), meta.extra
    return report

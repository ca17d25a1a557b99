"""A flattened state the other way: back into values (load), or into live objects (restore_state).

Reading trusts nothing the tree says: kinds, names and inline tensors are
checked against the entries; a restore checks every shape, class and
writability first, then applies, and rolls every object back if applying
fails.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, cast
import torch
from torch import nn

from ..files.checkpoint import LoadReport, copy_problem, persistent_buffers
from ..files.fused import Pairs
from ..format import fdl, kinds
from ..errors import ArchitectureMismatchError, FormatError, ShapeMismatchError, \
    StrictLoadError, TargetNotWritableError
from ..files.meta import Meta, meta_path, read_companion, read_meta, read_with_data
from ..format.protocol import InlineTensor, ObjectNode, TensorRef
from .apply import Plan, apply
from .paths import path_name, show
from .tree import INLINE_DTYPES, extra_states

__all__ = ["load", "rebuild", "restore_state", "restore_tree", "saved_optimizer", "OPTIM_SEP"]

OPTIM_SEP = ":"  # an optimizer file's entries are "<param name>:<state key>"


# -- reading back ------------------------------------------------------------------
def _inline_tensor(node: InlineTensor, where: str, at: tuple) -> torch.Tensor:
    """An inline tensor of the tree (old metadata kept them), at key path ``at``."""
    dtype = INLINE_DTYPES.get(node.dtype)
    if dtype is None:
        raise FormatError(f"inline tensor of unknown dtype {node.dtype!r}", path=where)
    problem = fdl.shape_problem(node.shape)
    if problem:
        raise FormatError(f"inline tensor: {problem}", path=where)
    numel = math.prod(node.shape)
    if numel * dtype.itemsize != len(node.data):
        raise FormatError(f"inline tensor of shape {list(node.shape)} and dtype {node.dtype} "
                          f"needs {numel * dtype.itemsize} bytes, has {len(node.data)}",
                          path=where)
    if not node.data:
        return torch.empty(node.shape, dtype=dtype)
    return fdl.check_bools(torch.frombuffer(bytearray(node.data), dtype=dtype).reshape(node.shape),
                           path=meta_path(where), entry=show(at), offset=None)


_KINDS = ("module", "optimizer", "stateful")  # the ObjectNode kinds the walker writes


class _Rebuild:
    def __init__(self, entries: dict[str, torch.Tensor], where: str, keep_objects: bool) -> None:
        self.entries = entries
        self.where = where
        self.keep = keep_objects
        self.used: set[str] = set()

    def __call__(self, node: Any, at: tuple = ()) -> Any:
        t = type(node)
        if t is ObjectNode:
            self.check_object(node)
            if not self.keep:
                return self(node.value, at)
        if t is TensorRef:
            if node.name not in self.entries:
                raise FormatError(f"the metadata names entry {node.name!r}, which the "
                                  "checkpoint lacks", path=self.where)
            self.used.add(node.name)
            return self.entries[node.name]
        if t is InlineTensor:
            return _inline_tensor(node, self.where, at)
        if t is ObjectNode:
            return ObjectNode(node.kind, node.cls, self(node.value, at))
        if isinstance(node, dict):   # a plain dict, or a kind read_meta rebuilt
            return kinds.like(node, {k: self(v, at + (k,)) for k, v in node.items()})
        if t is list:
            return [self(v, at + (i,)) for i, v in enumerate(node)]
        if t is tuple:
            return tuple(self(v, at + (i,)) for i, v in enumerate(node))
        return node

    def check_object(self, node: ObjectNode) -> None:
        """A live object's node holds its state dict, as the walker wrote it:
        never a non-map where ``load_state_dict`` will want a map."""
        value = node.value
        if node.kind not in _KINDS or type(value) is not dict:
            raise FormatError(f"the metadata holds a {node.kind!r} node of class {node.cls!r} "
                              f"whose state is a {type(value).__name__}; expected one of "
                              f"{_KINDS} holding a map", path=self.where)
        if node.kind == "optimizer":
            groups = value.get("param_groups")
            if type(value.get("state")) is not dict or type(groups) is not list or not all(
                    type(g) is dict and type(g.get("params")) is list
                    and all(type(i) is int for i in g["params"]) for g in groups):
                raise FormatError(f"the metadata's {node.cls} optimizer state lacks a state map "
                                  "or param groups of parameter indices", path=self.where)


def _read(path: str, keep_objects: bool, mapped: bool = False,
          prepare: Callable[[Any, Any], Pairs] | None = None) -> tuple[Any, Any]:
    """(meta, rebuilt tree) of a state checkpoint; every entry must be in the tree.
    A model checkpoint reads as the state ``{"model": model, "optimizer": opt}``.
    ``mapped``: the checkpoint file's tensors are views of one checked mapping
    of it (:func:`~snapsvc.files.checkpoint.read_verified`'s ``shared_buffer``),
    to be copied out, not kept. ``prepare(meta, tree)``: the (entry, fresh
    tensor) pairs to fill while the file is checked (``read_verified``'s
    ``fill``); it sees the tree before the check."""
    meta = read_meta(path)
    if prepare is None:
        return meta, _tree(path, meta, read_with_data(path, meta, shared_buffer=mapped).entries,
                           keep_objects)
    trees: list[Any] = []

    def fill(entries: dict[str, torch.Tensor]) -> Pairs:
        trees.append(_tree(path, meta, entries, keep_objects))
        return prepare(meta, trees[-1])

    read_with_data(path, meta, shared_buffer=mapped, fill=fill)
    return meta, trees[-1]


def _tree(path: str, meta: Meta, entries: dict[str, torch.Tensor], keep_objects: bool) -> Any:
    """The saved state of ``meta`` with its tensors from ``entries``."""
    if meta.state is None:
        return _model_form(path, meta, entries, keep_objects)
    rebuild = _Rebuild(entries, path, keep_objects)
    tree = rebuild(meta.state)
    unused = [n for n in entries if n not in rebuild.used]
    if unused:
        raise FormatError(f"entries {unused[:3]} are not in the metadata's state tree: "
                          "the metadata does not belong to this checkpoint", path=path)
    return tree


def _model_form(path: str, meta: Meta, entries: dict[str, torch.Tensor],
                keep_objects: bool) -> dict[str, Any]:
    """A model checkpoint (``submit(model, optimizer=)``) as the nested state it
    holds: ``{"model": state dict}``, plus ``"optimizer"`` (torch's state dict form)
    when one was saved. The model's tensors are in file order (parameters, then
    buffers), its extra states after them."""
    model: dict[str, Any] = dict(entries)
    model.update(meta.extra_state or {})
    tree: dict[str, Any] = {"model": ObjectNode("module", "Module", model) if keep_objects
                            else model}
    if meta.optimizer:
        info = meta.optimizer
        found = read_companion(path, meta, "optimizer file")
        assert found is not None  # meta.optimizer makes it a companion
        sd = saved_optimizer(found.entries, info, found.path or path)
        tree["optimizer"] = ObjectNode("optimizer", info["class"], sd) if keep_objects else sd
    return tree


def saved_optimizer(tensors: dict[str, torch.Tensor], info: dict[str, Any],
                    where: str) -> dict[str, Any]:
    """The ``state_dict()`` of the optimizer ``info`` describes (the metadata's
    ``optimizer`` field), its tensors from ``tensors`` (the optimizer file's
    entries): parameters are numbered in group order, as torch numbers them."""
    index = {name: i for i, name in enumerate(n for g in info["groups"] for n in g["params"])}
    state: dict[int, dict[str, Any]] = {}
    for entry, t in tensors.items():
        name, _, key = entry.rpartition(OPTIM_SEP)
        if name not in index:
            raise FormatError(f"optimizer entry for unknown parameter {name!r}", path=where)
        state.setdefault(index[name], {})[key] = t
    for name, values in info["scalars"].items():
        if name not in index:
            raise FormatError(f"optimizer state for unknown parameter {name!r}", path=where)
        state.setdefault(index[name], {}).update(values)
    groups = [{**g["hyper"], "params": [index[n] for n in g["params"]]} for g in info["groups"]]
    return {"state": state, "param_groups": groups}


def rebuild(tree: Any, entries: dict[str, torch.Tensor], where: str) -> tuple[Any, set[str]]:
    """(``tree`` from the metadata with its tensors from ``entries`` and its objects
    kept, the entry names it used); FormatError if it names one ``entries`` lacks."""
    r = _Rebuild(entries, where, keep_objects=True)
    return r(tree), r.used


def load(path: str | os.PathLike[str]) -> dict[Any, Any]:
    """The nested state that ``submit(state, path)`` wrote, with tensors on the CPU.

    Modules, optimizers and stateful objects come back as their
    ``state_dict()`` at submit; key types, tuples, bytes, None and
    non-finite floats come back exactly. An ``nn.Parameter`` comes back as
    a plain ``torch.Tensor`` (``requires_grad=False``), deliberately: the file
    keeps data, not autograd; ``restore`` copies it into the live parameter,
    which stays a parameter. A model checkpoint (``submit(model, optimizer=)``,
    ``ModelSnapshot.save_file``) comes back as ``{"model": state dict}``, plus
    ``"optimizer"`` (torch's ``state_dict()`` form) when one was saved.
    """
    return cast(dict[Any, Any], _read(os.fspath(path), keep_objects=False)[1])  # a map: _read checks


# -- restoring into live objects ------------------------------------------------------
@dataclass(frozen=True)
class _ExtraState:
    """A restore target: the extra state of ``module`` (``set_extra_state``)."""

    module: nn.Module


class _Matcher:
    def __init__(self, where: str) -> None:
        self.where = where
        self.plan = Plan()

    def tensor(self, live: torch.Tensor, saved: Any, path: tuple) -> None:
        if not isinstance(saved, torch.Tensor):
            raise ArchitectureMismatchError(f"{self.where}: {show(path)} is a tensor here, "
                                            f"a {type(saved).__name__} in the checkpoint")
        if saved.shape != live.shape:
            raise ShapeMismatchError(f"{self.where}: {show(path)}: checkpoint shape "
                                     f"{list(saved.shape)} but live shape {list(live.shape)}")
        problem = copy_problem(live, saved)
        if problem:
            raise TargetNotWritableError(f"{self.where}: {show(path)} is {problem}")
        self.plan.copies.append((path_name(path), live, saved))
        self.plan.report.loaded.append(path_name(path))

    def same_class(self, live: Any, saved: Any, path: tuple) -> None:
        """An optimizer, scheduler or stateful object takes only the state its own
        class saved: another class's ``load_state_dict`` may take it silently
        (StepLR into CosineAnnealingLR) or fail half-way (SGD into Adam)."""
        if type(saved) is ObjectNode and saved.kind in ("optimizer", "stateful") \
                and saved.cls != type(live).__name__:
            raise ArchitectureMismatchError(
                f"{self.where}: {show(path)} was saved from a {saved.cls}, the live object "
                f"is a {type(live).__name__}; restore into the class that saved it")

    def match(self, live: Any, saved: Any, path: tuple) -> None:
        kind = saved.kind if type(saved) is ObjectNode else None
        value = saved.value if type(saved) is ObjectNode else saved
        if isinstance(live, torch.Tensor):
            self.tensor(live, value, path)
        elif isinstance(live, _ExtraState):
            self.plan.extras.append((path_name(path), live.module, value))
            self.plan.report.loaded.append(path_name(path))
        elif isinstance(live, nn.Module):
            self.module(live, value, path)
        elif isinstance(live, torch.optim.Optimizer):
            self.same_class(live, saved, path)
            self.optimizer(live, value, path, kind)
        elif callable(getattr(live, "state_dict", None)) \
                and callable(getattr(live, "load_state_dict", None)):
            self.same_class(live, saved, path)
            if not isinstance(value, dict):
                raise ArchitectureMismatchError(f"{self.where}: {show(path)} holds a "
                                                f"{type(value).__name__}, not a state dict")
            self.plan.loads.append((path_name(path), live, value))
            self.plan.report.restored.append(path_name(path))
        elif isinstance(live, Mapping):
            self.mapping(live, value, path)
        elif isinstance(live, (list, tuple)) and isinstance(value, (list, tuple)):
            if len(live) != len(value):
                raise ArchitectureMismatchError(f"{self.where}: {show(path)} has {len(live)} "
                                                f"items here, {len(value)} in the checkpoint")
            for i, (a, b) in enumerate(zip(live, value)):
                self.match(a, b, path + (i,))
        # plain values cannot change in place: they come back in report.state

    def mapping(self, live: Mapping, saved: Any, path: tuple) -> None:
        if not isinstance(saved, dict):
            raise ArchitectureMismatchError(f"{self.where}: {show(path)} is a mapping here, "
                                            f"a {type(saved).__name__} in the checkpoint")
        for k, v in live.items():
            if k in saved:
                self.match(v, saved[k], path + (k,))
            else:
                self.plan.report.missing.append(path_name(path + (k,)))
        self.plan.report.skipped += [path_name(path + (k,)) for k in saved if k not in live]

    def module(self, live: nn.Module, saved: Any, path: tuple) -> None:
        if not isinstance(saved, dict):
            raise ArchitectureMismatchError(f"{self.where}: {show(path)} is a module here, "
                                            f"a {type(saved).__name__} in the checkpoint")
        targets: dict[str, Any] = dict(live.named_parameters())
        targets.update(persistent_buffers(live))
        targets.update((key, _ExtraState(mod)) for key, mod in extra_states(live))
        self.mapping(targets, saved, path)  # its tensors and extra states by name
        self.plan.report.restored.append(path_name(path))

    def optimizer(self, live: torch.optim.Optimizer, saved: Any, path: tuple,
                  kind: str | None) -> None:
        """What torch's ``load_state_dict`` checks, checked first: as many
        parameters per group. State tensors may have any shape (Adafactor's
        factored rows, LBFGS's flat history), as torch allows."""
        groups = saved.get("param_groups") if isinstance(saved, dict) else None
        if kind not in (None, "optimizer") or not isinstance(groups, list) \
                or not isinstance(saved.get("state"), dict):
            raise ArchitectureMismatchError(f"{self.where}: {show(path)} is an optimizer here, "
                                            "but the checkpoint holds no optimizer state there")
        have = [len(g["params"]) for g in live.param_groups]
        try:
            want = [len(g["params"]) for g in groups]
        except (TypeError, KeyError):
            raise FormatError(f"{show(path)}: malformed param_groups", path=self.where) from None
        if have != want:
            raise ArchitectureMismatchError(
                f"{self.where}: {show(path)}: the optimizer's param groups hold {have} "
                f"parameters, the checkpoint's {want}; build the optimizer the same way")
        count = sum(have)
        for index, state in saved["state"].items():
            if type(index) is not int or not 0 <= index < count or not isinstance(state, dict):
                raise FormatError(f"{show(path)}: optimizer state for parameter {index!r}, "
                                  f"which the optimizer lacks", path=self.where)
        self.plan.loads.append((path_name(path), live, saved))
        self.plan.report.restored.append(path_name(path))


def restore_state(path: str | os.PathLike[str], target: Mapping, *,
                  strict: bool = False) -> LoadReport:
    """Restore a nested state into a mapping of live objects (see :func:`snapsvc.restore`).

    A tensor target is copied straight from the checked mapping of the file
    (a RAM-tier copy in /dev/shm, or a file in the page cache), with no
    buffer between. What an object's ``load_state_dict`` or
    ``set_extra_state`` takes (an optimizer keeps the tensors it is given:
    they must not pin the mapping) goes into fresh tensors, filled while
    the file is checked: nothing live changes before the whole file passed."""
    path = os.fspath(path)
    plans: list[Plan] = []

    def prepare(meta: Any, saved: Any) -> Pairs:
        plan = _plan_tree(path, saved, target, strict=strict)
        pairs: Pairs = []
        plan.loads = [(n, obj, _fresh(sd, pairs)) for n, obj, sd in plan.loads]
        plan.extras = [(n, mod, _fresh(state, pairs)) for n, mod, state in plan.extras]
        plans.append(plan)
        return pairs

    meta, saved = _read(path, keep_objects=True, mapped=True, prepare=prepare)
    return _finish(path, meta, saved, plans[-1])


def _fresh(value: Any, pairs: Pairs) -> Any:
    """``value`` with each tensor in it replaced by a fresh one of its own,
    noted in ``pairs`` to be filled with the saved one (containers keep their class)."""
    if isinstance(value, torch.Tensor):
        out = torch.empty(value.shape, dtype=value.dtype)
        pairs.append((value, out))
        return out
    if isinstance(value, dict):
        copied = copy.copy(value)  # Counter, OrderedDict, a defaultdict's factory
        for k, v in value.items():
            copied[k] = _fresh(v, pairs)
        return copied
    if isinstance(value, (list, tuple)):
        return type(value)(_fresh(v, pairs) for v in value)
    return value


def _plan_tree(path: str, saved: Any, target: Mapping, *, strict: bool) -> Plan:
    """Everything ``saved`` changes in ``target``, checked; nothing changes."""
    m = _Matcher(path)
    m.mapping(target, saved, ())
    report = m.plan.report
    if strict and (report.skipped or report.missing):
        raise StrictLoadError(
            f"{path}: strict restore: {len(report.skipped)} saved paths not in the target "
            f"{report.skipped[:5]}, {len(report.missing)} target paths not in the checkpoint "
            f"{report.missing[:5]}; pass strict=False to restore the overlap")
    return m.plan


def _finish(path: str, meta: Any, saved: Any, plan: Plan) -> LoadReport:
    apply(plan)
    report = plan.report
    report.epoch, report.metrics, report.extra = meta.epoch, dict(meta.metrics), meta.extra
    report.state = _Rebuild({}, path, keep_objects=False)(saved)  # objects -> their state
    return report


def restore_tree(path: str, meta: Any, saved: Any, target: Mapping, *,
                 strict: bool = False) -> LoadReport:
    """Restore ``saved`` (a tree rebuilt with its tensors, objects kept, each
    tensor its own) into ``target``: everything checked, then applied.
    ``path`` names it in errors."""
    return _finish(path, meta, saved, _plan_tree(path, saved, target, strict=strict))

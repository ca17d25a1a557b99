"""Nested training state: what ``submit(state, path)`` takes, and how it comes back.

A state is a ``Mapping`` (PyTorch DCP's convention) whose values may be
tensors, ``nn.Module``, ``torch.optim.Optimizer``, any object with
``state_dict()``/``load_state_dict()`` (schedulers, GradScaler, DCP
``Stateful``), dicts with str or int keys, lists, tuples, and int, float
(NaN and inf too), str, bytes, bool and None. Anything else is refused at
submit with :class:`~snapsvc.errors.UnsupportedStateError` naming its key
path; nothing is pickled, so loading a checkpoint never runs code.

On disk. Every tensor is an entry, named by its key path in the state
(:mod:`snapsvc.state.paths`): of the checkpoint file when ``.fdl`` has a tag
for its dtype, else of the data file beside it (:mod:`snapsvc.format.datafile`)::

    {"opt": adam, "ema": ema_model, "step": torch.tensor(3)}
      -> "opt/state/#0/exp_avg", "ema/fc.weight", "step"

One module keeps its own names (``fc.weight``), so flodl and
:func:`snapsvc.load_checkpoint` load the file as that model: the value under
the top-level key ``"model"`` if it is a module, else the only module among
the top-level values. Its parameters then persistent buffers come first in
the file and its structural hash goes in the header; every other entry
follows in the state's order. Tensors of other dtypes (bool, uint8, int8,
int16, complex, float8: RNG states are uint8) go through the slot like the
rest, into the data file; a multi-rank submit's pieces too (its manifest
records the data file's CRC-32). Metadata written before the data file
holds them as raw bytes (:data:`INLINE_DTYPES`; still read).

The tree itself (containers, key types, tuple versus list, non-tensor
leaves, which live object each part came from) goes in the metadata, packed
by :mod:`snapsvc.format.protocol`; ``docs/state.md`` describes it. Reading it
back, and restoring it into live objects, is :mod:`snapsvc.state.readback`.
The parts of one walk that the next may take as they are: :mod:`snapsvc.state.memo`.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeGuard, cast

import torch
from torch import nn

from ..errors import EncodeError, UnsupportedStateError
from ..files.checkpoint import LoadReport, layout_hash, persistent_buffers
from ..format import datafile, fdl, kinds
from ..format.layout import STATE, STATE_STEP
from ..format.protocol import ObjectNode, TensorRef

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor
from .memo import Part, WalkMemo, hold, leaves, same, walk
from .paths import MAX_DEPTH, model_key, path_name, show

__all__ = ["Flat", "StepState", "flatten", "check_plain", "dtensor_type", "is_dtensor",
           "extra_states", "model_extra_states", "plan_model_extra_states", "INLINE_DTYPES"]

_I64 = (-(1 << 63), (1 << 64) - 1)  # msgpack's integer range
_PLAIN = (str, bytes, bool, float, type(None))
_INT = {int}

# Tensors of these dtypes travelled in the metadata before the data file (and in a
# multi-rank submit's until issue 30): how such checkpoints are read. Both directions written out.
INLINE_DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "uint16": torch.uint16,
    "uint32": torch.uint32,
    "uint64": torch.uint64,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


def dtensor_type() -> Any:
    """``DTensor`` if its module is loaded, else None: no tensor can be one then, and a
    job without DTensors does not pay for importing it."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def is_dtensor(t: Any) -> TypeGuard[DTensor]:
    cls = dtensor_type()
    return cls is not None and isinstance(t, cls)
@dataclass
class Flat:
    """A state taken apart for staging: tensors by kind, and the tree."""

    params: list[tuple[str, torch.Tensor]] = field(default_factory=list)   # the model's
    buffers: list[tuple[str, torch.Tensor]] = field(default_factory=list)  # the model's
    rest: list[tuple[str, str, torch.Tensor]] = field(default_factory=list)  # (kind, name, t)
    tree: Any = None
    structural_hash: str = ""
    kinds: bool = False  # the tree holds a Counter, OrderedDict or defaultdict
    checked: bool = False  # its entries passed the encoders' checks (flatten's do)
    # (kind, shape, dtype) of each of params, buffers and rest as the walk saw them (a
    # memo's part: as its guard checked them just now), so a submit need not ask each
    # tensor again; None where unknown
    geometry: tuple[list, list, list] | None = None

    def tensors(self) -> list[torch.Tensor]:
        """Copy sources, in the layout's order."""
        return ([t for _, t in self.params] + [t for _, t in self.buffers]
                + [t for _, _, t in self.rest])


class StepState:
    """Marks a value of a state whose tensors only an optimizer step writes (an
    optimizer's per-parameter state, taken with ``state_dict()`` already), as an
    optimizer's own are: overlap mode copies them after ``submit()`` returns,
    before the next guarded step. Stored as ``value`` itself; nothing marks it."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


class _Walker:
    def __init__(self, model_key: str | None, tensors_ok: bool, root: str = "state",
                 sharded: bool = False, memo: WalkMemo | None = None) -> None:
        self.model_key = model_key
        self.tensors_ok = tensors_ok
        self.sharded = sharded
        self.root = root
        self.flat = Flat(geometry=([], [], []))
        self.names: dict[str, tuple] = {}
        self.open: set[int] = set()  # containers on the current path: a cycle revisits one
        self.memo = memo
        self.parts: dict[tuple, Part] = {}  # this walk's, for the next one
        self.anchors: list[Any] = []  # its modules, optimizers, stateful objects (see WalkMemo)

    def reuse(self, key: tuple, what: Any, held: list) -> Any:
        """The tree node of the memo's part ``key`` if ``what``/``held`` are the
        same as then, its tensors unchanged and its names still free; else None."""
        part = self.memo.parts.get(key) if self.memo is not None else None
        if part is None or part.what is not what and part.what != what \
                or not same(part.held, held):
            return None
        tensors = [held[i] for i in part.picks]   # now's: the part keeps none alive
        if not part.check(tensors) or not self.names.keys().isdisjoint(part.names):
            return None
        self.names.update(part.names)
        self.parts.update(part.inner)
        p, b = len(part.params), len(part.params) + len(part.buffers)
        self.flat.params += zip(part.params, tensors[:p])
        self.flat.buffers += zip(part.buffers, tensors[p:b])
        self.flat.rest += [(kind, name, t) for (kind, name), t in zip(part.rest, tensors[b:])]
        assert self.flat.geometry is not None   # a walk's Flat has it from the start
        for mine, its in zip(self.flat.geometry, part.geometry):
            mine += its
        if part.structural_hash is not None:
            self.flat.structural_hash = part.structural_hash
        self.parts[key] = part
        return part.node

    def marks(self) -> tuple[int, int, int, int]:
        """How many params, buffers, rest entries and parts this walk has so far."""
        return len(self.flat.params), len(self.flat.buffers), len(self.flat.rest), len(self.parts)

    def remember(self, key: tuple, what: Any, held: list, node: Any,
                 marks: tuple[int, int, int, int], structural_hash: str | None = None) -> None:
        """Keep what was walked since ``marks`` (see :meth:`marks`) as part ``key``."""
        flat = self.flat
        assert flat.geometry is not None and self.memo is not None   # remembered only with a memo
        params, buffers, rest = (flat.params[marks[0]:], flat.buffers[marks[1]:],
                                 flat.rest[marks[2]:])
        tensors = [t for _, t in params] + [t for _, t in buffers] + [t for _, _, t in rest]
        where = {id(t): i for i, t in enumerate(held) if isinstance(t, torch.Tensor)}
        picks = [where.get(id(t), -1) for t in tensors]
        if -1 in picks:  # a tensor from elsewhere: not worth a part
            return
        names = {n: self.names[n] for n in [*(n for n, _ in params), *(n for n, _ in buffers),
                                            *(n for _, n, _ in rest)]}
        inner = dict(list(self.parts.items())[marks[3]:])
        geometry = cast("tuple[list, list, list]",
                        tuple(g[m:] for g, m in zip(flat.geometry, marks)))
        # a module's tensors by identity alone: its entries' names are not its part's keys
        self.parts[key] = Part(what, hold(held, by_address=key[0] == "map"), self.memo.guard(tensors), picks, node,
                               [n for n, _ in params], [n for n, _ in buffers],
                               [(k, n) for k, n, _ in rest], names, structural_hash, inner,
                               geometry)

    def show(self, path: tuple) -> str:
        return show(path, self.root)

    def refuse(self, path: tuple, what: str) -> UnsupportedStateError:
        where = self.show(path)
        return UnsupportedStateError(
            f"{where}: {what}; snapsvc stores tensors, modules, optimizers, objects with "
            "state_dict()/load_state_dict(), dicts with str or int keys, lists, tuples, int, "
            "float, str, bytes, bool and None" if self.tensors_ok else
            f"{where}: {what}; plain values are dicts with str or int keys, lists, tuples, "
            "int, float, str, bytes, bool and None", path=where)

    def value(self, v: Any, path: tuple, step: bool = False) -> Any:
        t = type(v)
        if t in _PLAIN:
            if t is str:
                self.check_text(v, path)
            return v
        if t is int:
            if not _I64[0] <= v <= _I64[1]:
                raise EncodeError(f"{self.show(path)}: int {v} does not fit in 64 bits")
            return v
        if not self.tensors_ok and (isinstance(v, (torch.Tensor, nn.Module))
                                    or hasattr(v, "state_dict")):
            raise self.refuse(path, f"a {t.__name__}: tensors and objects go in a state mapping, "
                                "submit({'model': ..., ...}, path)")
        if isinstance(v, torch.Tensor):
            return self.tensor(v, path, STATE_STEP if step else STATE)
        if t is StepState:
            return self.value(v.value, path, True)
        if isinstance(v, nn.Module):
            return self.module(v, path)
        if isinstance(v, torch.optim.Optimizer):
            self.anchors.append(v)
            sd = v.state_dict()
            if isinstance(sd, Mapping) and "state" in sd:
                # only the per-parameter state changes in an optimizer step alone: a
                # scheduler's step writes a tensor lr of param_groups in place
                sd = {**sd, "state": StepState(sd["state"])}
            return ObjectNode("optimizer", t.__name__, self.stateful_dict(sd, path))
        if callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None)):
            self.anchors.append(v)
            return ObjectNode("stateful", t.__name__, self.stateful_dict(v.state_dict(), path))
        if isinstance(v, Mapping) or t in (list, tuple):
            return self.container(v, path, step)
        if isinstance(v, (list, tuple)):
            raise self.refuse(path, f"a {t.__name__} (a list or tuple subclass would come back "
                                "as a plain one)")
        raise self.refuse(path, f"a value of type {t.__name__} is not storable")

    def stateful_dict(self, sd: Any, path: tuple, step: bool = False) -> Any:
        if not isinstance(sd, Mapping):
            raise self.refuse(path, f"state_dict() returned a {type(sd).__name__}, not a mapping")
        return self.container(sd, path, step)

    def container(self, v: Any, path: tuple, step: bool = False) -> Any:
        if len(path) >= MAX_DEPTH:
            raise EncodeError(f"{self.show(path)}: nested deeper than {MAX_DEPTH} levels")
        if id(v) in self.open:
            raise self.refuse(path, "a cycle: this container contains itself")
        self.open.add(id(v))
        try:
            if isinstance(v, Mapping):
                try:   # Counter, OrderedDict and defaultdict come back as themselves
                    kind = kinds.kind_of(v)
                except ValueError as e:
                    raise self.refuse(path, str(e)) from None
                self.flat.kinds |= kind is not None
                shape = leaves(v, kind) if self.memo is not None else None
                # plain values alone (a loop's counters): checking them costs their walk
                if shape is not None and any(isinstance(x, torch.Tensor) for x in shape[1]):
                    key, (what, held) = ("map", path, step), shape
                    node = self.reuse(key, what, held)
                    if node is not None:
                        return node
                    marks = self.marks()
                    node = kinds.like(v, self.mapping(v, path, step))
                    self.remember(key, what, held, node, marks)
                    return node
                return kinds.like(v, self.mapping(v, path, step))
            if v and set(map(type, v)) == _INT and _I64[0] <= min(v) and max(v) <= _I64[1]:
                # ints alone (a param group's parameter ids: thousands with FSDP2): one
                # C-level pass instead of a call per item
                return tuple(v) if type(v) is tuple else list(v)
            items = [self.value(item, path + (i,), step) for i, item in enumerate(v)]
            return tuple(items) if type(v) is tuple else items
        finally:
            self.open.discard(id(v))

    def mapping(self, v: Mapping, path: tuple, step: bool) -> dict:
        out = {}
        for k, item in v.items():
            if type(k) is str:
                self.check_text(k, path + (k,))
            elif type(k) is not int:
                raise self.refuse(path + (k,), f"a key of type {type(k).__name__} "
                                           "(only str and int keys are stored)")
            elif not _I64[0] <= k <= _I64[1]:
                raise EncodeError(f"{self.show(path + (k,))}: int key {k} does not fit "
                                  "in 64 bits")
            out[k] = self.value(item, path + (k,), step)
        return out

    def check_text(self, s: str, path: tuple) -> None:
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            raise EncodeError(f"{self.show(path)}: {s!r} is not encodable as UTF-8 ({e.reason})"
                              ) from None

    def tensor(self, t: torch.Tensor, path: tuple, kind: str, name: str | None = None) -> Any:
        subclass = type(t) not in (torch.Tensor, nn.Parameter)
        if subclass and (not self.sharded or not is_dtensor(t)):
            raise self.refuse(path, f"a tensor subclass {type(t).__name__}" + (
                " (a sharded tensor: save the state on every rank with "
                "snapsvc.DistributedSnapshotWriter(...).submit(state, step), or pass "
                ".full_tensor())" if is_dtensor(t) else ""))
        if t.is_nested:
            raise self.refuse(path, "a nested tensor (store its parts: .unbind(), or "
                                "a padded copy: .to_padded_tensor(0))")
        if t.layout != torch.strided:
            raise self.refuse(path, f"a {t.layout} tensor (convert with .to_dense())")
        if t.is_quantized or t.device.type == "meta":
            raise self.refuse(path, "a quantized or meta tensor (no plain data to store)")
        framing = datafile.framing_of(t.dtype)
        if framing is None:
            raise self.refuse(path, f"a tensor of dtype {t.dtype}, which snapsvc cannot store")
        name = path_name(path) if name is None else name
        if name in self.names:
            raise self.refuse(path, f"its entry name {name!r} is taken by "
                                f"{self.show(self.names[name])} (the model keeps its own names)")
        self.names[name] = path
        fdl.check_encodable(name, t, framing)
        # the live tensor, not detached: a memo's part finds it again by identity, or
        # by address (staging copies under no_grad)
        i = 2 if kind in (STATE, STATE_STEP) else 0 if kind == "param" else 1
        # the list i picks takes the tuple of its own shape
        cast("list[tuple]", (self.flat.params, self.flat.buffers, self.flat.rest)[i]).append(
            (kind, name, t) if i == 2 else (name, t))
        assert self.flat.geometry is not None   # a walk's Flat has it from the start
        self.flat.geometry[i].append((kind, t.shape, t.dtype))
        return TensorRef(name)

    def module(self, m: nn.Module, path: tuple) -> ObjectNode:
        own = len(path) == 1 and path[0] == self.model_key   # keeps its own names
        if self.memo is None:
            return self.walk_module(m, path, own)
        self.anchors.append(m)
        key, (held, outline) = ("module", path, own), walk(m)
        # its names and persistence as well as its tensors; the module weakly
        what = (weakref.ref(m), outline)
        node = self.reuse(key, what, held)
        if node is not None:
            return node
        marks = self.marks()
        node = self.walk_module(m, path, own)
        # tensors only: an inline tensor or an extra state is a value of this moment
        if all(type(x) is TensorRef for x in node.value.values()):
            self.remember(key, what, held, node, marks, self.flat.structural_hash if own else None)
        return node

    def walk_module(self, m: nn.Module, path: tuple, own_names: bool) -> ObjectNode:
        tensors: dict[str, Any] = {}
        params, buffers = list(m.named_parameters()), list(persistent_buffers(m))
        for kind, pairs in (("param", params), ("buffer", buffers)):
            for pname, t in pairs:
                where = path + (pname,)
                if own_names:  # in the .fdl, or the data file for dtypes .fdl lacks
                    tensors[pname] = self.tensor(t, where, kind, name=pname)
                else:
                    tensors[pname] = self.tensor(t, where, STATE_STEP if kind == "param"
                                                 else STATE)
        for key, sub in extra_states(m):  # as state_dict() has them, after their tensors
            tensors[key] = self.value(sub.get_extra_state(), path + (key,))
        if own_names:  # the model's own hash, every tensor counted: load_checkpoint checks it
            self.flat.structural_hash = layout_hash(params, buffers)
        return ObjectNode("module", type(m).__name__, _in_state_dict_order(m, tensors))


def extra_states(m: nn.Module) -> list[tuple[str, nn.Module]]:
    """(state_dict key, submodule) of every submodule that keeps extra state
    (overrides ``get_extra_state``), as ``m.state_dict()`` names it."""
    return [(f"{prefix}.{_EXTRA}" if prefix else _EXTRA, mod) for prefix, mod in m.named_modules()
            if type(mod).get_extra_state is not nn.Module.get_extra_state]


_EXTRA = "_extra_state"  # torch's key (torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX)


def _in_state_dict_order(m: nn.Module, tensors: dict[str, Any]) -> dict[str, Any]:
    """``tensors`` (params, buffers, extra states) reordered as ``m.state_dict()``
    lists them, module by module, without calling its hooks."""
    out = {}
    for prefix, mod in m.named_modules():
        for name in (*mod._parameters, *mod._buffers, _EXTRA):
            full = f"{prefix}.{name}" if prefix else name
            if full in tensors:
                out[full] = tensors[full]
    return out if len(out) == len(tensors) else tensors


def flatten(state: Mapping, memo: WalkMemo | None = None, *, sharded: bool = False) -> Flat:
    """Validate ``state`` and take it apart: tensors to stage, the tree for the metadata.

    Non-tensor leaves are copied into the tree now, and ``state_dict()`` is
    called now, so what is written is the state of this moment once the
    tensors are staged. ``sharded`` (one rank of a multi-rank checkpoint)
    accepts DTensors, as entries of their own, and keeps tensors of dtypes
    the ``.fdl`` lacks in the tree (a rank has no data file); what each rank
    stages of each entry is :mod:`snapsvc.distributed.shards`'s business.
    ``memo``: the parts of the last walk that
    still hold are not walked again (see :class:`WalkMemo`); it keeps this
    walk's. Tensors are the state's own, live (not detached): copy them under
    ``no_grad``.
    """
    if not isinstance(state, Mapping):
        raise UnsupportedStateError(f"a state must be a Mapping, not {type(state).__name__}")
    w = _Walker(model_key(state), tensors_ok=True, sharded=sharded, memo=memo)
    w.flat.tree = w.container(state, ())
    w.flat.checked = True
    if memo is not None:
        memo.keep(w.parts, w.anchors)
    return w.flat


def model_extra_states(m: nn.Module) -> dict[str, Any] | None:
    """A model submit's extra states (``get_extra_state()`` by state_dict key),
    kept as plain data in the metadata; None when no submodule has any.
    Tensors there need a state mapping (``submit({"model": m}, path)``)."""
    found = extra_states(m)
    return {key: check_plain(mod.get_extra_state(), f"extra state {key!r}")
            for key, mod in found} if found else None


def plan_model_extra_states(m: nn.Module, saved: dict[str, Any] | None, report: LoadReport
                            ) -> list[tuple[str, nn.Module, Any]]:
    """(key, submodule, saved state) for each of ``m``'s extra states the
    metadata holds (a model submit's); the rest go in ``report``. Nothing changes."""
    saved = saved or {}
    live = dict(extra_states(m))
    plan = []
    for key, mod in live.items():
        if key in saved:
            plan.append((key, mod, saved[key]))
            report.loaded.append(key)
        else:
            report.missing.append(key)
    report.skipped += [key for key in saved if key not in live]
    return plan


def check_plain(value: Any, what: str) -> Any:
    """Validate ``value`` (the ``extra=`` of a model submit) as plain data."""
    return _Walker(None, tensors_ok=False, root=what).value(value, ())

"""Turning one ``submit()`` into a checked request, before any slot is taken.

A :class:`Request` says what one submit copies: its source tensors, the key
of its pool (names, shapes, dtypes), how to build the slot layout, and the
state tree that travels in the metadata. Everything that can be refused is
refused here (names, dtypes, values, the path, the metadata's size), by the
same checks the sidecar's encoder and the reader run, so a submit that
passes is one that can be written and read back.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from ..errors import EncodeError, PathError
from ..files.checkpoint import layout_rows_hash, persistent_buffers
from ..files.durable import check_final_name
from ..files.meta import meta_path, optim_path
from ..format import datafile, fdl, kinds, protocol
from ..format.layout import BUFFER, OPTIM, PARAM, Layout
from ..remote.store import remote_key
from ..state.resume import optimizer_state
from ..state.memo import WalkMemo, Walked
from ..state.tree import Flat, flatten, model_extra_states
from .pools import Plan, Pool, SlotPools, walk
from .snapshot import ModelSnapshot

__all__ = ["Request", "request", "find_pool", "check_epoch", "check_path", "pack_body"]

_META_ROOM = 64 << 10   # what the sidecar adds to a submit's metadata: sizes, CRCs, names


@dataclass
class Request:
    """What one submit copies. A model without an optimizer is only walked
    here; its sources come from its cached plan, or are listed under the lock."""

    sources: list[torch.Tensor] = field(default_factory=list)
    key: tuple = ()
    layout: Callable[[], Layout] | None = None
    pin: bool = False
    optim: dict[str, Any] | None = None
    tree: Any = None
    model: nn.Module | None = None
    walked: Walked | None = None
    extra_state: dict[str, Any] | None = None  # a model's get_extra_state() values
    plain: bool = False  # its tree's mappings are all dicts: no kinds table to split off


def _entries(params: Sequence[tuple[str, torch.Tensor]],
             buffers: Sequence[tuple[str, torch.Tensor]],
             optim: Sequence[tuple[str, torch.Tensor]] = (),
             state: Sequence[tuple[str, str, torch.Tensor]] = (),
             structural_hash: str | None = None, checked: bool = False,
             geometry: tuple[list, list, list] | None = None) -> Request:
    model_pairs = [*params, *buffers, *((n, t) for _, n, t in state)]
    if not checked:  # a state's walk ran the same check, naming key paths
        # Refused whatever pool a same-shaped snapshot made before; the optimizer
        # state is a file of its own. The sidecar's encoders run the same checks.
        datafile.check_entries(model_pairs)   # dtypes .fdl lacks go to the data file
        fdl.check_entries(list(optim))
    pairs = [*model_pairs, *optim]
    pin = torch.cuda.is_available() and any(t.is_cuda for _, t in pairs)
    names = tuple(n for n, _ in pairs)
    if geometry is not None and not optim:   # the walk's, of these entries
        geo = tuple(geometry[0] + geometry[1] + geometry[2])
    else:
        kinds = [*(PARAM for _ in params), *(BUFFER for _ in buffers),
                 *(k for k, _, _ in state), *(OPTIM for _ in optim)]
        geo = tuple((k, t.shape, t.dtype) for k, (_, t) in zip(kinds, pairs))
    # the hash too: a model's tensors .fdl cannot hold (a bool buffer) count in
    # its hash, so two models may share every entry and differ in the header
    n = len(params) + len(buffers)
    h = _hash_of(names[:n], geo[:n], len(params)) if structural_hash is None else structural_hash
    key = (pin, names, geo, h)
    return Request([t for _, t in pairs], key, lambda: Layout.placed(names, geo, h), pin)


@functools.lru_cache(maxsize=16)
def _hash_of(names: tuple[str, ...], geo: tuple[tuple[str, torch.Size, torch.dtype], ...],
             n_params: int) -> str:
    """``layout_hash`` of the first ``n_params`` entries as params and the rest as
    buffers, from their names and geometry: all it reads, so a submit of the
    same layout (every submit with an optimizer) hashes it once (issue 34)."""
    return layout_rows_hash((PARAM if i < n_params else BUFFER, name, dtype, tuple(shape))
                            for i, (name, (_, shape, dtype)) in enumerate(zip(names, geo)))


def request(obj: Any, optimizer: torch.optim.Optimizer | None, extra: Any,
            memo: WalkMemo | None = None) -> Request:
    """The request for a model, a :class:`ModelSnapshot` or a state mapping
    (walked through ``memo``: the modules and optimizer states of the last
    state submitted are not walked again while they hold)."""
    if isinstance(obj, ModelSnapshot):
        if optimizer is not None:
            raise TypeError("optimizer= needs the model itself, not a ModelSnapshot")
        return _entries(list(obj.params.items()), list(obj.buffers.items()))
    if isinstance(obj, nn.Module):
        if optimizer is None:
            req = Request(model=obj, walked=walk(obj))
        else:
            params, buffers = list(obj.named_parameters()), list(persistent_buffers(obj))
            optim, info = optimizer_state(optimizer, {id(p): n for n, p in params})
            req = _entries(params, buffers, optim)
            req.optim = info
        req.extra_state = model_extra_states(obj)
        return req
    if isinstance(obj, (Mapping, Flat)):   # a Flat: a state taken apart already (one rank's)
        if optimizer is not None or extra is not None:
            raise TypeError("with a state mapping, put optimizers and extra values "
                            "inside the mapping")
        flat = obj if isinstance(obj, Flat) else flatten(obj, memo)
        req = _entries(flat.params, flat.buffers, state=flat.rest,
                       structural_hash=flat.structural_hash,
                       checked=flat.checked,  # a walk checked them, naming key paths
                       geometry=flat.geometry)
        req.tree, req.plain = flat.tree, not flat.kinds
        return req
    raise TypeError(f"submit() takes an nn.Module, a state Mapping or a ModelSnapshot, "
                    f"not {type(obj).__name__}")


def find_pool(pools: SlotPools, req: Request) -> tuple[Pool, list[torch.Tensor], Plan | None]:
    """(pool, copy sources, the model's cached plan if they come from one)
    for ``req``; the writer's lock held. Pools released as idle on the way
    wait in :meth:`SlotPools.take_released`, even if this raises.

    A model's plan is looked up and made under that lock, so two threads
    submitting the same model share one plan and one pool.
    """
    if req.model is None:
        assert req.layout is not None  # request() sets it for every state that is not a model
        return pools.pool(req.key, req.layout, req.pin), req.sources, None
    assert req.walked is not None  # and this for every model
    plan = pools.plan(req.model, req.walked)
    if plan is not None:
        pools.use(plan.pool)
        return plan.pool, plan.sources, plan
    full = _entries(list(req.model.named_parameters()), list(persistent_buffers(req.model)))
    assert full.layout is not None  # _entries always sets it
    pool = pools.pool(full.key, full.layout, full.pin)
    plan = Plan.make(req.walked, full.sources, pool)
    pools.remember(req.model, plan)
    return pool, full.sources, plan


def check_epoch(epoch: int | None) -> int:
    epoch = int(epoch or 0)
    if not -(1 << 63) <= epoch < (1 << 63):
        raise EncodeError(f"epoch {epoch} does not fit in int64")
    return epoch


def check_path(directory: str | None, path: str | os.PathLike[str], *,
               optimizer: bool = False, remote: str | None = None) -> str:
    """The absolute checkpoint path, refused if it names a directory, is not
    UTF-8, derives a name too long for the file system (its ``.meta``, or
    with an ``optimizer`` file its ``.optim`` name, one byte longer) or one
    the ``remote`` tier cannot hold (it would fail every upload attempt)."""
    raw = os.fspath(path)
    name = os.path.basename(raw)
    if not raw or raw.endswith(os.sep) or name in ("", ".", ".."):
        raise PathError(f"checkpoint path {raw!r} names a directory; give a file name")
    if directory is not None and not os.path.isabs(raw):
        raw = os.path.join(directory, raw)
    full = os.path.abspath(raw)
    try:
        full.encode("utf-8")  # it travels in a msgpack str; refuse it before taking a slot
    except UnicodeEncodeError:
        raise PathError(f"checkpoint path {full!r} is not valid UTF-8") from None
    if os.path.isdir(full):
        raise PathError(f"checkpoint path {full!r} is a directory; give a file name")
    for derived in (meta_path(full), optim_path(full)) if optimizer else (meta_path(full),):
        check_final_name(derived)
    if remote is not None and directory is not None:
        try:
            remote_key(remote, directory, full)
        except ValueError as e:
            raise PathError(str(e)) from None
    return full


def pack_body(path: str, reserved: int, plain_state: bool = False, **values: Any) -> bytes:
    """The WRITE message's metadata values, packed once, before a slot is taken.

    Packed by the function the sidecar and the reader unpack with, and held
    to the reader's size limit (less room for what the sidecar adds: sizes,
    checksums and the buffer names), so a value accepted here is one that
    can be written and read back. ``reserved``: bytes the sidecar adds.
    ``plain_state``: the walk found no Counter, OrderedDict or defaultdict
    in ``state``, so it is not searched again.
    """
    roots = ("extra",) if plain_state else ("state", "extra")
    trees, records = kinds.split({r: values[r] for r in roots if r in values})
    values.update(trees, kinds=records)   # the sidecar joins them back (snapsvc.sidecar.writes)
    try:
        body = protocol.pack_value(values)
    except (TypeError, ValueError, OverflowError) as e:  # checked already: a bug if it happens
        raise EncodeError(f"{path}: the metadata cannot be packed ({e})") from None
    room = protocol.MAX_METADATA - _META_ROOM - reserved
    if len(body) > room:
        raise EncodeError(f"{path}: metrics, extra values and state tree take {len(body)} "
                          f"bytes of metadata; the limit is {room} (snapsvc.format.protocol."
                          "MAX_METADATA): keep large data in tensors")
    return body

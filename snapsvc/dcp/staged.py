"""What ``SnapsvcStorageWriter.stage()`` hands to DCP: placeholders for tensors copied into a slot.

``stage()`` copies the rank's pieces of the state into one of the rank's
shared-memory slots (as ``DistributedSnapshotWriter.submit`` of a state
mapping would), and returns the state with each tensor replaced by a
:class:`StagedTensor`: its ticket (which held slot) and DCP's write items,
computed from the live tensor. DCP's planner asks it for its write items (``__create_write_items__``,
the hook DTensor uses), so the plan is the one the tensors would have made.
A placeholder pickles as a few numbers: ``async_save`` in PROCESS mode sends
the checkpoint process slot tickets, never tensor bytes.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Mapping

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.planner_helpers import _create_write_items

from ..state.tree import is_dtensor

__all__ = ["StagedTensor", "Placeholders", "ticket_of"]


class StagedTensor:
    """A tensor of a staged state: held in slot ``ticket`` under DCP's ``items``."""

    __slots__ = ("ticket", "items")

    def __init__(self, ticket: int, items: list[WriteItem]) -> None:
        self.ticket = ticket
        self.items = items

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        """DCP's planner hook: the items the tensor made at stage(), under ``fqn``."""
        return [dataclasses.replace(it, index=dataclasses.replace(it.index, fqn=fqn))
                for it in self.items]

    def __getstate__(self) -> tuple[int, list[WriteItem]]:
        return self.ticket, self.items

    def __setstate__(self, state: tuple[int, list[WriteItem]]) -> None:
        self.ticket, self.items = state

    def __repr__(self) -> str:
        return f"StagedTensor(ticket={self.ticket}, items={len(self.items)})"


_IMMUTABLE = (int, float, str, bytes, bool, type(None))


class Placeholders:
    """Makes the staged state handed to DCP: ``state_dict`` with each tensor a
    :class:`StagedTensor`, the other values deep-copied (DCP plans them as bytes
    items; snapsvc keeps them in its state tree).

    Kept plan: a tensor's write items are DCP's for its key, class, shape,
    dtype, ``requires_grad`` and (a DTensor) mesh and placements; they are kept
    from the last call and made again when any of these changed.
    """

    def __init__(self) -> None:
        self._kept: dict[str, tuple[tuple, list[WriteItem]]] = {}

    def __call__(self, state_dict: Mapping[str, Any], ticket: int) -> dict[str, Any]:
        flat, mappings = flatten_state_dict(dict(state_dict))
        staged: dict[str, Any] = {}
        kept: dict[str, tuple[tuple, list[WriteItem]]] = {}
        for fqn, value in flat.items():
            if not isinstance(value, torch.Tensor):
                staged[fqn] = value if type(value) in _IMMUTABLE else copy.deepcopy(value)
                continue
            dtensor = is_dtensor(value)
            if not dtensor and type(value) not in (torch.Tensor, torch.nn.Parameter):
                raise TypeError(f"{fqn!r}: a {type(value).__name__}; SnapsvcStorageWriter "
                                "stages tensors and DTensors (convert a ShardedTensor to a "
                                "DTensor)")
            d: Any = value   # a DTensor when ``dtensor``
            key = (type(value), value.shape, value.dtype, value.requires_grad,
                   *((d.device_mesh, tuple(d.placements)) if dtensor else ()))
            last = self._kept.get(fqn)
            if last is not None and last[0] == key:
                items = last[1]
            elif dtensor and d.device_mesh.get_coordinate() is None:
                items = []   # not on this rank's mesh: no write
            else:
                items = _create_write_items(fqn, value)
            kept[fqn] = (key, items)
            staged[fqn] = StagedTensor(ticket, items)
        self._kept = kept
        return unflatten_state_dict(staged, mappings)


def ticket_of(state_dict: Any) -> int | None:
    """The ticket of a staged (flattened) state, or None if it holds no staged tensor."""
    if not isinstance(state_dict, Mapping):
        return None
    for v in state_dict.values():
        if isinstance(v, StagedTensor):
            return v.ticket
    return None

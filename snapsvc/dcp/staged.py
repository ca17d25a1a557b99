"""What ``SnapsvcStorageWriter.stage()`` hands to DCP: placeholders for tensors copied into a slot.

``stage()`` flattens the state as DCP's planner does, copies every tensor
(a DTensor's local shard) into one of the rank's shared-memory slots, and
returns the state with each tensor replaced by a :class:`StagedTensor`: its
ticket (which held slot) and DCP's write items, computed from the live
tensor. DCP's planner asks it for its write items (``__create_write_items__``,
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
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import _create_write_items

from ..state.tree import is_dtensor
from .layout import entry_key

__all__ = ["StagedTensor", "take_apart", "ticket_of"]


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


def take_apart(state_dict: Mapping[str, Any], ticket: int
               ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(the tensors to copy by entry key, the staged state to hand DCP).

    Non-tensor values are deep-copied into the staged state: DCP's planner
    stores them as bytes items at write time, and they must be those of now.
    """
    flat, mappings = flatten_state_dict(dict(state_dict))
    tensors: dict[str, torch.Tensor] = {}
    staged: dict[str, Any] = {}
    for fqn, value in flat.items():
        if not isinstance(value, torch.Tensor):
            staged[fqn] = copy.deepcopy(value)
            continue
        if not is_dtensor(value) and type(value) not in (torch.Tensor, torch.nn.Parameter):
            raise TypeError(f"{fqn!r}: a {type(value).__name__}; SnapsvcStorageWriter stages "
                            "tensors and DTensors (convert a ShardedTensor to a DTensor)")
        if is_dtensor(value) and value.device_mesh.get_coordinate() is None:
            staged[fqn] = StagedTensor(ticket, [])   # not on this rank's mesh: no write
            continue
        items = _create_write_items(fqn, value)
        local = value.to_local() if is_dtensor(value) else value
        for it in items:
            if it.type == WriteItemType.BYTE_IO or it.tensor_data is None:
                raise TypeError(f"{fqn!r}: a {type(value).__name__} that DCP writes as bytes; "
                                "SnapsvcStorageWriter stages tensors and DTensors")
            tensors[entry_key(it.index, True)] = local.detach()
        staged[fqn] = StagedTensor(ticket, items)
    return tensors, unflatten_state_dict(staged, mappings)


def ticket_of(state_dict: Any) -> int | None:
    """The ticket of a staged (flattened) state, or None if it holds no staged tensor."""
    if not isinstance(state_dict, Mapping):
        return None
    for v in state_dict.values():
        if isinstance(v, StagedTensor):
            return v.ticket
    return None

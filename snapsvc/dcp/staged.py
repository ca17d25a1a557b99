"""What ``SnapsvcStorageWriter.stage()`` hands to DCP: placeholders for tensors copied into a slot.

``stage()`` copies the rank's pieces of the state into one of the rank's
shared-memory slots (as ``DistributedSnapshotWriter.submit`` of a state
mapping would), and returns DCP's flattened state with each tensor replaced by
a :class:`StagedTensor`: its ticket (which held slot) and DCP's write items,
computed from the live tensor (and kept: :mod:`.kept`). DCP's planner asks it
for its write items (``__create_write_items__``, the hook DTensor uses), so the
plan is the one the tensors would have made.
A placeholder pickles as a few numbers: ``async_save`` in PROCESS mode sends
the checkpoint process slot tickets, never tensor bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from torch.distributed.checkpoint.planner import WriteItem


__all__ = ["StagedTensor", "ticket_of"]


class StagedTensor:
    """A tensor of a staged state: held in slot ``ticket`` under DCP's ``items``.

    One tensor of each staged state carries the ticket; a kept plan's others are
    shared by every stage and carry None (see :func:`ticket_of`)."""

    __slots__ = ("ticket", "items")

    def __init__(self, ticket: int | None, items: list[WriteItem]) -> None:
        self.ticket = ticket
        self.items = items

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        """DCP's planner hook: the items the tensor made at stage(), under ``fqn``."""
        return [dataclasses.replace(it, index=dataclasses.replace(it.index, fqn=fqn))
                for it in self.items]

    def __getstate__(self) -> tuple[int | None, list[WriteItem]]:
        return self.ticket, self.items

    def __setstate__(self, state: tuple[int | None, list[WriteItem]]) -> None:
        self.ticket, self.items = state

    def __repr__(self) -> str:
        return f"StagedTensor(ticket={self.ticket}, items={len(self.items)})"


def ticket_of(state_dict: Any) -> int | None:
    """The ticket of a staged (flattened) state, or None if it holds no staged tensor."""
    if not isinstance(state_dict, Mapping):
        return None
    for v in state_dict.values():
        if isinstance(v, StagedTensor) and v.ticket is not None:
            return v.ticket
    return None

"""A copy held in a slot, sent later: what snapsvc.dcp's stager needs.

DCP's ``AsyncStager.stage()`` copies the state before the save knows where
it goes (the checkpoint id comes with the save, and DCP's bytes items with
its plan). :func:`hold` takes a slot and copies a state mapping's tensors
into it (the same pools, kept walks and copier as ``submit``) and keeps it
reserved; :func:`send_held` books and sends the write once the path is
known; :func:`release_held` gives the slot back when
the save is abandoned.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from ..state.tree import check_plain
from .dispatch import Held
from .handles import WriteHandle
from .plan import pack_body, request

if TYPE_CHECKING:
    from .writer import SnapshotWriter

__all__ = ["Held", "hold", "send_held", "release_held"]


def hold(writer: SnapshotWriter, state: Any, timeout: float | None = None) -> Held:
    """Copy the tensors of ``state`` (a state mapping, or a :class:`~snapsvc.state.tree.Flat`)
    into a slot of ``writer`` and keep it reserved, unsent."""
    started = time.monotonic()
    writer._check_caller("stage")
    if writer.overlap or writer.policy != "block":
        raise ValueError("a held copy needs a writer with overlap=False and policy='block'")
    with writer._book.cond:
        writer._book.check_open()
    req = request(state, None, None, writer._pools.memo)
    with writer._using(req) as (pool, sources, plan):
        held = writer._dispatch.take(pool, sources, plan, started, timeout)
    assert held is not None   # policy "block" waits for a slot, or raises
    held.tree = req.tree
    return held


def send_held(writer: SnapshotWriter, held: Held, path: str | os.PathLike[str],
              extra: Any = None) -> WriteHandle:
    """Write the slot :func:`hold` filled to ``path`` (``extra``: plain data for its
    metadata); the slot is given back if this raises before sending."""
    try:
        writer._check_caller("submit")
        full = writer._resolve(path)
        body = pack_body(full, held.pool.buffer_bytes, False, epoch=0, metrics={},
                         extra=check_plain(extra, "extra"), optim=None, state=held.tree,
                         extra_state=None)
    except BaseException:
        release_held(writer, held)
        raise
    return writer._dispatch.queue(held, full, body)


def release_held(writer: SnapshotWriter, held: Held) -> None:
    """Give back the slot of a held copy that will not be written (a no-op once sent)."""
    writer._dispatch.release(held)

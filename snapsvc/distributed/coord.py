"""Small messages between ranks, over a dedicated gloo group.

msgpack values travel as uint8 tensors through ``all_gather`` and
``broadcast``; reasons are cut to fit a bounded message.
"""

from __future__ import annotations

import ctypes
from datetime import timedelta
from typing import Any
import torch
import torch.distributed as dist

from ..format.protocol import pack_value, unpack_value
from .manifest import _MAX_MANIFEST


_MAX_REASON = 400


_MSG_MAX = 16 << 10  # bytes of msgpack in the commit-decision broadcast (reasons are cut to fit)


def _to_tensor(obj: Any) -> torch.Tensor:
    """msgpack ``obj`` into a fixed-size uint8 tensor: a u32 length, then the bytes.

    The ``*_object`` collectives would do this with pickle, and need numpy.
    """
    data = pack_value(obj)
    if len(data) > _MSG_MAX - 4:
        raise ValueError(f"coordination message of {len(data)} bytes exceeds {_MSG_MAX - 4}")
    buf = torch.zeros(_MSG_MAX, dtype=torch.uint8)
    buf[: 4 + len(data)] = torch.frombuffer(bytearray(len(data).to_bytes(4, "little") + data),
                                            dtype=torch.uint8)
    return buf


def _from_tensor(buf: torch.Tensor) -> Any:
    n = int.from_bytes(bytes(buf[:4].tolist()), "little")
    return unpack_value(bytes(buf[4: 4 + n].tolist()))


def _all_gather_msg(obj: Any, world_size: int, group: Any) -> list[Any]:
    """Every rank's ``obj``; any size (a sharded rank sends its entry table): the
    lengths go first, then the messages padded to the longest."""
    data = pack_value(obj)
    if len(data) > _MAX_MANIFEST:
        raise ValueError(f"coordination message of {len(data)} bytes exceeds {_MAX_MANIFEST}")
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=group)
    longest = max(1, *(int(n) for n in sizes))
    buf = torch.zeros(longest, dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.empty(longest, dtype=torch.uint8) for _ in range(world_size)]
    dist.all_gather(out, buf, group=group)
    return [unpack_value(ctypes.string_at(t.data_ptr(), int(n))) for t, n in zip(out, sizes)]


def _broadcast_msg(obj: Any, src: int, group: Any) -> Any:
    buf = _to_tensor(obj)
    dist.broadcast(buf, src=src, group=group)
    return _from_tensor(buf)


def _reason(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= _MAX_REASON else text[:_MAX_REASON] + "..."


def _new_group(process_group: Any, timeout: float) -> Any:
    """A gloo group over the same ranks, in the same order, for coordination only."""
    td = timedelta(seconds=timeout)
    if process_group is None or process_group is dist.GroupMember.WORLD:
        return dist.new_group(backend="gloo", timeout=td)
    ranks = dist.get_process_group_ranks(process_group)
    kwargs: dict[str, Any] = dict(ranks=ranks, backend="gloo", timeout=td,
                                  use_local_synchronization=True)
    try:  # keep group ranks equal to process_group's (torch >= 2.10 has sort_ranks)
        return dist.new_group(**kwargs, sort_ranks=False)
    except TypeError:
        if ranks != sorted(ranks):
            raise ValueError("this torch cannot keep the rank order of an unsorted "
                             "process_group; pass one created with sorted ranks") from None
        return dist.new_group(**kwargs)


def _rank_and_world(process_group: Any) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank(process_group)
        if rank < 0:
            raise ValueError("this process is not a member of the given process_group")
        return rank, dist.get_world_size(process_group)
    if process_group is not None:
        raise RuntimeError("process_group given but torch.distributed is not initialized")
    return 0, 1

"""Copies out of a mapped file made while it is checksummed (issue 31, 34).

A restore that must give its targets fresh tensors (an optimizer's state:
``load_state_dict`` keeps what it is given) used to checksum the whole file,
then clone each of those tensors out of the mapping: two reads of the same
bytes from memory. :class:`PieceCopier` copies each piece of the file into
the fresh tensors just after :func:`~snapsvc.format.streams.crc32_of` has
checksummed it, while it is still in cache. Only fresh tensors, which nothing
else holds until the check has passed, are written this way, so a file that
fails its check changes nothing live.
"""

from __future__ import annotations

import bisect
import ctypes
from typing import Any

import torch

__all__ = ["Pairs", "PieceCopier"]

Pairs = list[tuple[torch.Tensor, torch.Tensor]]  # (view of the mapped file, fresh tensor)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class PieceCopier:
    """``after(offset, length)`` for :func:`crc32_of` over the mapping ``buf``:
    copies the bytes of each (source, destination) pair that fall in the piece.

    A pair whose source is not a contiguous view of ``buf`` (a tensor of the
    data file, an empty one) is left in :attr:`rest`, to copy once checked.
    Each destination must be a fresh contiguous tensor of its source's
    dtype and shape. Pieces may run on several threads at once: each writes
    its own bytes.
    """

    def __init__(self, buf: Any, size: int, pairs: Pairs) -> None:
        base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        self.rest: Pairs = []
        found: list[tuple[int, int, torch.Tensor]] = []  # (offset, end, destination bytes)
        for src, dst in pairs:
            at = src.data_ptr() - base
            if src.is_contiguous() and src.nbytes and 0 <= at and at + src.nbytes <= size \
                    and dst.is_contiguous() and dst.dtype == src.dtype \
                    and dst.shape == src.shape:
                found.append((at, at + src.nbytes, _bytes(dst)))
            else:
                self.rest.append((src, dst))
        found.sort(key=lambda s: s[0])
        self.spans = found
        self.starts = [s[0] for s in found]
        self.source = torch.frombuffer(buf, dtype=torch.uint8, count=size) if size else None

    def __call__(self, at: int, length: int) -> None:
        end = at + length
        i = max(bisect.bisect_right(self.starts, at) - 1, 0)
        spans, source = self.spans, self.source
        while i < len(spans) and spans[i][0] < end:
            start, stop, dst = spans[i]
            lo, hi = max(start, at), min(stop, end)
            if lo < hi:
                assert source is not None
                dst[lo - start:hi - start].copy_(source[lo:hi])
            i += 1

    def copy_rest(self) -> None:
        """The pairs not in the mapping, copied (call once the file is checked)."""
        for src, dst in self.rest:
            dst.copy_(src)

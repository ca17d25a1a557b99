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
import mmap
import sys
from typing import Any, Callable

import torch

__all__ = ["Pairs", "PieceCopier", "resident"]

Pairs = list[tuple[torch.Tensor, torch.Tensor]]  # (view of the mapped file, fresh tensor)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


_MADV_POPULATE_WRITE = 23  # Linux 5.14+; elsewhere not asked for


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    if sys.platform != "linux":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


_madvise = _libc_madvise()


def _libc_mincore() -> Callable[[int, int, Any], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):  # not Linux/glibc: restore reads the file
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    fn.restype = ctypes.c_int
    return fn


_mincore = _libc_mincore()


def resident(buf: mmap.mmap, size: int) -> bool:
    """Whether every page of the mapping ``buf`` is in the page cache now."""
    if _mincore is None:
        return False
    pages = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    if _mincore(address, size, pages) != 0:
        return False
    return bool(torch.frombuffer(pages, dtype=torch.uint8).bitwise_and(1).all())


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
        found: list[tuple[int, int, torch.Tensor, Any]] = []  # (offset, end, dst bytes, pair)
        for src, dst in pairs:
            at = src.data_ptr() - base
            if src.is_contiguous() and src.nbytes and 0 <= at and at + src.nbytes <= size \
                    and dst.is_contiguous() and dst.dtype == src.dtype \
                    and dst.shape == src.shape:
                found.append((at, at + src.nbytes, _bytes(dst), (src, dst)))
            else:
                self.rest.append((src, dst))
        found.sort(key=lambda s: s[0])
        # the walk below assumes disjoint spans: a span that overlaps the one before it
        # (metadata naming one entry twice) is copied after the check, like the rest
        self.spans: list[tuple[int, int, torch.Tensor]] = []
        for at, end, dst_bytes, pair in found:
            if self.spans and at < self.spans[-1][1]:
                self.rest.append(pair)
            else:
                self.spans.append((at, end, dst_bytes))
        self.starts = [s[0] for s in self.spans]
        self.source = torch.frombuffer(buf, dtype=torch.uint8, count=size) if size else None

    def _overlapping(self, at: int, end: int) -> list[tuple[int, int, int, torch.Tensor]]:
        """(lo, hi, span start, destination bytes) of each span's part in [at, end)."""
        out = []
        i = max(bisect.bisect_right(self.starts, at) - 1, 0)
        spans = self.spans
        while i < len(spans) and spans[i][0] < end:
            start, stop, dst = spans[i]
            lo, hi = max(start, at), min(stop, end)
            if lo < hi:
                out.append((lo, hi, start, dst))
            i += 1
        return out

    def populate(self, at: int, length: int) -> None:
        """Fault in, in one kernel call each, the fresh pages that the file's
        bytes [at, at + length) go to (``crc32_of``'s ``before``, on the part's
        thread): a page fault per 4 KiB costs more than the copy into it. Where
        the kernel cannot, they fault in as they are written."""
        if _madvise is None:
            return
        page = mmap.PAGESIZE
        for lo, hi, start, dst in self._overlapping(at, at + length):
            first = dst.data_ptr() + lo - start
            a, b = -(-first // page) * page, (first + hi - lo) // page * page
            if a < b:
                _madvise(a, b - a, _MADV_POPULATE_WRITE)  # an error: faulted in as written

    def __call__(self, at: int, length: int) -> None:
        source = self.source
        for lo, hi, start, dst in self._overlapping(at, at + length):
            assert source is not None
            dst[lo - start:hi - start].copy_(source[lo:hi])

    def copy_rest(self) -> None:
        """The pairs not in the mapping, copied (call once the file is checked)."""
        for src, dst in self.rest:
            dst.copy_(src)

"""Shared-memory slots: where the trainer copies a snapshot for the writer.

A slot is ONE flat uint8 tensor in shared memory (one file descriptor, not
one per tensor); every model tensor is a view into it at an offset fixed by
the :class:`~snapsvc.format.layout.Layout`. Tensors of one dtype and one copy phase (see
:data:`EARLY`) are packed back to back in a *group* that starts 64-byte
aligned, so one ``torch.cat`` can fill a run of them: for thousands of small
tensors that is several times faster than a copy per tensor. The file order
of the entries is independent of where they sit in the slot. A slot is an
arena: allocated once, with some room to spare, and reused by any layout
that fits (names never matter, only bytes), so memory stays at ``slots x
snapshot bytes``.

Each slot's memory is a file descriptor (torch's ``file_descriptor``
allocation, whatever the sharing strategy), unlinked from /dev/shm as soon as
it is mapped: nothing is left there even if both processes are SIGKILLed.
The sidecar maps that fd (:func:`slot_fd`, sent over a Unix socket).
"""

from __future__ import annotations

import os
from typing import Sequence, Union

import torch

from ..format.fdl import DTYPES
from ..format.layout import Layout

__all__ = ["allocate", "slot_fd", "claim_word", "views", "group_views", "Step", "copy_groups",
           "copy_into", "unpin"]


def _check_shm_room(nbytes: int) -> None:
    """Refuse a slot /dev/shm cannot hold: touching its pages later would SIGBUS."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:  # no /dev/shm (not Linux): torch picks its own backing
        return
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise MemoryError(f"a {nbytes / 2**20:.1f} MiB snapshot slot does not fit in /dev/shm "
                          f"({free / 2**20:.1f} MiB free); enlarge it (docker: --shm-size) "
                          "or use fewer slots")


def allocate(layout: Layout, *, pin: bool = False, room: int = 0) -> torch.Tensor:
    """A flat shared-memory slot for ``layout`` and ``room`` bytes more
    (page-locked for CUDA when ``pin``)."""
    nbytes = layout.nbytes + room
    _check_shm_room(nbytes)
    # Allocate straight in shared memory: share_memory_() would copy a private
    # buffer over, doubling peak memory for a large model. Fresh pages are zero.
    storage = torch.UntypedStorage._new_using_fd_cpu(nbytes)
    flat = torch.empty(0, dtype=torch.uint8).set_(storage)
    if pin:
        # Register the shared pages with CUDA so device-to-host copies are DMA.
        err = torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), flat.numel(), 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of a {flat.numel()}-byte slot failed ({err})")
    return flat


def slot_fd(flat: torch.Tensor) -> int:
    """The file descriptor of a slot's shared memory (the slot owns it: never close it)."""
    fd, _ = flat.untyped_storage()._share_fd_cpu_()
    return fd


def claim_word(flat: torch.Tensor) -> torch.Tensor:
    """The slot's claim word, an int64 view into its shared header."""
    return flat[:8].view(torch.int64)


def unpin(flat: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(flat.data_ptr())


def views(flat: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """The slot's tensors, in layout order, as views of ``flat`` (the trainer's;
    the sidecar reads them as spans of its mapping: ``Layout.spans``)."""
    return [flat[s.offset:s.offset + s.nbytes].view(DTYPES[s.dtype]).view(s.shape)
            for s in layout.specs]


def group_views(flat: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """Each group's memory in ``flat``, as one flat tensor of its dtype."""
    return [flat[g.offset:g.offset + g.nbytes].view(DTYPES[g.dtype]) for g in layout.groups]


# How a plan fills part of a group: (flat aliases of a run of sources, first
# and last element of the group's memory they fill) for one torch.cat, or the
# index of one source to copy as it is.
Step = Union[tuple[list[torch.Tensor], int, int], int]


@torch.no_grad()
def copy_groups(outs: Sequence[torch.Tensor], steps: Sequence[Sequence[Step]],
                dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """Copy ``src`` into the slot, group by group: ``steps[g]`` fill group
    ``g`` (its memory ``outs[g]``; single sources go to their views ``dst``)."""
    for out, group_steps in zip(outs, steps):
        for step in group_steps:
            if isinstance(step, int):
                dst[step].copy_(src[step])
            else:
                run, start, end = step
                torch.cat(run, out=out[start:end])


@torch.no_grad()  # grad mode is per thread: the overlap copier thread needs it too
def copy_into(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor],
              stream: "torch.cuda.Stream | None" = None) -> None:
    """Copy ``src`` into the slot views ``dst`` (one fused call where possible).

    Sources may be live parameters: without no_grad the copy would be
    recorded by autograd, making the slot part of a graph.
    """
    if not dst:
        return
    if stream is None:
        torch._foreach_copy_(list(dst), list(src))
        return
    with torch.cuda.stream(stream):
        torch._foreach_copy_(list(dst), list(src), non_blocking=True)

"""Bit-for-bit comparison of states (tensors, dicts, lists, values) for the restore tests."""

from __future__ import annotations

import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes: NaNs and signed zeros compare as stored."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bit_identical(a, b, where: str = "") -> None:
    """``a`` and ``b`` hold the same types, keys, order and bytes; ``where`` names the part."""
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b)), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_bit_identical(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bit_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, where

"""Wrapping a trainer library's own function, once, so a plugin can act where the library decides.

A ``CheckpointIO`` or a ``Trainer`` subclass sees only what its library hands
it; where stock behaviour is decided elsewhere (Lightning asks
``ModelCheckpoint.file_exists``, the stock HF ``Trainer`` checks a directory
before it reads it), the plugin wraps that function at import. Each wrapper
acts only on what is snapsvc's and calls the original otherwise.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["wrap"]


def wrap(owner: Any, name: str, wrapper: Callable[[Any], Any]) -> None:
    """Replace ``owner.name`` by ``wrapper(owner.name)``, unless it is wrapped already
    (this module imported again, or by another flavour of the same library)."""
    current = getattr(owner, name)
    if not getattr(current, "__snapsvc__", False):
        wrapped = wrapper(current)
        wrapped.__snapsvc__ = True
        setattr(owner, name, wrapped)

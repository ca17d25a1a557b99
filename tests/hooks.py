"""Fault hooks run inside the writer sidecar (importable, so they pickle under spawn).

The writer calls ``hook(stage, path)`` at "start" and at the durable-write
stages "open", "write", "fsync" and "rename"; bind extra arguments with
``functools.partial``.
"""

from __future__ import annotations

import time


def sleep(seconds: float, stage: str, path: str) -> None:
    """Hold each write for ``seconds`` before it starts."""
    if stage == "open" and not path.endswith(".meta"):
        time.sleep(seconds)

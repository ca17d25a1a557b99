"""Fault hooks run inside the writer sidecar (importable, so they pickle under spawn).

The writer calls ``hook(stage, path)`` with stage "before_write" or
"before_meta"; bind extra arguments with ``functools.partial``.
"""

from __future__ import annotations

import time


def sleep(seconds: float, stage: str, path: str) -> None:
    """Hold each write for ``seconds`` before it starts."""
    if stage == "before_write":
        time.sleep(seconds)

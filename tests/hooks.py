"""Fault hooks run inside the writer sidecar (importable, so they unpickle there: it never imports __main__).

The writer calls ``hook(stage, path)`` at "start" and at the durable-write
stages "open", "write", "fsync" and "rename" (see snapsvc.files.durable). Bind the
leading arguments with ``functools.partial``.

Hooks that inject a fault act only while a file named ``FAULT`` exists in the
directory being written, so a test can write a good checkpoint first and then
switch the fault on for the next write of the same path.
"""

from __future__ import annotations

import os
import resource
import sys
import time

FLAG = "FAULT"


def _is_meta(path: str) -> bool:
    return ".meta" in os.path.basename(path)


def _armed(path: str) -> bool:
    return os.path.exists(os.path.join(os.path.dirname(path), FLAG))


def sleep(seconds: float, stage: str, path: str) -> None:
    """Hold each checkpoint write for ``seconds`` before it starts."""
    if stage == "open" and not _is_meta(path):
        time.sleep(seconds)


def pause(at: str, marker: str, seconds: float, stage: str, path: str) -> None:
    """Sleep at stage ``at`` of checkpoint files whose name contains ``marker``."""
    if stage == at and marker in os.path.basename(path) and not _is_meta(path):
        time.sleep(seconds)


def fail_start(stage: str, path: str) -> None:
    if stage == "start":
        raise RuntimeError("injected failure while the writer starts")


def raise_errno(at: str, err: int, stage: str, path: str) -> None:
    """Raise OSError(err) at stage ``at`` while the directory is armed."""
    if stage == at and _armed(path):
        raise OSError(err, os.strerror(err), path)


def limit_fsize(limit: int, stage: str, path: str) -> None:
    """RLIMIT_FSIZE of ``limit`` bytes for files opened while armed (EFBIG past it)."""
    if stage == "open":
        soft = limit if _armed(path) else resource.RLIM_INFINITY
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def drop_root(stage: str, path: str) -> None:
    """Act as user nobody while armed, so directory permissions apply (EACCES)."""
    if stage == "open":
        os.seteuid(65534 if _armed(path) else 0)


def note_torch(record: str, stage: str, path: str) -> None:
    """At every stage ("start" is before READY), write to ``record`` the stage
    and whether the sidecar has imported torch: ``"start False"``."""
    with open(record, "w") as f:
        f.write(f"{stage} {'torch' in sys.modules}")


def hold(flag: str, marker: str, stage: str, path: str) -> None:
    """Hold the write of checkpoint files whose name contains ``marker``, once
    opened, until a file named ``flag`` exists in their directory (60 s at most)."""
    if stage == "open" and marker in os.path.basename(path) and not _is_meta(path):
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(os.path.dirname(path), flag)) \
                and time.monotonic() < deadline:
            time.sleep(0.01)


def fail_late(seconds: float, stage: str, path: str) -> None:
    """While armed: wait ``seconds`` at "open", then fail with ENOSPC (a write that
    fails after a trainer that did not wait for it has died)."""
    if stage == "open" and _armed(path) and not _is_meta(path):
        time.sleep(seconds)
        raise OSError(28, os.strerror(28), path)

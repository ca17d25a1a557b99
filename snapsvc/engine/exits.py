"""Leaving the interpreter with writes in flight: SIGTERM and ``atexit``.

SIGTERM's default kills the trainer at once; while a writer is open it is
turned into ``SystemExit`` so ``with`` blocks and the exit drain run. An
interpreter that exits without ``close()`` lets each sidecar drain, bounded
by the writer's ``drain_timeout``.
"""

from __future__ import annotations

import atexit
import logging
import signal
import threading
import weakref
from typing import Any

__all__ = ["live", "exit_on_sigterm", "restore_sigterm"]

log = logging.getLogger("snapsvc")

live: "weakref.WeakSet[Any]" = weakref.WeakSet()  # open writers (finish(timeout) each)


def _sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def exit_on_sigterm() -> None:
    """Make SIGTERM unwind like an exception, so pending writes drain (main thread only)."""
    if threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _sigterm)


def restore_sigterm() -> None:
    """Put SIGTERM's default back once no writer is left (main thread only)."""
    if not live and threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGTERM) is _sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@atexit.register
def _close_at_exit() -> None:
    """An interpreter that exits without close(): let each sidecar drain, bounded."""
    for w in list(live):
        try:
            w.finish(timeout=w.drain_timeout)
        except Exception:  # never block interpreter exit on a checkpoint
            log.exception("closing a snapsvc writer at exit failed")

"""Claim words: the one piece of slot state both processes write.

The "latest" policy lets the trainer re-stage a snapshot that is queued but
not yet started. Each slot's header holds an int64 claim word, read and
written only under a lock shared by both processes (:class:`ClaimLock`,
which the kernel releases if its holder dies)::

    trainer                                   sidecar
    -------                                   -------
    word := seq       (then sends WRITE seq)
                                              on WRITE seq: word == seq ?
                                                yes: word := STARTED, write it
                                                no:  superseded, skip it
    revoke a queued seq: word == seq ?
      yes: word := REVOKED (the slot is free again)
      no:  the sidecar started it; wait

No torch: the sidecar reads the word from its mapping (:data:`WORD`), the
trainer through an int64 view of the same bytes.
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading

__all__ = ["STARTED", "REVOKED", "WORD", "ClaimLock"]

STARTED = -1
REVOKED = -2
WORD = struct.Struct("=q")  # the slot's first int64, as the trainer's tensor view reads it


class ClaimLock:
    """The lock guarding claim words, between the trainer and its sidecar.

    A POSIX record lock (``fcntl.lockf``) on an anonymous ``memfd`` both
    processes hold: the kernel drops it when its holder dies, so a SIGKILL
    can never leave the other side waiting, and unlike a named semaphore it
    leaves nothing in /dev/shm. Record locks belong to a process, not a
    thread, so a thread lock orders the threads of one process first.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._threads = threading.Lock()

    @classmethod
    def create(cls) -> "ClaimLock":
        return cls(os.memfd_create("snapsvc-claims", os.MFD_CLOEXEC))

    def __enter__(self) -> None:
        self._threads.acquire()
        try:
            fcntl.lockf(self.fd, fcntl.LOCK_EX)
        except BaseException:
            self._threads.release()
            raise

    def __exit__(self, *exc: object) -> None:
        fcntl.lockf(self.fd, fcntl.LOCK_UN)
        self._threads.release()

    def close(self) -> None:
        os.close(self.fd)

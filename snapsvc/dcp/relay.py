"""The link from DCP's checkpoint process (``async_save`` PROCESS mode) to the trainer.

In PROCESS mode DCP pickles the storage writer and the staged state into a
process of its own. The staged tensors are in the trainer's slots, and the
rank's sidecar is the trainer's: so the pickled writer carries the address
of a :class:`Relay` that the trainer serves, and the checkpoint process's
``write_data`` asks it to write a ticket's slot (a unix socket, an auth key
drawn per relay). The trainer answers once the step is durable on every
rank, or with the error that failed it.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from multiprocessing.connection import Client, Listener
from typing import Any, Callable

from ..errors import DistributedCheckpointError

__all__ = ["Relay", "call"]

log = logging.getLogger("snapsvc")


class Relay:
    """Serves ``handler(*request)`` to the checkpoint process, one request at a time."""

    def __init__(self, handler: Callable[..., Any]) -> None:
        self._handler = handler
        self.authkey = os.urandom(32)
        self._dir = tempfile.mkdtemp(prefix="snapsvc-dcp-")
        self.address = os.path.join(self._dir, "relay")
        self._listener = Listener(self.address, family="AF_UNIX", authkey=self.authkey)
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="snapsvc-dcp-relay",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except Exception as e:   # a client that failed the handshake, or the close
                if self._closed:
                    return
                log.warning("snapsvc DCP relay: a refused connection (%s)", e)
                continue
            with conn:
                if self._closed:
                    return
                try:
                    request = conn.recv()
                    reply: tuple[str, Any] = ("ok", self._handler(*request))
                except BaseException as e:  # noqa: BLE001 - the checkpoint process raises it
                    reply = ("error", f"{type(e).__name__}: {e}")
                try:
                    conn.send(reply)
                except OSError as e:
                    log.warning("snapsvc DCP relay: the checkpoint process left (%s)", e)

    def close(self) -> None:
        """Stop serving (wakes the accept with a connection of its own)."""
        if self._closed:
            return
        self._closed = True
        try:
            Client(self.address, family="AF_UNIX", authkey=self.authkey).close()
        except OSError:
            pass
        self._thread.join(5)
        self._listener.close()
        try:
            os.rmdir(self._dir)
        except OSError:
            pass


def call(address: str, authkey: bytes, request: tuple, timeout: float) -> Any:
    """Send ``request`` to the relay at ``address``; its reply, or its error raised."""
    with Client(address, family="AF_UNIX", authkey=authkey) as conn:
        conn.send(request)
        if not conn.poll(timeout):
            raise DistributedCheckpointError(
                f"the trainer did not answer within {timeout:.0f} s; the step is not saved")
        kind, value = conn.recv()
    if kind == "error":
        raise DistributedCheckpointError(f"the trainer's save failed: {value}")
    return value

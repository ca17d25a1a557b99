"""Control messages between the trainer and the writer sidecar, as msgpack maps.

Every message is one ``send_bytes`` on a ``multiprocessing`` pipe, written
synchronously by the sending thread: unlike ``multiprocessing.Queue`` there is
no feeder thread whose buffer a SIGKILL could lose. The only pickled payload
is a slot's shared-memory tensor, sent once right after its ``SLOT`` message.

trainer -> writer::

    {op: SLOT,  slot, layout}            then one pickled tensor (the storage)
    {op: WRITE, seq, slot, path, metrics, epoch, sent_at}
    {op: STOP}

writer -> trainer::

    {op: READY, pid}
    {op: SLOT_OK, slot}
    {op: DONE,  seq, ok, bytes, entries, timings..., error, errno, path}
"""

from __future__ import annotations

from typing import Any

import msgpack

__all__ = ["SLOT", "WRITE", "STOP", "READY", "SLOT_OK", "DONE", "pack", "unpack"]

SLOT = "slot"
WRITE = "write"
STOP = "stop"
READY = "ready"
SLOT_OK = "slot_ok"
DONE = "done"


def pack(op: str, **fields: Any) -> bytes:
    return msgpack.packb({"op": op, **fields}, use_bin_type=True)


def unpack(data: bytes) -> dict[str, Any]:
    msg = msgpack.unpackb(data, raw=False, strict_map_key=True)
    if not isinstance(msg, dict) or "op" not in msg:
        raise ValueError(f"malformed control message: {msg!r:.80}")
    return msg

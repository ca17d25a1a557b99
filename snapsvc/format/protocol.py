"""One msgpack codec for everything snapsvc stores or sends that is not a tensor.

Control messages between the trainer and the writer sidecar, the metadata
file beside each checkpoint and the state tree of a nested submit all go
through :func:`pack_value` / :func:`unpack_value`. The trainer packs at
submit, before a slot is taken, with the same function the sidecar and the
reader use, so a value the trainer accepts is one they accept: int map keys
(optimizer state dicts have them), tuples, bytes and non-finite floats
included. Nothing is pickled.

Every message is one ``send_bytes`` of a ``multiprocessing`` connection (a
Unix socket to the writer, a pipe back), written whole by one sender
thread that signal handlers never interrupt, while the submitting thread
waits for it: unlike ``multiprocessing.Queue``, nothing a call has returned
from waits in a buffer a SIGKILL could lose. The only pickled payload is the writer's
options (its ``fault_hook``), its first message; a slot's shared memory
follows its ``SLOT`` message as a file descriptor (``SCM_RIGHTS``).

trainer -> writer::

    {op: SLOT,  slot, layout}            then the slot's fd, on one byte (SCM_RIGHTS)
    {op: WRITE, seq, slot, path, sent_at, body}   body: pack_value({epoch, metrics,
                                                  extra, optim, state}), packed at submit
    {op: FREE,  slots}                   unmap these slots (their pools were released)
    {op: UPLOAD, seq, path}              with remote=: upload this checkpoint, durable already
                                         (a rank's step left local-only by an earlier run)
    {op: STOP}

writer -> trainer::

    {op: READY, pid}
    {op: SLOT_OK, slot}
    {op: DONE,  seq, ok, bytes, entries, timings..., error, errno, path}
    {op: UPLOADED, seq, path, url, error, skipped}   with remote=: the remote copy committed
                                                  (url) or not (error); seq None for a
                                                  checkpoint found at start

Extension types (msgpack ``ExtType`` codes), for what plain msgpack cannot tell apart::

    1  tuple            packed list of its items
    2  TensorRef        UTF-8 name of the .fdl entry that holds the tensor
    3  ObjectNode       [kind, class name, state]: a module, optimizer or stateful object
    4  InlineTensor     [dtype, shape, raw bytes]: a tensor of a dtype .fdl has no tag for
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import msgpack

from ..errors import FormatError
from .bounded import decode

__all__ = ["SLOT", "WRITE", "FREE", "UPLOAD", "STOP", "READY", "SLOT_OK", "DONE", "UPLOADED",
           "MAX_METADATA", "MAX_NESTING", "TensorRef", "ObjectNode", "InlineTensor", "pack",
           "unpack", "pack_value", "unpack_value"]

SLOT = "slot"
WRITE = "write"
FREE = "free"
UPLOAD = "upload"
STOP = "stop"
READY = "ready"
SLOT_OK = "slot_ok"
DONE = "done"
UPLOADED = "uploaded"

# The largest metadata file the reader accepts, and so the most a submit may
# put there: one limit, shared by the client's check, the writer and the reader.
MAX_METADATA = 64 << 20

_TUPLE, _REF, _OBJECT, _INLINE = 1, 2, 3, 4
_NESTED = (_TUPLE, _OBJECT, _INLINE)  # extension payloads that are msgpack themselves

# How deep a value read back may nest, containers and extension values
# together. A state tree nests at most snapsvc.state.paths.MAX_DEPTH (64)
# containers below the metadata's map; each level costs at most 3 here (an
# object's extension, its list, its state dict; a tuple costs 2), and the
# deepest leaf 6 more (a module's node and dict, an inline tensor's extension,
# list and shape). A file past this is not one snapsvc wrote.
MAX_NESTING = 3 * 64 + 16


@dataclass(frozen=True)
class TensorRef:
    """A tensor of the state tree, stored as the ``.fdl`` entry ``name``."""

    name: str

    @functools.cached_property
    def ext(self) -> msgpack.ExtType:
        # kept: a walk memo hands the same refs to every save of a state
        return msgpack.ExtType(_REF, self.name.encode("utf-8"))


@dataclass(frozen=True)
class ObjectNode:
    """A live object of the state tree (``kind``: module, optimizer or stateful)
    stored as its state: ``value`` is the tree of its ``state_dict()``."""

    kind: str
    cls: str
    value: Any


@dataclass(frozen=True)
class InlineTensor:
    """A tensor whose dtype the ``.fdl`` format lacks (bool, uint8, ...), kept in
    the metadata as raw little-endian bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes


def _default(obj: Any) -> msgpack.ExtType:
    if type(obj) is tuple:
        return msgpack.ExtType(_TUPLE, pack_value(list(obj)))
    if type(obj) is TensorRef:
        return obj.ext
    if type(obj) is ObjectNode:
        return msgpack.ExtType(_OBJECT, pack_value([obj.kind, obj.cls, obj.value]))
    if type(obj) is InlineTensor:
        return msgpack.ExtType(_INLINE, pack_value([obj.dtype, list(obj.shape), obj.data]))
    raise TypeError(f"cannot serialize a {type(obj).__name__}")


def _ext(code: int, value: Any, offset: int) -> Any:
    """The value of extension ``code``: ``value`` is its raw payload for a
    TensorRef, else the msgpack value the payload held."""
    if code == _REF and type(value) is bytes:
        try:
            return TensorRef(value.decode("utf-8"))
        except UnicodeDecodeError:
            pass
    elif code == _TUPLE and type(value) is list:
        return tuple(value)
    elif code == _OBJECT and type(value) is list and len(value) == 3 \
            and type(value[0]) is str and type(value[1]) is str:
        return ObjectNode(*value)
    elif code == _INLINE and type(value) is list and len(value) == 3:
        dtype, shape, raw = value
        if type(dtype) is str and type(shape) is list and type(raw) is bytes \
                and all(type(d) is int and d >= 0 for d in shape):
            return InlineTensor(dtype, tuple(shape), raw)
    raise FormatError(f"malformed msgpack extension type {code}", offset=offset)


def pack_value(obj: Any) -> bytes:
    """Pack ``obj`` exactly: dict subclasses, sets and other types are refused
    (``TypeError``), as are ints outside int64/uint64 (``OverflowError``)."""
    return msgpack.packb(obj, use_bin_type=True, strict_types=True, default=_default)


def unpack_value(data: bytes) -> Any:
    """The inverse of :func:`pack_value`, for any bytes: a malformed, too deeply
    nested or over-long input raises :class:`~snapsvc.errors.FormatError` (a
    ``ValueError``) with its offset, in memory proportional to ``len(data)``
    and without recursion (see :mod:`snapsvc.format.bounded`)."""
    return decode(data, _ext, _NESTED, MAX_NESTING)


def pack(op: str, **fields: Any) -> bytes:
    return pack_value({"op": op, **fields})


def unpack(data: bytes) -> dict[str, Any]:
    msg = unpack_value(data)
    if not isinstance(msg, dict) or "op" not in msg:
        raise ValueError(f"malformed control message: {msg!r:.80}")
    return msg

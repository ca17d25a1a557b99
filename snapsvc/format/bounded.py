"""A msgpack reader for bytes nobody vouches for: no recursion, bounded nesting and memory.

Why not ``msgpack.unpackb``: an extension value's payload is msgpack itself
(a tuple, an object node), and unpacking it from ``ext_hook`` starts a new C
unpacker per level, each with a large context on the C stack, and each
holding its own copy of the payload. A 1.4 KB file nesting 250 tuples
overflows the C stack (a segfault, not an exception); an 8 MiB payload
nested 150 deep costs 1.2 GB. C msgpack also allocates a container's
declared length before reading its items, so nested headers that each
declare millions of items allocate millions of slots per level.

Here one loop with an explicit stack reads the whole buffer, extension
payloads in place (a ``memoryview``, no copy). Before a container or an
extension value is opened, two bounds are checked:

* nesting (containers and extension values together) stays within ``max_depth``;
* every item still owed by the open containers takes at least one byte, so
  their total never exceeds the bytes left; nothing is allocated ahead.

So the values built take memory in proportion to ``len(data)`` (a list item
costs a pointer per byte at worst), and any malformed input is a
:class:`~snapsvc.errors.FormatError` with the byte offset where it starts.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Collection
from typing import Any

from ..errors import FormatError

__all__ = ["decode"]

_U = {1: struct.Struct(">B"), 2: struct.Struct(">H"), 4: struct.Struct(">I"), 8: struct.Struct(">Q")}
_S = {1: struct.Struct(">b"), 2: struct.Struct(">h"), 4: struct.Struct(">i"), 8: struct.Struct(">q")}
_F32, _F64 = struct.Struct(">f"), struct.Struct(">d")

# frame kinds; a frame is [kind, container, items left, pending key, end, ext code, offset]
_ARRAY, _KEY, _VALUE, _EXT = 0, 1, 2, 3


def decode(data: bytes, ext: Callable[[int, Any, int], Any], nested_codes: Collection[int],
           max_depth: int) -> Any:
    """The one msgpack value that fills ``data``.

    Extension values of the codes in ``nested_codes`` hold one msgpack value,
    decoded here and handed to ``ext(code, value, offset)``; other codes get
    their raw payload as ``bytes``. ``ext`` raises FormatError for a bad one.
    Strings must be UTF-8; map keys must be hashable.
    """
    view = memoryview(data)
    n = len(data)
    pos = 0
    owed = 0  # items the open containers still expect, this one included
    stack: list[list[Any]] = []

    def need(width: int, what: str, at: int) -> None:
        if pos + width > n:
            raise FormatError(f"truncated: {what} needs {width} bytes, {n - pos} are left",
                              offset=at)

    def text(size: int, at: int) -> str:
        try:
            return str(view[pos:pos + size], "utf-8")
        except UnicodeDecodeError as e:
            raise FormatError(f"a string is not valid UTF-8 ({e.reason})", offset=at) from None

    while True:
        at = pos
        if stack and stack[-1][0] != _EXT:
            owed -= 1  # this item's first byte is the one at ``at``
        need(1, "a value", at)
        b = data[pos]
        pos += 1
        count = -1  # a container of ``count`` items (maps: pairs) starts here
        value: Any = None
        if b <= 0x7F:
            value = b
        elif b >= 0xE0:
            value = b - 0x100
        elif b <= 0x8F:
            count, is_map = b & 0x0F, True
        elif b <= 0x9F:
            count, is_map = b & 0x0F, False
        elif b <= 0xBF:
            size = b & 0x1F
            need(size, "a string", at)
            value = text(size, at)
            pos += size
        elif b == 0xC0:
            value = None
        elif b in (0xC2, 0xC3):
            value = b == 0xC3
        elif b in (0xC4, 0xC5, 0xC6, 0xD9, 0xDA, 0xDB):  # bin / str with a 1, 2 or 4 byte length
            width = 1 << (b - 0xC4 if b <= 0xC6 else b - 0xD9)
            need(width, "a length", at)
            size = _U[width].unpack_from(data, pos)[0]
            pos += width
            need(size, "a bin" if b <= 0xC6 else "a string", at)
            value = bytes(view[pos:pos + size]) if b <= 0xC6 else text(size, at)
            pos += size
        elif b in (0xCA, 0xCB):
            width = 4 if b == 0xCA else 8
            need(width, "a float", at)
            value = (_F32 if b == 0xCA else _F64).unpack_from(data, pos)[0]
            pos += width
        elif 0xCC <= b <= 0xD3:  # uint then int, 1 to 8 bytes
            width = 1 << ((b - 0xCC) & 3)
            need(width, "an integer", at)
            value = (_U if b <= 0xCF else _S)[width].unpack_from(data, pos)[0]
            pos += width
        elif b in (0xDC, 0xDD, 0xDE, 0xDF):
            width = 2 if b in (0xDC, 0xDE) else 4
            need(width, "a container length", at)
            count, is_map = _U[width].unpack_from(data, pos)[0], b >= 0xDE
            pos += width
        elif b in (0xC7, 0xC8, 0xC9, 0xD4, 0xD5, 0xD6, 0xD7, 0xD8):  # ext, then fixext 1..16
            if b >= 0xD4:
                size = 1 << (b - 0xD4)
            else:
                width = 1 << (b - 0xC7)
                need(width, "an extension length", at)
                size = _U[width].unpack_from(data, pos)[0]
                pos += width
            need(1 + size, "an extension value", at)
            code = _S[1].unpack_from(data, pos)[0]
            pos += 1
            if code in nested_codes:
                if len(stack) >= max_depth:
                    raise FormatError(f"nested deeper than {max_depth} levels", offset=at)
                stack.append([_EXT, None, 1, None, pos + size, code, at])
                continue
            value = ext(code, bytes(view[pos:pos + size]), at)
            pos += size
        else:
            raise FormatError(f"byte {b:#04x} starts no msgpack value", offset=at)

        if count >= 0:
            items = 2 * count if is_map else count
            if owed + items > n - pos:
                raise FormatError(f"a {'map' if is_map else 'list'} of {count} items cannot fit "
                                  f"in the {n - pos} bytes left", offset=at)
            if len(stack) >= max_depth:
                raise FormatError(f"nested deeper than {max_depth} levels", offset=at)
            if count:
                owed += items
                stack.append([_KEY, {}, count, None, 0, 0, at] if is_map
                             else [_ARRAY, [], count, None, 0, 0, at])
                continue
            value = {} if is_map else []

        # hand ``value`` to the innermost open frame, closing each frame it completes
        while True:
            if not stack:
                if pos != n:
                    raise FormatError(f"{n - pos} bytes follow the value", offset=pos)
                return value
            frame = stack[-1]
            kind = frame[0]
            if kind == _EXT:
                if pos != frame[4]:
                    raise FormatError(f"extension type {frame[5]}: its value does not fill "
                                      "its payload", offset=frame[6])
                stack.pop()
                value = ext(frame[5], value, frame[6])
                continue
            if kind == _ARRAY:
                frame[1].append(value)
            elif kind == _KEY:
                try:
                    hash(value)
                except TypeError:
                    raise FormatError(f"a map key is a {type(value).__name__}",
                                      offset=frame[6]) from None
                frame[3] = value
                frame[0] = _VALUE
                break
            else:
                frame[1][frame[3]] = value
                frame[0] = _KEY
            frame[2] -= 1
            if frame[2]:
                break
            stack.pop()
            value = frame[1]

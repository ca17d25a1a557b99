"""Reading pieces of sharded rank files back: the global tensors a manifest
describes, and a reader that fetches only the byte ranges a rank needs,
checking each against its recorded CRC-32.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any
import torch
from isal import isal_zlib

from ..format import datafile, fdl
from ..errors import FormatError
from .manifest import MANIFEST_NAME, Manifest
from .shards import SHARDS_KEY, _DTYPES, _block_of, _is_dtensor


def _crc_of(f: Any, n: int, crc: int = 0) -> int:
    """CRC-32 of the next ``n`` bytes of ``f``; FormatError if it ends first."""
    left = n
    while left:
        chunk = f.read(min(left, 16 << 20))
        if not chunk:
            raise FormatError(f"truncated: {n} bytes wanted, {n - left} read", path=f.name)
        crc = isal_zlib.crc32(chunk, crc)
        left -= len(chunk)
    return crc


def _entry_table(path: str, records: list[dict[str, Any]], data: str | None
                 ) -> list[dict[str, Any]]:
    """``records`` with where each entry lies and its CRC-32, read back from the
    files just written (offsets from the entry headers; the CRC covers the
    entry's header and data, so a reader checks both with one range). A piece
    of a dtype ``.fdl`` has no tag for is in the data file ``data`` (a name
    beside ``path``): its record says so with ``"file"``."""
    in_data = [_DTYPES[r["dtype"]] not in fdl.DTYPE_TO_TAG for r in records]
    out: list[dict[str, Any]] = [{}] * len(records)
    for name, framing, here in ((os.path.basename(path), fdl.FDL, False),
                                (data, datafile.DATA, True)):
        mine = [i for i, d in enumerate(in_data) if d == here]
        if name is None:
            if mine:
                raise FormatError("the metadata records no data file although pieces of "
                                  "its dtypes were staged", path=path)
            continue
        where = os.path.join(os.path.dirname(path), name)
        with open(where, "rb") as f:
            dec = fdl.Decoder(f, size=os.fstat(f.fileno()).st_size, seekable=True, path=where,
                              framing=framing)
            found = list(dec.entries(load=False))
            if [e.name for e in found] != [records[i]["name"] for i in mine]:
                raise FormatError("the file's entries are not the pieces staged for it",
                                  path=where)
            for e, i in zip(found, mine):
                f.seek(e.offset)
                end = e.data_offset + e.nbytes
                out[i] = {**records[i], "offset": e.offset, "data": e.data_offset, "end": end,
                          "crc32": _crc_of(f, end - e.offset), **({"file": name} if here else {})}
    return out


@dataclass
class _Piece:
    file: str
    offset: int
    data: int
    end: int
    crc32: int
    offsets: list[int]
    lengths: list[int]


@dataclass
class _Global:
    """One saved tensor, as the union of its pieces."""

    name: str
    kind: str
    shape: list[int]
    dtype: torch.dtype
    pieces: list[_Piece] = field(default_factory=list)


def _globals(m: Manifest) -> dict[str, _Global]:
    """Every saved tensor of a sharded checkpoint, by name, with the pieces that hold it."""
    out: dict[str, _Global] = {}
    where = os.path.join(m.path, MANIFEST_NAME)
    for rf in m.ranks:
        for r in rf.entries or ():
            try:
                name, shape = r["name"], [int(d) for d in r["shape"]]
                dtype = _DTYPES[r["dtype"]]
                file = r.get("file", rf.file)   # the data file's pieces name it
                if file not in (rf.file, (rf.data or {}).get("file")):
                    raise ValueError(f"file {file!r} is not one of the rank's")
                piece = _Piece(os.path.join(m.path, file), int(r["offset"]), int(r["data"]),
                               int(r["end"]), int(r["crc32"]), [int(o) for o in r["offsets"]],
                               [int(n) for n in r["lengths"]])
                g = out.setdefault(name, _Global(name, r["kind"], shape, dtype))
            except (KeyError, TypeError, ValueError) as e:
                raise FormatError(f"rank {rf.rank}'s entry table is malformed ({e!r})",
                                  path=where) from None
            ok = (g.shape == shape and g.dtype == dtype and len(piece.offsets) == len(shape)
                  == len(piece.lengths) and piece.offset <= piece.data <= piece.end
                  and piece.end - piece.data == math.prod(piece.lengths) * dtype.itemsize
                  and all(0 <= o and o + n <= d
                          for o, n, d in zip(piece.offsets, piece.lengths, shape)))
            if not ok:
                raise FormatError(f"rank {rf.rank}'s piece of {name!r} (offsets {piece.offsets}, "
                                  f"lengths {piece.lengths}) does not fit the tensor's shape "
                                  f"{g.shape} and dtype", path=where)
            g.pieces.append(piece)
    return out


class _PieceReader:
    """Reads pieces by byte range, checking each against the manifest's size and CRC-32.

    Local rank files here; :class:`~snapsvc.distributed.tier.RemotePieces` reads a remote
    step's by ranged GETs, all of a restore's at once (:meth:`prefetch`)."""

    def __init__(self, sizes: dict[str, int], verify: bool,
                 sources: dict[str, str] | None = None) -> None:
        self._sizes = sizes
        self._verify = verify
        self._sources = sources or {}  # a file's path -> where to read it (its RAM copy)
        self._files: dict[str, Any] = {}
        self.bytes_read = 0

    def __enter__(self) -> "_PieceReader":
        return self

    def __exit__(self, *exc: object) -> None:
        for f in self._files.values():
            f.close()

    def _open(self, path: str) -> Any:
        f = self._files.get(path)
        if f is None:
            f = open(self._sources.get(path, path), "rb")
            self._files[path] = f
            actual = os.fstat(f.fileno()).st_size
            if actual != self._sizes[path]:
                raise FormatError(f"{actual} bytes, the manifest says {self._sizes[path]}",
                                  path=path)
        return f

    def prefetch(self, wanted: list[tuple[_Global, list[int], list[int]]]) -> None:
        """The blocks :meth:`assemble` will be asked for next (a remote reader
        fetches their pieces in parallel; local files are read on demand)."""

    def _bytes(self, g: _Global, p: _Piece) -> bytes | bytearray | memoryview:
        """The piece's entry, header and data: ``p.end - p.offset`` bytes."""
        f = self._open(p.file)
        f.seek(p.offset)
        data = bytearray(p.end - p.offset)
        view, got = memoryview(data), 0
        while got < len(data):
            k = f.readinto(view[got:])
            if not k:
                raise FormatError("truncated inside the entry", path=p.file, offset=p.offset,
                                  entry=g.name)
            got += k
        return data

    def read(self, g: _Global, p: _Piece) -> torch.Tensor:
        shape = p.lengths
        if math.prod(shape) == 0:
            return torch.empty(shape, dtype=g.dtype)
        entry = self._bytes(g, p)
        if len(entry) != p.end - p.offset:
            raise FormatError(f"{len(entry)} bytes of the entry, {p.end - p.offset} wanted",
                              path=p.file, offset=p.offset, entry=g.name)
        self.bytes_read += len(entry)
        if self._verify:
            crc = isal_zlib.crc32(entry)
            if crc != p.crc32:
                raise FormatError(f"CRC-32 {crc:08x} of the entry, the manifest says "
                                  f"{p.crc32:08x}: the file changed after the checkpoint was "
                                  "committed", path=p.file, offset=p.offset, entry=g.name)
        buf = entry if isinstance(entry, bytearray) else bytearray(entry)  # torch wants it writable
        return fdl.check_bools(torch.frombuffer(buf, dtype=g.dtype, offset=p.data - p.offset,
                                                count=math.prod(shape)).view(shape),
                               path=p.file, entry=g.name, offset=p.data)

    @staticmethod
    def overlapping(g: _Global, offsets: list[int], lengths: list[int]
                    ) -> list[tuple[_Piece, list[int], list[int]]]:
        """The pieces of ``g`` that overlap the block, each with the overlap's bounds."""
        out = []
        for p in g.pieces:
            lo = [max(a, b) for a, b in zip(offsets, p.offsets)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(offsets, lengths, p.offsets, p.lengths)]
            if not any(h <= lo_ for lo_, h in zip(lo, hi)):
                out.append((p, lo, hi))
        return out

    def assemble(self, g: _Global, offsets: list[int], lengths: list[int]) -> torch.Tensor:
        """The block of ``g`` at ``offsets``/``lengths``, from the pieces overlapping it only."""
        overlapping = self.overlapping(g, offsets, lengths)
        if len(overlapping) == 1:
            p = overlapping[0][0]
            if list(p.offsets) == list(offsets) and list(p.lengths) == list(lengths) \
                    and (p.data - p.offset) % g.dtype.itemsize == 0:
                # the block is one whole piece (read at the sharding it was saved with):
                # the piece's own fresh buffer, not copied a second time. Only where its
                # data sits aligned for its dtype in that buffer (entry headers are not
                # padded): what the optimizer gets is aligned, as a copy would be
                return self.read(g, p)
        out = torch.empty(lengths, dtype=g.dtype)
        covered = 0
        for p, lo, hi in overlapping:
            src = self.read(g, p)[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, p.offsets))]
            out[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))] = src
            covered += math.prod(b - a for a, b in zip(lo, hi))
        if covered != math.prod(lengths):
            raise FormatError(f"the saved pieces cover {covered} of the {math.prod(lengths)} "
                              f"elements at offsets {offsets}, lengths {lengths}",
                              entry=g.name)
        return out


def _sizes(m: Manifest) -> dict[str, int]:
    """The recorded size of every rank file and data file, by path."""
    out = {os.path.join(m.path, r.file): r.size for r in m.ranks}
    out.update((os.path.join(m.path, r.data["file"]), r.data["size"]) for r in m.ranks if r.data)
    return out


def _region(t: torch.Tensor) -> tuple[list[int], list[int]] | None:
    """(offsets, lengths) of the block of the global tensor this rank holds of ``t``:
    all of a plain tensor; None for a DTensor whose mesh excludes this rank."""
    if not _is_dtensor(t):
        return [0] * t.dim(), list(t.shape)
    b = _block_of(t, "")
    return None if b is None else (b.offsets, b.lengths)


def _user_extra(extra: Any) -> Any:
    return extra["extra"] if isinstance(extra, dict) and SHARDS_KEY in extra else extra

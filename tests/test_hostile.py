"""Hostile and malformed ``.fdl`` files: each must fail with FormatError, fast.

Every malformed file here is built by hand with ``struct`` from the layout in
``shared/FORMAT.md``, never with snapsvc's encoder, so a bug in the encoder
cannot hide one in the decoder. A failure must:

* raise :class:`snapsvc.FormatError`, which is also a ``ValueError``;
* say where: the byte offset in the uncompressed stream, the entry when the
  decoder knows it (its name has been read), and the file when read from a path;
* come back quickly, without allocating what a lying header asks for.
"""

from __future__ import annotations

import gzip
import io
import math
import os
import re
import resource
import struct
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from isal import igzip, isal_zlib
from torch import nn

from snapsvc import (
    FormatError,
    checkpoint_keys,
    checkpoint_version,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
)
from snapsvc.files.checkpoint import read_verified

pytestmark = pytest.mark.timeout(60)

FAST_S = 2.0          # one failing read of a tiny or hostile file
MAX_RSS_GROWTH = 200 << 20

# --------------------------------------------------------------------------------------
# Hand-built bytes (FORMAT.md): every integer little-endian.
# --------------------------------------------------------------------------------------
TAG = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3,
       torch.float64: 4, torch.int32: 5, torch.int64: 6}
ITEMSIZE = {1: 2, 2: 2, 3: 4, 4: 8, 5: 4, 6: 8}
HEADER_LEN = 4 + 4 + 32 + 4


def header(count: int, *, version: int = 2, magic: bytes = b"FDLC",
           hash_: bytes = bytes(32)) -> bytes:
    return magic + struct.pack("<I", version) + hash_ + struct.pack("<I", count)


def entry(name: str | bytes, shape: tuple[int, ...] = (), tag: int = 3, *,
          nbytes: int | None = None, data: bytes | None = None,
          name_len: int | None = None, ndim: int | None = None) -> bytes:
    """One entry; every field can be made to lie. Data defaults to zeros."""
    raw = name.encode("utf-8") if isinstance(name, str) else name
    if nbytes is None:
        nbytes = math.prod(shape) * ITEMSIZE.get(tag, 1)
    if data is None:
        data = bytes(nbytes)
    return (struct.pack("<I", len(raw) if name_len is None else name_len) + raw
            + struct.pack("<I", len(shape) if ndim is None else ndim)
            + struct.pack(f"<{len(shape)}q", *shape)
            + struct.pack("<BQ", tag, nbytes) + data)


def tensor_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())


def tensor_entry(name: str, t: torch.Tensor) -> bytes:
    return entry(name, tuple(t.shape), TAG[t.dtype], data=tensor_bytes(t))


def gz(stream: bytes, level: int = 6) -> bytes:
    """One gzip member, written by the standard library (not snapsvc)."""
    return gzip.compress(stream, compresslevel=level, mtime=0)


# A valid small checkpoint: every dtype, a scalar, an empty tensor, a non-ASCII name.
SAMPLE_TENSORS = {
    "encoder/weight": torch.linspace(-1, 1, 6, dtype=torch.float32).reshape(2, 3),
    "encoder/bias": torch.tensor([0.5, -2.0, 65504.0], dtype=torch.float16),
    "step": torch.tensor(123456789012, dtype=torch.int64),
    "mask": torch.tensor([[1, -1], [2**31 - 1, -2**31]], dtype=torch.int32),
    "emb.é": torch.tensor([[3.0, -0.0]], dtype=torch.bfloat16),
    "scale": torch.tensor([math.pi, float("nan")], dtype=torch.float64),
    "empty": torch.empty(0, 3),
}


@dataclass(frozen=True)
class Span:
    name: str
    start: int      # offset of the name length
    name_end: int   # from here on the decoder knows the entry's name
    end: int


def build_sample(version: int = 2) -> tuple[bytes, list[Span]]:
    out = bytearray(header(len(SAMPLE_TENSORS), version=version))
    spans = []
    for name, t in SAMPLE_TENSORS.items():
        start = len(out)
        out += tensor_entry(name, t)
        spans.append(Span(name, start, start + 4 + len(name.encode()), len(out)))
    return bytes(out), spans


SAMPLE, SPANS = build_sample()
NAMES = [s.name for s in SPANS]


# Malformed files: a valid entry GOOD ("ok") first, then the bad parts at offset B.
GOOD = tensor_entry("ok", torch.tensor([1.5, -1.5]))
B = HEADER_LEN + len(GOOD)


def bad(*entries: bytes, count: int | None = None) -> bytes:
    count = 1 + len(entries) if count is None else count
    return header(count) + GOOD + b"".join(entries)


def entry_at(n: int) -> str | None:
    """The entry a decoder knows the name of when the stream ends after n bytes."""
    for s in SPANS:
        if s.name_end <= n < s.end:
            return s.name
    return None


# --------------------------------------------------------------------------------------
# Sources and the failure check
# --------------------------------------------------------------------------------------
def verified_reader(shared_buffer: bool):
    """``read_verified`` against a record that matches the file, so that only the
    decoder can refuse it: its bounds must hold on this path too. A BytesIO
    source is written to a temporary file first (read_verified reads paths)."""
    def read(src):
        if isinstance(src, io.BytesIO):
            with tempfile.TemporaryDirectory() as d:
                path = Path(d, "ckpt.fdl")  # gzip is recognised by its magic bytes
                path.write_bytes(src.getvalue())
                return read(path)
        data = Path(src).read_bytes()
        return read_verified(src, len(data), zlib.crc32(data), shared_buffer=shared_buffer)

    read.__name__ = "read_verified_shared" if shared_buffer else "read_verified"
    return read


VERIFIED_READERS = [verified_reader(False), verified_reader(True)]
READERS = [read_checkpoint, checkpoint_keys, *VERIFIED_READERS]
readers = pytest.mark.parametrize("read", READERS, ids=lambda f: f.__name__)


class Form:
    """How a stream reaches the reader: plain or gzip, from memory or from a path."""

    def __init__(self, name: str, tmp_path: Path) -> None:
        self.name = name
        self.gz = name.startswith("gz")
        self.path = (tmp_path / ("ckpt.fdl.gz" if self.gz else "ckpt.fdl")
                     if name.endswith("path") else None)

    def source(self, stream: bytes) -> Path | io.BytesIO:
        """The uncompressed ``stream``, gzip-wrapped if this form is gzip."""
        return self.raw(gz(stream) if self.gz else stream)

    def raw(self, blob: bytes) -> Path | io.BytesIO:
        """``blob`` exactly as given (already gzip for a gzip form)."""
        if self.path is None:
            return io.BytesIO(blob)
        self.path.write_bytes(blob)
        return self.path


@pytest.fixture(params=["plain-bytes", "plain-path", "gz-bytes", "gz-path"])
def form(request, tmp_path) -> Form:
    return Form(request.param, tmp_path)


@pytest.fixture(params=["bytes", "path"])
def gz_form(request, tmp_path) -> Form:
    return Form(f"gz-{request.param}", tmp_path)


ANY = object()


def expect_format_error(read, src, *, path: Path | None, match: str | None = None,
                        offset: int | None = None, entry=ANY) -> FormatError:
    """Call ``read(src)``; check it fails quickly with a well-located FormatError."""
    t0 = time.perf_counter()
    with pytest.raises(FormatError) as info:
        read(src)
    elapsed = time.perf_counter() - t0
    e = info.value
    msg = str(e)
    assert isinstance(e, ValueError)
    assert elapsed < FAST_S, f"took {elapsed:.2f} s: {msg}"
    if match is not None:
        assert re.search(match, msg), f"{msg!r} does not match {match!r}"
    assert e.offset is not None and f"offset {e.offset}" in msg, msg
    if offset is not None:
        assert e.offset == offset, msg
    if path is not None:
        assert e.path == os.fspath(path) and os.fspath(path) in msg, msg
    if entry is not ANY:
        assert e.entry == entry, msg
    if e.entry is not None:
        assert f"entry {e.entry!r}" in msg, msg
    return e


def maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


# --------------------------------------------------------------------------------------
# The valid sample, as a baseline for everything that cuts or corrupts it
# --------------------------------------------------------------------------------------
def test_hand_built_sample_matches_the_encoder():
    out = io.BytesIO()
    save_checkpoint(out, SAMPLE_TENSORS)
    assert out.getvalue() == SAMPLE


@pytest.mark.parametrize("version", [1, 2])
def test_hand_built_sample_loads(version, form):
    stream, _ = build_sample(version)
    assert checkpoint_version(form.source(stream)) == version
    ckpt = read_checkpoint(form.source(stream))
    assert ckpt.version == version and ckpt.structural_hash is None
    assert list(ckpt.entries) == NAMES
    for name, want in SAMPLE_TENSORS.items():
        got = ckpt.entries[name]
        assert got.dtype == want.dtype and got.shape == want.shape
        assert tensor_bytes(got) == tensor_bytes(want), name
    assert checkpoint_keys(form.source(stream)) == NAMES


# --------------------------------------------------------------------------------------
# Truncation at every byte
# --------------------------------------------------------------------------------------
@readers
def test_stream_cut_at_every_offset(read, form):
    """Every prefix of the stream, plain or gzip-compressed whole, is refused."""
    for n in range(len(SAMPLE)):
        e = expect_format_error(read, form.source(SAMPLE[:n]), path=form.path)
        assert e.offset <= n, (n, str(e))
        if form.gz:  # length unknown: the decoder reads until the data runs out
            assert e.entry == entry_at(n), (n, str(e))
            assert "truncated" in str(e), (n, str(e))
        else:        # length known: a header may be refused before the entry is reached
            assert e.entry in (None, entry_at(n)), (n, str(e))


@readers
def test_gzip_file_cut_at_every_offset(read, gz_form):
    """Every prefix of the compressed file is refused (gzip header, body, trailer)."""
    blob = gz(SAMPLE)
    for n in range(len(blob)):
        e = expect_format_error(read, gz_form.raw(blob[:n]), path=gz_form.path)
        assert e.offset <= len(SAMPLE), (n, str(e))
        assert e.entry is None or e.entry in NAMES, (n, str(e))


@readers
def test_gzip_cut_inside_a_large_entry_names_it(read, gz_form):
    """Inflate itself fails (not a short stream): the error still names the entry."""
    big = torch.randint(-2**31, 2**31 - 1, (1 << 20,), dtype=torch.int32,
                        generator=torch.Generator().manual_seed(1))
    stream = header(3) + GOOD + tensor_entry("big", big) + tensor_entry("after", torch.ones(1))
    blob = gz(stream, level=1)
    e = expect_format_error(read, gz_form.raw(blob[:len(blob) * 3 // 5]), path=gz_form.path,
                            match="gzip", entry="big")
    assert B <= e.offset < len(stream) - len(tensor_entry("after", torch.ones(1))), str(e)


@pytest.mark.parametrize("n", range(8))
def test_version_of_a_cut_header(n, form):
    expect_format_error(checkpoint_version, form.source(SAMPLE[:n]), path=form.path,
                        match="magic|version", offset=0 if n < 4 else 4)


# --------------------------------------------------------------------------------------
# The header
# --------------------------------------------------------------------------------------
ONE_ENTRY = tensor_entry("w", torch.ones(2))


@pytest.mark.parametrize("read", READERS + [checkpoint_version], ids=lambda f: f.__name__)
@pytest.mark.parametrize("stream, match, offset", [
    pytest.param(header(1, magic=b"FDLX") + ONE_ENTRY, "bad magic", 0, id="magic-FDLX"),
    pytest.param(header(1, magic=b"\0\0\0\0") + ONE_ENTRY, "bad magic", 0, id="magic-zeros"),
    pytest.param(b"PK\3\4" + bytes(40), "bad magic", 0, id="magic-zip"),
    pytest.param(header(1, version=0) + ONE_ENTRY, r"version 0\b.*\b1 to 2\b", 4, id="version-0"),
    pytest.param(header(1, version=3) + ONE_ENTRY, r"version 3\b.*\b1 to 2\b", 4, id="version-3"),
    pytest.param(header(1, version=2**32 - 1) + ONE_ENTRY, r"version 4294967295\b.*\b1 to 2\b",
                 4, id="version-max"),
])
def test_bad_header(read, stream, match, offset, form):
    expect_format_error(read, form.source(stream), path=form.path, match=match,
                        offset=offset, entry=None)


# --------------------------------------------------------------------------------------
# Malformed entries, after GOOD: the error names the bad entry, or none before its
# name is read.
# --------------------------------------------------------------------------------------
def at_shape(name: str) -> int:       # offset of the shape of a bad entry named `name`
    return B + 4 + len(name.encode()) + 4


MALFORMED = [
    # dtype tag
    *(pytest.param(bad(entry("w", (2,), tag, nbytes=8)), rf"unknown dtype tag {tag}\b",
                   at_shape("w") + 8, "w", id=f"tag-{tag}") for tag in (0, 7, 255)),
    # byte count != numel * element size
    *(pytest.param(bad(entry("w", (2, 3), 3, nbytes=n, data=bytes(min(n, 64)))),
                   rf"byte count {n}\b.*\b24\b", at_shape("w") + 16 + 1, "w", id=f"nbytes-{n}")
      for n in (0, 23, 25, 48, 2**64 - 1)),
    pytest.param(bad(entry("w", (), 6, nbytes=4, data=bytes(4))), r"byte count 4\b.*\b8\b",
                 at_shape("w") + 1, "w", id="nbytes-scalar"),
    # shape
    pytest.param(bad(entry("w", (2, -1), 3, nbytes=0)), "negative dimension", at_shape("w"), "w",
                 id="negative-dim"),
    pytest.param(bad(entry("w", (-2**63,), 3, nbytes=0)), "negative dimension", at_shape("w"),
                 "w", id="dim-min-i64"),
    *(pytest.param(bad(entry("w", shape, 3, nbytes=0)), "overflow", at_shape("w"), "w",
                   id=f"overflow-{ident}")
      for ident, shape in [("2**62x2**62", (2**62, 2**62)),
                           ("2**62x2**62x0", (2**62, 2**62, 0)),   # numel 0, still no tensor
                           ("0xi64maxxi64max", (0, 2**63 - 1, 2**63 - 1)),
                           ("2**32-cubed", (2**32,) * 3)]),
    pytest.param(bad(entry("w", (1,) * 65, 3)), r"ndim 65\b", at_shape("w") - 4, "w",
                 id="ndim-65"),
    pytest.param(bad(entry("w", (), 3, ndim=2**32 - 1)), r"ndim 4294967295\b", at_shape("w") - 4,
                 "w", id="ndim-max"),
    pytest.param(bad(entry("w", (), 3, ndim=3)), r"\bshape\b.*\b24\b", at_shape("w"), "w",
                 id="shape-beyond-eof"),
    # names
    *(pytest.param(bad(entry("w", (2,), 3, name_len=n)), rf"\bname\b.*\b{n}\b", B + 4, None,
                   id=f"name-len-{n}") for n in (100, 2**20)),
    pytest.param(bad(entry("w", (2,), 3, name_len=2**32 - 1)), r"name length 4294967295\b",
                 B, None, id="name-len-max"),
    *(pytest.param(bad(entry(raw, (2,), 3)), "UTF-8", B + 4, None, id=f"utf8-{ident}")
      for ident, raw in [("ff", b"\xff"), ("cut-2-byte", b"ab\xc3"), ("surrogate", b"\xed\xa0\x80"),
                         ("overlong", b"\xc0\xaf"), ("above-max", b"\xf4\x90\x80\x80")]),
    pytest.param(bad(GOOD), "duplicate entry name", B, "ok", id="duplicate"),
    pytest.param(bad(tensor_entry("w", torch.zeros(3)), tensor_entry("w", torch.ones(1))),
                 "duplicate entry name", B + len(tensor_entry("w", torch.zeros(3))), "w",
                 id="duplicate-later"),
    # data and count
    pytest.param(bad(entry("w", (4,), 3, data=bytes(8))), r"tensor data.*\b16\b",
                 at_shape("w") + 17, "w", id="data-short"),
    pytest.param(bad(tensor_entry("w", torch.zeros(10)), count=3), r"name length",
                 B + len(tensor_entry("w", torch.zeros(10))), None, id="count-too-big"),
    *(pytest.param(bad(count=1) + tail, "unexpected bytes after the last entry", B, None,
                   id=f"trailing-{ident}")
      for ident, tail in [("zero", b"\0"), ("entry", GOOD), ("garbage", b"garbage" * 9)]),
    pytest.param(header(0) + b"\0", "unexpected bytes after the last entry", HEADER_LEN, None,
                 id="trailing-after-empty"),
]


@readers
@pytest.mark.parametrize("stream, match, offset, entry_name", MALFORMED)
def test_malformed_entry(read, stream, match, offset, entry_name, form):
    expect_format_error(read, form.source(stream), path=form.path, match=match,
                        offset=offset, entry=entry_name)


# --------------------------------------------------------------------------------------
# Lying sizes: fail fast, allocate nothing like what the header claims
# --------------------------------------------------------------------------------------
HUGE = [
    pytest.param(bad(count=2**32 - 1), r"entry count 4294967295|name length", None,
                 id="count-2**32-1"),
    pytest.param(bad(entry("huge", (2**58,), 3, data=b"abc")),
                 rf"tensor data.*\b{2**60}\b", "huge", id="nbytes-2**60"),
    pytest.param(bad(entry("huge", (2**37,), 4, data=b"abc")),
                 rf"tensor data.*\b{2**40}\b", "huge", id="nbytes-2**40"),
    pytest.param(bad(entry("huge", (2**30, 2**30, 2**2), 1, data=bytes(1000))),
                 rf"tensor data.*\b{2**63}\b", "huge", id="nbytes-2**63"),
]


@readers
@pytest.mark.parametrize("stream, match, entry_name", HUGE)
@pytest.mark.timeout(10)
def test_huge_claim_fails_fast_without_allocating(read, stream, match, entry_name, form):
    before = maxrss_bytes()
    e = expect_format_error(read, form.source(stream), path=form.path, match=match,
                            entry=entry_name)
    assert maxrss_bytes() - before < MAX_RSS_GROWTH, str(e)
    if form.gz:   # size unknown: it can only find out by running out of data
        assert "truncated" in str(e)


# --------------------------------------------------------------------------------------
# gzip: extra members, corruption, truncation
# --------------------------------------------------------------------------------------
def flipped(blob: bytes, i: int, mask: int = 0xFF) -> bytes:
    out = bytearray(blob)
    out[i] ^= mask
    return bytes(out)


SAMPLE_GZ = gz(SAMPLE)
GZ_HEADER_LEN = 10  # gzip.compress writes no optional header fields


@readers
@pytest.mark.parametrize("blob, match, offset", [
    pytest.param(SAMPLE_GZ + gz(b"x" * 10), "unexpected bytes after the last entry", len(SAMPLE),
                 id="second-member"),
    pytest.param(SAMPLE_GZ + SAMPLE_GZ, "unexpected bytes after the last entry", len(SAMPLE),
                 id="two-checkpoints-concatenated"),
    pytest.param(SAMPLE_GZ + b"garbage after the member", None, None, id="garbage-after-member"),
    pytest.param(SAMPLE_GZ[:GZ_HEADER_LEN], None, None, id="header-only"),
    pytest.param(SAMPLE_GZ[:-8], None, None, id="no-trailer"),
    pytest.param(SAMPLE_GZ[:-1], None, None, id="trailer-cut"),
    pytest.param(b"\x1f\x8b\x08\x00" + SAMPLE, None, None, id="gzip-magic-then-plain"),
    pytest.param(b"\x1f\x8b\x09" + SAMPLE_GZ[3:], None, None, id="unknown-method"),
])
def test_bad_gzip(read, blob, match, offset, gz_form):
    expect_format_error(read, gz_form.raw(blob), path=gz_form.path, match=match, offset=offset)


@readers
@pytest.mark.parametrize("region", [
    pytest.param(range(GZ_HEADER_LEN, len(SAMPLE_GZ) - 8), id="deflate-body"),
    pytest.param(range(len(SAMPLE_GZ) - 8, len(SAMPLE_GZ) - 4), id="crc32"),
    pytest.param(range(len(SAMPLE_GZ) - 4, len(SAMPLE_GZ)), id="isize"),
])
def test_gzip_flipped_byte(read, region, gz_form):
    """A flipped byte after the gzip header is caught (by the decoder, inflate or the CRC)
    unless deflate's redundancy makes it a no-op: a few bits (code lengths of unused
    symbols, padding) do not change what inflates, and such a file is simply valid."""
    for i in region:
        for mask in (0x01, 0x80, 0xFF):
            blob = flipped(SAMPLE_GZ, i, mask)
            if inflates_to_sample(blob):
                assert read(gz_form.raw(blob)) is not None
                continue
            e = expect_format_error(read, gz_form.raw(blob), path=gz_form.path)
            assert e.offset <= len(SAMPLE), (i, mask, str(e))


def inflates_to_sample(blob: bytes) -> bool:
    """Whether the standard library inflates ``blob`` to exactly SAMPLE."""
    try:
        return gzip.decompress(blob) == SAMPLE
    except (OSError, EOFError, zlib.error):
        return False


@readers
def test_gzip_crc_catches_corrupt_tensor_data(read, gz_form):
    """Stored (uncompressed) deflate blocks: a flipped data byte still inflates fine,
    so only the CRC can tell; the reader must check it."""
    co = zlib.compressobj(0, zlib.DEFLATED, 31)
    stored = co.compress(SAMPLE) + co.flush()
    data_at = stored.index(SAMPLE[-40:])  # inside the last entries' data
    for i in range(data_at, data_at + 40, 7):
        expect_format_error(read, gz_form.raw(flipped(stored, i, 0x01)), path=gz_form.path,
                            match="CRC|corrupt")


# --------------------------------------------------------------------------------------
# A gzip bomb: a tiny valid checkpoint followed by 1 GiB of zeros, in ~1 MB of gzip
# --------------------------------------------------------------------------------------
BOMB_ZEROS = 1 << 30


@dataclass(frozen=True)
class Bomb:
    path: Path
    inflate_s: float  # how long inflating all of it takes here


@pytest.fixture(scope="module")
def gzip_bomb(tmp_path_factory) -> Bomb:
    """A valid single-member gzip file, built without compressing 1 GiB.

    After Z_FULL_FLUSH the deflate stream is byte-aligned and refers to no
    earlier data, so the blocks for 1 MiB of zeros can be repeated 1024 times.
    The fixture then inflates it once, to check it and to time a full inflate.
    """
    co = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = co.compress(SAMPLE) + co.flush(zlib.Z_FULL_FLUSH)
    zeros = bytes(1 << 20)
    block = co.compress(zeros) + co.flush(zlib.Z_FULL_FLUSH)
    crc = isal_zlib.crc32(SAMPLE)
    for _ in range(BOMB_ZEROS // len(zeros)):
        crc = isal_zlib.crc32(zeros, crc)
    path = tmp_path_factory.mktemp("bomb") / "bomb.fdl.gz"
    with open(path, "wb") as f:
        f.write(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff" + head)
        for _ in range(BOMB_ZEROS // len(zeros)):
            f.write(block)
        f.write(co.flush())
        f.write(struct.pack("<II", crc, (len(SAMPLE) + BOMB_ZEROS) & 0xFFFFFFFF))
    assert path.stat().st_size < 2 << 20

    t0 = time.perf_counter()
    with igzip.open(path, "rb") as f:
        assert f.read(len(SAMPLE)) == SAMPLE
        total = 0
        while chunk := f.read(16 << 20):
            assert chunk == bytes(len(chunk))
            total += len(chunk)
    assert total == BOMB_ZEROS
    return Bomb(path, time.perf_counter() - t0)


class CountingReader(io.RawIOBase):
    """A non-seekable file that counts the compressed bytes pulled from it."""

    def __init__(self, path: Path) -> None:
        self._f = open(path, "rb", buffering=0)
        self.consumed = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self._f.readinto(b)
        self.consumed += n
        return n

    def close(self) -> None:
        self._f.close()
        super().close()


@readers
@pytest.mark.parametrize("via", ["path", "fileobj"])
@pytest.mark.timeout(20)
def test_gzip_bomb_is_refused_without_inflating_it(read, via, gzip_bomb):
    if via == "fileobj" and read in VERIFIED_READERS:
        pytest.skip("read_verified reads paths only")
    before = maxrss_bytes()
    size = gzip_bomb.path.stat().st_size
    src = gzip_bomb.path if via == "path" else CountingReader(gzip_bomb.path)
    t0 = time.perf_counter()
    try:
        expect_format_error(read, src, path=gzip_bomb.path if via == "path" else None,
                            match="unexpected bytes after the last entry",
                            offset=len(SAMPLE), entry=None)
    finally:
        if via == "fileobj":
            src.close()
    elapsed = time.perf_counter() - t0
    assert maxrss_bytes() - before < MAX_RSS_GROWTH
    assert elapsed < gzip_bomb.inflate_s / 4, (elapsed, gzip_bomb.inflate_s)
    if via == "fileobj":  # one read-ahead buffer (isal: 512 KiB), never the whole file
        assert src.consumed < size, (src.consumed, size)


# --------------------------------------------------------------------------------------
# load_checkpoint: a bad file never leaves the model half-loaded
# --------------------------------------------------------------------------------------
def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))


def model_stream(model: nn.Module, *extra: bytes, count_extra: int | None = None) -> bytes:
    """The model's tensors, every value changed, valid and in file order, then ``extra``."""
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    body = b"".join(tensor_entry(name, t.detach() + 7) for name, t in tensors)
    n = len(tensors) + (len(extra) if count_extra is None else count_extra)
    return header(n) + body + b"".join(extra)


STREAM_DAMAGE = ["cut-last-entry", "trailing-bytes", "bad-tag-last", "duplicate-last",
                 "count-too-big"]


@pytest.mark.parametrize("damage, gzipped_file", [
    *((d, gzipped) for gzipped in (False, True) for d in STREAM_DAMAGE),
    ("gzip-crc", True),
    ("gzip-cut", True),
])
def test_load_checkpoint_leaves_model_unchanged(damage, gzipped_file, tmp_path):
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    good = model_stream(model)
    stream = {
        "cut-last-entry": good[:-3],
        "trailing-bytes": good + b"\0",
        "bad-tag-last": model_stream(model, entry("extra", (1,), 9, nbytes=4)),
        "duplicate-last": model_stream(model, tensor_entry("0.bias", torch.zeros(2))),
        "count-too-big": model_stream(model, count_extra=1),
    }.get(damage, good)
    blob = gz(stream) if gzipped_file else stream
    if damage == "gzip-crc":
        blob = flipped(blob, len(blob) - 6)
    elif damage == "gzip-cut":
        blob = blob[:-5]
    path = tmp_path / ("ckpt.fdl.gz" if gzipped_file else "ckpt.fdl")
    path.write_bytes(blob)

    expect_format_error(lambda p: load_checkpoint(p, model), path, path=path)
    after = model.state_dict()
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), f"{damage}: {k} changed"

    # Control: the undamaged file does load, so the check above could see a change.
    path.write_bytes(gz(good) if gzipped_file else good)
    report = load_checkpoint(path, model)
    assert sorted(report.loaded) == sorted(before)
    assert torch.equal(model[0].weight, before["0.weight"] + 7)

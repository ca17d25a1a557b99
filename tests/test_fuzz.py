"""Property tests (hypothesis) for the ``.fdl`` codec, through the public API.

* Round trip: random entry lists (unique unicode names, the empty name too;
  rank 0..4 with small sizes, 0 included; all six dtypes; arbitrary bit
  patterns, NaN payloads included; contiguous or not) come back bit for bit
  from ``save_checkpoint`` / ``read_checkpoint``, through memory, a plain path
  and a ``.fdl.gz`` path, and ``checkpoint_keys`` lists the names in order.
* Mutation: a valid file with bytes flipped, inserted, deleted, overwritten
  with hostile integers or cut off either decodes or raises ``FormatError``,
  nothing else; and ``read_checkpoint``, ``checkpoint_keys`` and
  ``read_verified`` (from a path, whose record matches the file) agree.

The default example counts keep this file well under 30 s on a 2-core
machine. For a long fuzz, set every test's example count (the per-test
timeout grows with it)::

    SNAPSVC_FUZZ_EXAMPLES=20000 python -m pytest tests/test_fuzz.py
"""

from __future__ import annotations

import gzip
import io
import math
import os
import struct
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from snapsvc import (
    FormatError,
    checkpoint_keys,
    checkpoint_version,
    read_checkpoint,
    save_checkpoint,
)
from snapsvc.files.checkpoint import read_verified

LONG_FUZZ = int(os.environ.get("SNAPSVC_FUZZ_EXAMPLES") or 0)

pytestmark = pytest.mark.timeout(120 + LONG_FUZZ // 5)


def fuzz_settings(default_examples: int):
    return settings(max_examples=LONG_FUZZ or default_examples, deadline=None)


# --------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64]
SAME_SIZE_INT = {torch.float16: torch.int16, torch.bfloat16: torch.int16,
                 torch.float32: torch.int32, torch.float64: torch.int64,
                 torch.int32: torch.int32, torch.int64: torch.int64}


@st.composite
def tensors(draw, max_rank: int = 4, max_dim: int = 4) -> torch.Tensor:
    """Any bit pattern of any dtype; for rank >= 2 possibly a non-contiguous view."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, max_dim), max_size=max_rank)))
    nbytes = math.prod(shape) * dtype.itemsize
    raw = draw(st.binary(min_size=nbytes, max_size=nbytes))
    flat = torch.tensor(list(raw), dtype=torch.uint8).view(dtype)
    if len(shape) >= 2 and draw(st.booleans()):  # same shape, strides reversed
        return flat.reshape(shape[::-1]).permute(*reversed(range(len(shape))))
    return flat.reshape(shape)


def entry_lists(max_entries: int = 6, **tensor_kw) -> st.SearchStrategy:
    return st.lists(st.tuples(st.text(max_size=12), tensors(**tensor_kw)),
                    max_size=max_entries, unique_by=lambda pair: pair[0])


hashes = st.one_of(st.none(), st.just(bytes(32)), st.binary(min_size=32, max_size=32))


def assert_bitwise_equal(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    assert got.dtype == want.dtype, name
    assert got.shape == want.shape, name
    # As same-size integers, so NaN payloads and -0.0 compare bit for bit.
    as_int = SAME_SIZE_INT[got.dtype]
    assert torch.equal(got.view(as_int), want.view(as_int)), name


def encode(entries, hash_=None) -> bytes:
    out = io.BytesIO()
    save_checkpoint(out, entries, structural_hash=hash_)
    return out.getvalue()


# --------------------------------------------------------------------------------------
# Round trip
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


@pytest.mark.parametrize("dest", ["memory", "ckpt.fdl", "ckpt.fdl.gz"])
@fuzz_settings(150)
@given(entries=entry_lists(), hash_=hashes)
def test_round_trip(dest, entries, hash_, workdir):
    if dest == "memory":
        stream = encode(entries, hash_)

        def source():
            return io.BytesIO(stream)
    else:
        path = workdir / dest
        save_checkpoint(path, entries, structural_hash=hash_)
        if dest.endswith(".gz"):
            assert path.read_bytes()[:2] == b"\x1f\x8b"

        def source():
            return path

    names = [name for name, _ in entries]
    ckpt = read_checkpoint(source())
    assert ckpt.version == checkpoint_version(source()) == 2
    assert ckpt.structural_hash == (hash_.hex() if hash_ and any(hash_) else None)
    assert list(ckpt.entries) == names
    for name, want in entries:
        assert_bitwise_equal(ckpt.entries[name], want, name)
    assert checkpoint_keys(source()) == names


# --------------------------------------------------------------------------------------
# Mutation
# --------------------------------------------------------------------------------------
HOSTILE_INTS = [0, 1, 0x7F, 0x80, 0xFF, 0xFFFF, 2**31 - 1, 2**31, 2**32 - 1,
                2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1]

positions = st.integers(min_value=0, max_value=1 << 16)
hostile_ints = st.sampled_from(HOSTILE_INTS)
mutation = st.one_of(
    st.tuples(st.just("flip"), positions, st.integers(1, 255)),
    st.tuples(st.just("insert"), positions, st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("delete"), positions, st.integers(1, 16)),
    st.tuples(st.just("truncate"), positions),
    st.tuples(st.just("poke"), positions, hostile_ints, st.sampled_from(["<I", "<Q"])),
    # Structure-aware: a hostile value in one of the stream's integer fields.
    st.tuples(st.just("field"), positions, hostile_ints),
)


def integer_fields(entries) -> list[tuple[int, str]]:
    """(offset, struct format) of every integer field of the stream (FORMAT.md)."""
    fields = [(4, "<I"), (40, "<I")]                  # version, count
    at = 44
    for name, t in entries:
        fields.append((at, "<I"))                      # name length
        at += 4 + len(name.encode("utf-8"))
        fields.append((at, "<I"))                      # ndim
        at += 4
        fields += [(at + 8 * i, "<q") for i in range(t.dim())]
        at += 8 * t.dim()
        fields += [(at, "<B"), (at + 1, "<Q")]         # dtype tag, byte count
        at += 9 + t.numel() * t.element_size()
    return fields


@fuzz_settings(50)
@given(entries=entry_lists(max_entries=4, max_rank=3, max_dim=3))
def test_integer_fields_match_the_layout(entries):
    """The structure-aware mutations below really hit the fields they aim at."""
    stream = encode(entries)
    values = [struct.unpack_from(fmt, stream, at)[0] for at, fmt in integer_fields(entries)]
    want = [2, len(entries)]
    tags = {dtype: tag for tag, dtype in enumerate(DTYPES, start=1)}
    for name, t in entries:
        want += [len(name.encode("utf-8")), t.dim(), *t.shape, tags[t.dtype],
                 t.numel() * t.element_size()]
    assert values == want


def mutate(blob: bytes, ops, fields: list[tuple[int, str]]) -> bytes:
    out = bytearray(blob)
    for op, pos, *args in ops:
        at = pos % (len(out) + 1)          # insert/truncate may use the end
        if op == "flip" and out:
            out[at % len(out)] ^= args[0]
        elif op == "insert":
            out[at:at] = args[0]
        elif op == "delete":
            del out[at:at + args[0]]
        elif op == "truncate":
            del out[at:]
        elif op in ("poke", "field"):
            value, fmt = args if op == "poke" else (args[0], None)
            if op == "field":
                at, fmt = fields[pos % len(fields)]
            size = struct.calcsize(fmt)
            packed = struct.pack(fmt.upper(), value & ((1 << 8 * size) - 1))
            out[at:at + size] = packed
    return bytes(out)


def outcome(read, blob: bytes):
    """Names read, or the FormatError; any other exception fails the test."""
    try:
        result = read(io.BytesIO(blob))
    except FormatError as e:
        assert isinstance(e, ValueError)
        assert e.offset is not None and f"offset {e.offset}" in str(e)
        return FormatError
    return list(result.entries) if hasattr(result, "entries") else result


@pytest.mark.parametrize("container", ["plain", "gzip-of-mutated", "mutated-gzip"])
@fuzz_settings(300)
@given(entries=entry_lists(max_entries=4, max_rank=3, max_dim=3), hash_=hashes,
       ops=st.lists(mutation, min_size=1, max_size=4))
def test_mutated_file_fails_only_with_format_error(container, entries, hash_, ops, workdir):
    stream = encode(entries, hash_)
    fields = integer_fields(entries)
    if container == "plain":
        blob = mutate(stream, ops, fields)
    elif container == "gzip-of-mutated":    # stream length unknown to the decoder
        blob = gzip.compress(mutate(stream, ops, fields), mtime=0)
    else:  # the gzip layer itself is damaged ("field" offsets are just positions here)
        blob = mutate(gzip.compress(stream, compresslevel=1, mtime=0), ops, fields)

    read = outcome(read_checkpoint, blob)
    keys = outcome(checkpoint_keys, blob)
    assert read == keys
    # read_verified from a path, its record matching the file: only the decoder can refuse
    path = workdir / "mutated.fdl"  # no .gz: gzip is recognised by its magic, as in memory
    path.write_bytes(blob)
    for shared_buffer in (False, True):
        assert outcome(lambda _: read_verified(path, len(blob), zlib.crc32(blob),
                                               shared_buffer=shared_buffer), blob) == read
    if read is not FormatError:
        assert checkpoint_version(io.BytesIO(blob)) in (1, 2)

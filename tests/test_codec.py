"""The pure .fdl codec: exact bytes, every dtype both ways, awkward tensors."""

from __future__ import annotations

import io
import struct

import pytest
import torch

import snapsvc
from snapsvc.format import datafile, fdl, framing
from snapsvc.errors import EncodeError

# Written by hand from shared/FORMAT.md, not produced by the encoder.
PINNED_HEX = (
    "46444c43" "02000000" + "00" * 32 + "02000000"
    # entry "w": float32 [2] = [1.0, 2.0]
    "01000000" "77" "01000000" "0200000000000000" "03" "0800000000000000"
    "0000803f" "00000040"
    # entry "step": int64 scalar = 7
    "04000000" "73746570" "00000000" "06" "0800000000000000" "0700000000000000"
)


def encode_bytes(entries, **kw) -> bytes:
    buf = io.BytesIO()
    fdl.encode(buf, entries, **kw)
    return buf.getvalue()


def decode_bytes(data: bytes) -> dict[str, torch.Tensor]:
    return {e.name: e.tensor for e in fdl.Decoder(io.BytesIO(data), size=len(data)).entries()}


def test_pinned_bytes_encode():
    entries = [("w", torch.tensor([1.0, 2.0])), ("step", torch.tensor(7))]
    assert encode_bytes(entries).hex() == PINNED_HEX


def test_pinned_bytes_decode():
    got = decode_bytes(bytes.fromhex(PINNED_HEX))
    assert list(got) == ["w", "step"]
    assert torch.equal(got["w"], torch.tensor([1.0, 2.0]))
    assert got["step"].dtype == torch.int64 and got["step"].shape == () and got["step"].item() == 7


def test_tables_are_inverse_and_match_format():
    assert {t: d for d, t in fdl.DTYPE_TO_TAG.items()} == fdl.TAG_TO_DTYPE
    assert fdl.TAG_TO_DTYPE == {1: torch.float16, 2: torch.bfloat16, 3: torch.float32,
                                4: torch.float64, 5: torch.int32, 6: torch.int64}


# The torch-free tables (the sidecar's) and the torch ones (the trainer's), per framing.
_TABLES = [(framing.FDL, fdl.DTYPE_TO_TAG, fdl.TAG_TO_DTYPE),
           (framing.DATA, datafile.DTYPE_TO_TAG, datafile.TAG_TO_DTYPE)]


@pytest.mark.parametrize("f,tag", [(f, tag) for f, _, _ in _TABLES for tag in f.tags],
                         ids=lambda v: getattr(v, "name", v))
def test_torch_free_tags_match_the_torch_tables(f, tag):
    """Each tag names one torch dtype of its element size, in all four tables."""
    to_tag, to_dtype = next((a, b) for g, a, b in _TABLES if g is f)
    name, itemsize = f.tags[tag]
    dtype = to_dtype[tag]
    assert f.tag_of[name] == tag and to_tag[dtype] == tag
    assert str(dtype) == f"torch.{name}" and dtype.itemsize == itemsize
    assert len(f.tags) == len(f.tag_of) == len(to_tag) == len(to_dtype)
    assert fdl.tag_dtypes(f) == to_dtype and fdl.dtype_tags(f) == to_tag


def test_torch_free_decoder_reads_names_and_bytes():
    """framing.Decoder (verify's, the sidecar's side) gives dtype names and raw bytes."""
    raw = bytes.fromhex(PINNED_HEX)
    got = list(framing.Decoder(io.BytesIO(raw), size=len(raw)).entries())
    assert [(e.name, e.dtype, e.shape, bytes(e.tensor)) for e in got] == [
        ("w", "float32", (2,), struct.pack("<2f", 1.0, 2.0)),
        ("step", "int64", (), struct.pack("<q", 7))]


def test_span_encoder_writes_what_fdl_encode_writes():
    """The sidecar's entries (spans of a slot) and fdl's (tensors) make the same bytes."""
    spans = [("w", 3, (2,), memoryview(struct.pack("<2f", 1.0, 2.0))),
             ("step", 6, (), struct.pack("<q", 7))]
    buf = io.BytesIO()
    framing.Encoder(spans).write(buf)
    assert buf.getvalue().hex() == PINNED_HEX
    with pytest.raises(EncodeError, match="'w': 4 bytes of data for shape"):
        framing.Encoder([("w", 3, (2,), b"1234")])


@pytest.mark.parametrize("tag,dtype", sorted(fdl.TAG_TO_DTYPE.items()))
def test_every_dtype_both_directions(tag, dtype):
    t = (torch.arange(6, dtype=torch.float64) * 1.5 - 3).to(dtype).reshape(2, 3)
    data = encode_bytes([("t", t)])
    # tag byte sits after header(44) + name_len(4) + name(1) + ndim(4) + shape(16)
    assert data[44 + 4 + 1 + 4 + 16] == tag
    assert struct.unpack_from("<Q", data, 70)[0] == 6 * t.element_size()
    back = decode_bytes(data)["t"]
    assert back.dtype == dtype and torch.equal(back, t)


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int8, torch.int16,
                                   torch.complex64, torch.float8_e4m3fn, torch.uint16])
def test_unsupported_dtype_refused_before_any_byte(dtype):
    buf = io.BytesIO()
    entries = [("ok", torch.zeros(2)), ("bad.entry", torch.zeros(2).to(dtype))]
    with pytest.raises(EncodeError) as ei:
        fdl.encode(buf, entries)
    msg = str(ei.value)
    assert "bad.entry" in msg and "float32" in msg and "bfloat16" in msg and "int64" in msg
    assert buf.getvalue() == b""


@pytest.mark.parametrize("make,what", [
    (lambda: torch.zeros(3, 3).to_sparse(), "sparse"),
    pytest.param(lambda: torch.quantize_per_tensor(torch.zeros(3), 0.1, 0, torch.qint8), "quantized",
                 marks=pytest.mark.filterwarnings("ignore::UserWarning")),
    (lambda: torch.zeros(3, device="meta"), "meta"),
])
def test_special_tensors_refused(make, what):
    with pytest.raises(EncodeError, match=what):
        encode_bytes([("x", make())])


def test_duplicate_names_refused_on_write():
    with pytest.raises(EncodeError, match="twice"):
        encode_bytes([("a", torch.zeros(1)), ("a", torch.ones(1))])


@pytest.mark.parametrize("t", [
    torch.tensor(3.5),                                   # scalar
    torch.zeros(0),                                      # empty
    torch.zeros(4, 0, 3),                                # empty with shape
    torch.arange(12.0).reshape(3, 4).t(),                # transposed
    torch.arange(24.0).reshape(2, 3, 4)[:, ::2, 1:],     # strided slice
    torch.arange(10, dtype=torch.int32).expand(3, 10),   # zero stride
], ids=["scalar", "empty", "empty-3d", "transposed", "sliced", "expanded"])
def test_awkward_tensors_roundtrip_row_major(t):
    data = encode_bytes([("x", t)])
    raw = data[-t.numel() * t.element_size():] if t.numel() else b""
    assert raw == bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())
    back = decode_bytes(data)["x"]
    assert back.shape == t.shape and back.is_contiguous() and torch.equal(back, t)


def test_unicode_names():
    names = ["encoder/weight", "layer1.0.bias", "ünïcödé.权重", "emoji🙂", ""]
    data = encode_bytes([(n, torch.ones(1)) for n in names])
    assert list(decode_bytes(data)) == names


def test_version_1_reads_like_2():
    data = bytearray(bytes.fromhex(PINNED_HEX))
    data[4:8] = struct.pack("<I", 1)
    assert snapsvc.checkpoint_version(io.BytesIO(bytes(data))) == 1
    ckpt = snapsvc.read_checkpoint(io.BytesIO(bytes(data)))
    assert ckpt.version == 1 and list(ckpt.entries) == ["w", "step"]


def test_structural_hash_written():
    h = bytes(range(32))
    data = encode_bytes([("w", torch.zeros(1))], structural_hash=h)
    assert data[8:40] == h


def test_encode_streams_entry_by_entry():
    """The encoder hands each tensor's memory to the writer; it never joins the file."""
    class Recorder(io.RawIOBase):
        def __init__(self):
            self.sizes = []

        def writable(self):
            return True

        def write(self, b):
            self.sizes.append(len(memoryview(b)))
            return len(memoryview(b))

    big = torch.zeros(1 << 20)
    rec = Recorder()
    fdl.encode(rec, [("a", big), ("b", big.clone())])
    assert max(rec.sizes) == big.numel() * 4  # one tensor's data, never more
    assert sum(rec.sizes) == fdl.encoded_size([("a", big), ("b", big)])


def test_skip_mode_returns_no_data():
    data = bytes.fromhex(PINNED_HEX)
    entries = list(fdl.Decoder(io.BytesIO(data), size=len(data), seekable=True).entries(load=False))
    assert [(e.name, e.shape, e.dtype, e.tensor) for e in entries] == [
        ("w", (2,), torch.float32, None), ("step", (), torch.int64, None)]

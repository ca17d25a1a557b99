"""The write path from tensors to disk: batching in the encoder, chunked
direct writes in DurableFile. Same bytes and CRC as the simple path, whatever
the mix of write sizes."""

from __future__ import annotations

import array
import ctypes
import io
import zlib

import torch

from snapsvc import durable, fdl


class Recorder(io.RawIOBase):
    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        view = memoryview(b)
        self.chunks.append(bytes(view))
        return view.nbytes


def test_small_entries_are_batched_and_bytes_unchanged():
    entries = [(f"t{i}", torch.full((3,), float(i))) for i in range(5000)]
    rec = Recorder()
    n = fdl.encode(rec, entries)
    assert len(rec.chunks) < 20  # not two writes per entry
    data = b"".join(rec.chunks)
    assert n == len(data) == fdl.encoded_size(entries)
    got = list(fdl.Decoder(io.BytesIO(data), size=len(data)).entries())
    assert [e.name for e in got] == [name for name, _ in entries]
    assert all(torch.equal(e.tensor, t) for e, (_, t) in zip(got, entries))


def test_large_tensor_reaches_writer_uncopied():
    big = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB
    seen = []

    class Spy(io.RawIOBase):
        def writable(self) -> bool:
            return True

        def write(self, b) -> int:
            seen.append(b)
            return memoryview(b).nbytes

    fdl.encode(Spy(), [("a", torch.ones(2)), ("big", big), ("c", torch.ones(2))])
    views = [b for b in seen if memoryview(b).nbytes == big.numel() * 4]
    assert len(views) == 1
    addr = ctypes.addressof(ctypes.c_char.from_buffer(views[0]))
    assert addr == big.data_ptr()  # the tensor's own memory, not a copy


def test_durable_file_chunked_writes_match_one_buffer(tmp_path, monkeypatch):
    monkeypatch.setattr(durable, "WRITE_CHUNK", 3 << 20)  # several chunks, one partial
    big = torch.randint(0, 256, (10 << 20,), dtype=torch.uint8)
    parts = [b"head", fdl._byte_view(big), bytearray(b"x" * 1000),
             fdl._byte_view(big[5:(2 << 20) + 5]), memoryview(array.array("i", range(300_000))), b"tail"]
    path = tmp_path / "f.bin"
    with durable.atomic_write(path) as out:
        for p in parts:
            assert out.write(p) == memoryview(p).nbytes
    want = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
    assert path.read_bytes() == want
    assert (out.size, out.crc32) == (len(want), zlib.crc32(want))

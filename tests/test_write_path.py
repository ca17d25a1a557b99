"""The write path from tensors to disk: batching in the encoder, chunked
direct writes in DurableFile. Same bytes and CRC as the simple path, whatever
the mix of write sizes."""

from __future__ import annotations

import array
import ctypes
import errno
import io
import multiprocessing
import os
import zlib

import pytest
import torch

from snapsvc.files import durable

from snapsvc.format import fdl
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


def _temps(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.endswith(durable.TMP_SUFFIX))


def test_commit_sets_a_replaced_file_aside_until_the_caller_frees_it(tmp_path):
    path = tmp_path / "ck.fdl"
    path.write_bytes(b"old")
    with durable.staged_write(path) as out:
        out.write(b"new")
    trash: list[str] = []
    durable.commit(out, trash=trash)
    assert path.read_bytes() == b"new"
    assert len(trash) == 1 and open(trash[0], "rb").read() == b"old"  # not freed yet
    assert _temps(tmp_path) == [os.path.basename(trash[0])]
    durable.unlink_quietly(trash + trash)  # twice: already gone is fine
    assert _temps(tmp_path) == []


def test_set_aside_without_hard_links_falls_back(tmp_path, monkeypatch):
    path = tmp_path / "ck.fdl"
    path.write_bytes(b"old")
    assert durable.set_aside(str(tmp_path / "missing")) is None

    def no_links(*a, **k):
        raise PermissionError(errno.EPERM, "no hard links here")

    monkeypatch.setattr(os, "link", no_links)
    assert durable.set_aside(str(path)) is None
    with durable.staged_write(path) as out:
        out.write(b"new")
    trash: list[str] = []
    durable.commit(out, trash=trash)  # replaced in place, freed on the spot
    assert path.read_bytes() == b"new" and trash == [] and _temps(tmp_path) == []


def _aside_and_exit(path: str) -> None:
    durable.set_aside(path)  # then die without freeing it


@pytest.mark.timeout(60)
def test_a_set_aside_file_left_by_a_dead_process_is_a_stale_temp(tmp_path):
    path = tmp_path / "ck.fdl"
    path.write_bytes(b"data")
    proc = multiprocessing.get_context("spawn").Process(target=_aside_and_exit, args=(str(path),))
    proc.start()
    proc.join(30)
    assert proc.exitcode == 0 and len(_temps(tmp_path)) == 1
    removed = durable.remove_stale_temps(tmp_path)
    assert len(removed) == 1 and _temps(tmp_path) == []
    assert path.read_bytes() == b"data"

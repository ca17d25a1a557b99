"""restore and load_snapshot check each file's size and CRC-32 against the metadata.

Every damaged case must raise FormatError naming the damaged file and saying
what the metadata records, and leave the model and the optimizer bit for bit
as they were. The checkpoints are written once per module by the real
sidecar; each test damages its own copies.
"""

from __future__ import annotations

import gc
import os
import shutil
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import snapsvc
from snapsvc import FormatError

pytestmark = pytest.mark.timeout(120)

FILES = ("fdl", "optim.fdl", "fdl.meta")


def make(seed: int, device: str = "cpu") -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model and an Adam whose state exists (one step), both from ``seed``."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.Linear(64, 4)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    step(model, opt)
    return model, opt


def step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    device = next(model.parameters()).device
    loss = model(torch.randn(8, 32, device=device)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def clone(value: Any) -> Any:
    """A deep copy of a state dict, tensors cloned."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(clone(v) for v in value)
    return value


def same(a: Any, b: Any) -> bool:
    """Tensors bit for bit (dtype, shape, device, values), the rest by value, recursively."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and a.device == b.device and torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        # a tuple hyperparameter (Adam's betas) comes back a tuple, as torch.load gives it
        return type(b) is type(a) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return clone({"model": model.state_dict(), "opt": opt.state_dict()})


def tensor_bytes(t: torch.Tensor) -> bytes:
    assert t.dtype == torch.float32
    return struct.pack(f"<{t.numel()}f", *t.detach().cpu().flatten().tolist())


@dataclass
class Saved:
    dir: Path
    state: dict[str, Any]     # the model and optimizer in ck.fdl and ck.fdl.gz


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Saved:
    """ck.fdl, ck.fdl.gz: one checkpoint with its optimizer. old.fdl, old.fdl.gz:
    a checkpoint overwritten by a later one, with the earlier one's metadata put
    back, as a crash between the overwrite's renames leaves them."""
    d = tmp_path_factory.mktemp("saved")
    model, opt = make(0)
    with snapsvc.SnapshotWriter(d) as w:
        for name in ("ck.fdl", "ck.fdl.gz", "old.fdl", "old.fdl.gz"):
            w.submit(model, name, optimizer=opt, epoch=1, extra={"step": 1}).result(timeout=60)
        first = state(model, opt)
        old_meta = {n: (d / f"{n}.meta").read_bytes() for n in ("old.fdl", "old.fdl.gz")}
        step(model, opt)
        for name in ("old.fdl", "old.fdl.gz"):
            w.submit(model, name, optimizer=opt, epoch=2, extra={"step": 2}).result(timeout=60)
    for name, data in old_meta.items():
        (d / f"{name}.meta").write_bytes(data)
    return Saved(d, first)


@pytest.fixture(params=["mapped", "read"])
def reads(request, monkeypatch):
    """Plain files are checked through a mapping of the file, or, where it
    cannot be mapped, read into a buffer: both must refuse the same damage."""
    if request.param == "read":
        from snapsvc.files import checkpoint
        monkeypatch.setattr(checkpoint, "_read_mapped", lambda *a, **k: None)
    return request.param


def copy(saved: Saved, stem: str, suffix: str, dest: Path) -> Path:
    """The checkpoint ``stem`` + ``suffix`` ("fdl" or "fdl.gz") and its files, into ``dest``."""
    gz = ".gz" if suffix.endswith(".gz") else ""
    for kind in FILES:
        name = f"{stem}.{kind.replace('fdl', 'fdl' + gz, 1)}"
        shutil.copy(saved.dir / name, dest / name)
    return dest / f"{stem}.{suffix}"


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def flip_data_byte(path: Path, t: torch.Tensor) -> None:
    """Flip a byte in the middle of ``t``'s data in the (plain) file ``path``."""
    raw = tensor_bytes(t)
    at = path.read_bytes().find(raw)
    assert at > 0, "tensor data not found in the file"
    flip(path, at + len(raw) // 2)


def restore_fails(ckpt: Path, bad: Path, match: str, *, with_optimizer: bool = True,
                  device: str = "cpu") -> None:
    """restore(ckpt) raises FormatError naming ``bad``; nothing changes."""
    model, opt = make(1, device)
    before = state(model, opt)
    with pytest.raises(FormatError, match=match) as info:
        snapsvc.restore(ckpt, model, opt if with_optimizer else None)
    assert info.value.path == str(bad) and str(bad) in str(info.value)
    assert same(state(model, opt), before), "restore changed the model or optimizer"


# -- a clean checkpoint -------------------------------------------------------------
@pytest.mark.parametrize("suffix", ["fdl", "fdl.gz"])
def test_clean_checkpoint_restores_bit_exactly(saved, suffix, tmp_path, reads):
    path = copy(saved, "ck", suffix, tmp_path)
    model, opt = make(1)
    assert not same(state(model, opt), saved.state)
    report = snapsvc.restore(path, model, opt)
    assert same(state(model, opt), saved.state)
    assert report.epoch == 1 and report.extra == {"step": 1} and not report.skipped


# -- damage ---------------------------------------------------------------------------
def test_flipped_data_byte_in_model_file(saved, tmp_path, reads):
    path = copy(saved, "ck", "fdl", tmp_path)
    flip_data_byte(path, saved.state["model"]["0.weight"])
    for with_optimizer in (True, False):
        restore_fails(path, path, r"CRC-32 [0-9a-f]{8} but its metadata records [0-9a-f]{8}",
                      with_optimizer=with_optimizer)


def test_flipped_data_byte_in_optimizer_file(saved, tmp_path, reads):
    path = copy(saved, "ck", "fdl", tmp_path)
    opath = tmp_path / "ck.optim.fdl"
    flip_data_byte(opath, saved.state["opt"]["state"][0]["exp_avg"])
    restore_fails(path, opath, "CRC-32 .* metadata records")


@pytest.mark.parametrize("which", ["fdl.gz", "optim.fdl.gz"])
def test_flipped_byte_in_gzip_file(saved, which, tmp_path):
    path = copy(saved, "ck", "fdl.gz", tmp_path)
    bad = tmp_path / f"ck.{which}"
    flip(bad, bad.stat().st_size // 2)  # inside the deflate data
    restore_fails(path, bad, "metadata records")


@pytest.mark.parametrize("suffix, which", [("fdl", "fdl"), ("fdl", "optim.fdl"),
                                           ("fdl.gz", "fdl.gz")])
def test_truncated_file(saved, suffix, which, tmp_path, reads):
    path = copy(saved, "ck", suffix, tmp_path)
    bad = tmp_path / f"ck.{which}"
    size = bad.stat().st_size
    with open(bad, "r+b") as f:
        f.truncate(size - 100)
    restore_fails(path, bad, rf"has {size - 100} bytes but its metadata records {size}: "
                             "it is truncated")


@pytest.mark.parametrize("suffix", ["fdl", "fdl.gz"])
def test_new_file_beside_old_metadata(saved, suffix, tmp_path, reads):
    """An overwrite that crashed after renaming the checkpoint, before its metadata."""
    path = copy(saved, "old", suffix, tmp_path)
    restore_fails(path, path, "not the file its metadata was written for")


def test_file_longer_than_recorded(saved, tmp_path, reads):
    path = copy(saved, "ck", "fdl", tmp_path)
    with open(path, "ab") as f:
        f.write(b"\0")
    restore_fails(path, path, "longer than it was written")


# -- load_snapshot ----------------------------------------------------------------------
def test_load_snapshot_checks_the_file(saved, tmp_path):
    path = copy(saved, "ck", "fdl", tmp_path)
    snap = snapsvc.load_snapshot(path)
    assert same(snap.params["0.weight"], saved.state["model"]["0.weight"])
    flip_data_byte(path, saved.state["model"]["2.weight"])
    with pytest.raises(FormatError, match="CRC-32 .* metadata records") as info:
        snapsvc.load_snapshot(path)
    assert info.value.path == str(path)


def test_load_snapshot_new_file_beside_old_metadata(saved, tmp_path):
    path = copy(saved, "old", "fdl.gz", tmp_path)
    with pytest.raises(FormatError, match="not the file its metadata was written for"):
        snapsvc.load_snapshot(path)


# -- read_verified, the reusable check ------------------------------------------------
@pytest.mark.parametrize("suffix", ["fdl", "fdl.gz"])
@pytest.mark.parametrize("shared_buffer", [False, True])
def test_read_verified_matches_read_checkpoint(saved, suffix, shared_buffer, reads):
    from snapsvc.files.checkpoint import read_verified
    from snapsvc.files.meta import read_meta

    path = saved.dir / f"ck.{suffix}"
    meta = read_meta(path)
    got = read_verified(path, meta.size, meta.crc32, shared_buffer=shared_buffer)
    want = snapsvc.read_checkpoint(path)
    assert got.path == str(path) and got.version == want.version
    assert got.structural_hash == want.structural_hash == meta.structural_hash
    assert same(got.entries, want.entries)


def test_read_verified_names_the_record(tmp_path):
    from snapsvc.files.checkpoint import read_verified

    path = tmp_path / "m.fdl"
    snapsvc.save_checkpoint(path, {"w": torch.arange(6.0)})
    data = path.read_bytes()
    with pytest.raises(FormatError, match=f"manifest records {zlib.crc32(data) ^ 1:08x}"):
        read_verified(path, len(data), zlib.crc32(data) ^ 1, recorded_in="manifest")
    with pytest.raises(FormatError, match="records size None"):
        read_verified(path, None, 0)  # type: ignore[arg-type]  # metadata lacking a field


# -- CUDA: through pinned memory ---------------------------------------------------------
@pytest.mark.gpu
def test_restore_to_cuda_through_pinned_memory(saved, tmp_path, monkeypatch):
    from snapsvc.files import checkpoint
    pinned = []
    real = checkpoint._file_buffer

    def spy(size: int, pin_memory: bool):
        pinned.append(pin_memory)
        return real(size, pin_memory)

    monkeypatch.setattr(checkpoint, "_file_buffer", spy)
    path = copy(saved, "ck", "fdl", tmp_path)
    model, opt = make(1, "cuda")
    snapsvc.restore(path, model, opt)
    assert pinned == [True]
    want = saved.state["model"]
    assert all(t.is_cuda and torch.equal(t.cpu(), want[k]) for k, t in model.state_dict().items())
    flip_data_byte(path, want["0.weight"])
    restore_fails(path, path, "CRC-32", device="cuda")


def _cold_file(tmp_path):
    """A saved file whose pages are no longer in the page cache, its size and CRC-32."""
    path = tmp_path / "m.fdl"
    snapsvc.save_checkpoint(path, {"w": torch.arange(1 << 20, dtype=torch.float32)})
    data = path.read_bytes()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages leave the cache
    finally:
        os.close(fd)
    return path, len(data), zlib.crc32(data)


def test_only_a_file_in_the_page_cache_is_mapped(tmp_path, monkeypatch):
    """A page that must come from the disk would report a read error as SIGBUS:
    where the kernel cannot populate a mapping (before Linux 5.14), a file
    not wholly in the page cache is read, not mapped."""
    from snapsvc.files import checkpoint
    from snapsvc.format import fdl
    monkeypatch.setattr(checkpoint, "_populates", False)
    path, size, crc = _cold_file(tmp_path)
    if checkpoint._read_mapped(str(path), size, crc, "metadata", fdl.FDL) is not None:
        pytest.skip("this file system keeps the pages cached despite DONTNEED")
    read = checkpoint.read_verified(path, size, crc, shared_buffer=True)
    assert torch.equal(read.entries["w"], torch.arange(1 << 20, dtype=torch.float32))
    got = checkpoint._read_mapped(str(path), size, crc, "metadata", fdl.FDL)  # now it is cached
    assert got is not None and torch.equal(got.entries["w"],
                                           torch.arange(1 << 20, dtype=torch.float32))


def test_a_cold_file_is_mapped_through_populate_and_still_checked(tmp_path):
    """Where the kernel populates a mapping in one call (which reports a read
    error as an error, not a SIGBUS), a cold file is mapped too (issue 34):
    its pages come from the disk in that call, and the CRC-32 still refuses
    a damaged one."""
    from snapsvc.files import checkpoint
    from snapsvc.format import fdl
    if not checkpoint._can_populate():
        pytest.skip("not Linux 5.14+: no MADV_POPULATE_READ")
    path, size, crc = _cold_file(tmp_path)
    got = checkpoint._read_mapped(str(path), size, crc, "metadata", fdl.FDL)
    assert got is not None and torch.equal(got.entries["w"],
                                           torch.arange(1 << 20, dtype=torch.float32))
    del got
    gc.collect()
    with pytest.raises(snapsvc.FormatError, match="CRC-32"):
        checkpoint._read_mapped(str(path), size, crc ^ 1, "metadata", fdl.FDL)


@pytest.mark.parametrize("extra", [0, 3, 4097])
def test_crc32_of_a_buffer_in_parallel_parts_is_its_crc32(monkeypatch, extra):
    """crc32_of checksums a large buffer in parts on several threads and
    combines them: the same CRC-32 as one pass, whatever the split."""
    from snapsvc.format import streams
    monkeypatch.setattr(streams, "_CRC_PART", 1 << 16)
    monkeypatch.setattr(streams, "_ALIGN", 4096)
    monkeypatch.setattr(streams, "_cores", lambda: 3)
    data = os.urandom((3 << 16) + extra)
    seen: list[tuple[int, int]] = []
    assert streams.crc32_of(memoryview(data), lambda at, n: seen.append((at, n))) \
        == zlib.crc32(data)
    assert len(seen) == 3 and sum(n for _, n in seen) == len(data)  # every byte, in 3 parts
    assert streams.crc32_of(memoryview(data[:100])) == zlib.crc32(data[:100])

    def unreadable(at: int, n: int) -> None:
        if at:
            raise OSError("a page past the first part")

    with pytest.raises(OSError, match="past the first"):  # raised on the caller's thread
        streams.crc32_of(memoryview(data), unreadable)
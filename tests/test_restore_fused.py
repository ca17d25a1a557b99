"""A nested state's restore fills the optimizer's fresh state while the file is
checksummed (issues 31, 34): each piece is copied just after its CRC, before
the whole file is known good. All or nothing still holds: whatever the damage
(a flipped byte in the first piece or the last, a truncated file, damage to an
entry's header), the restore raises FormatError and the live model, optimizer
and scheduler are bit for bit, and object for object, as they were; the same
for a RAM copy with no disk copy behind it. The file is checksummed in one
part and in two (two threads, as on two cores)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import snapsvc
from snapsvc import FormatError
from snapsvc.files import checkpoint, ramtier
from snapsvc.format import streams

pytestmark = pytest.mark.timeout(120)


def make(seed: int) -> dict[str, Any]:
    """A model (about 1.3 MiB) with AdamW's state (one step) and a scheduler."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(256, 512), nn.LayerNorm(512), nn.Linear(512, 384))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.9 ** e)
    model(torch.randn(4, 256)).square().mean().backward()
    opt.step()
    sched.step()
    return {"model": model, "opt": opt, "sched": sched, "step": seed}


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """What must not change: every tensor cloned, and which objects hold the optimizer state."""
    opt = state["opt"]
    return {"model": {k: v.clone() for k, v in state["model"].state_dict().items()},
            "opt": {i: {k: (v, v.clone()) for k, v in s.items()}
                    for i, s in enumerate(opt.state.values())},
            "sched": dict(state["sched"].state_dict())}


def unchanged(state: dict[str, Any], before: dict[str, Any]) -> bool:
    model = state["model"].state_dict()
    if model.keys() != before["model"].keys() or not all(
            torch.equal(model[k], v) for k, v in before["model"].items()):
        return False
    now = list(state["opt"].state.values())
    for i, saved in before["opt"].items():
        for k, (obj, value) in saved.items():
            # the very tensor it held (load_state_dict was not called), with its values
            if now[i][k] is not obj or not torch.equal(obj, value):
                return False
    return state["sched"].state_dict() == before["sched"]


@pytest.fixture(params=[1, 2], ids=["one part", "two parts"])
def parts(request, monkeypatch):
    """Checksummed in one part, or in two on two threads (the file is a few MiB)."""
    monkeypatch.setattr(streams, "_CRC_PART", (1 << 20) if request.param == 2 else (1 << 40))
    monkeypatch.setattr(streams, "_cores", lambda: 2)
    return request.param


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("fused")
    with snapsvc.SnapshotWriter(d) as w:
        w.submit(make(0), "s.fdl").result(timeout=60)
    return d / "s.fdl"


def copied(saved: Path, dest: Path) -> Path:
    for name in (saved.name, saved.name + ".meta"):
        (dest / name).write_bytes((saved.parent / name).read_bytes())
    return dest / saved.name


def flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))


def data_offset(path: Path, t: torch.Tensor) -> int:
    at = path.read_bytes().find(t.detach().numpy().tobytes())
    assert at > 0
    return at


def refused(path: Path, match: str) -> None:
    state = make(1)
    before = snapshot(state)
    with pytest.raises(FormatError, match=match) as info:
        snapsvc.restore(path, state)
    assert info.value.path == str(path)
    assert unchanged(state, before), "a refused restore changed the live state"


def test_restores_bit_exactly_and_the_optimizer_owns_its_state(saved, tmp_path, parts,
                                                               monkeypatch):
    from snapsvc.files import fused
    copiers: list[Any] = []
    made = fused.PieceCopier.__init__

    def spy(self: Any, *args: Any) -> None:
        made(self, *args)
        copiers.append(self)
    monkeypatch.setattr(fused.PieceCopier, "__init__", spy)
    want = make(0)
    state = make(1)
    report = snapsvc.restore(copied(saved, tmp_path), state)
    # the optimizer's state was filled during the checksum, none left for after it
    assert len(copiers) == 1 and copiers[0].spans and copiers[0].rest == []
    assert report.state["step"] == 0
    for k, v in want["model"].state_dict().items():
        assert torch.equal(state["model"].state_dict()[k], v)
    got, ref = state["opt"].state_dict(), want["opt"].state_dict()
    for i, s in ref["state"].items():
        for k, v in s.items():
            assert torch.equal(got["state"][i][k], v), (i, k)
            assert got["state"][i][k].untyped_storage().nbytes() == v.nbytes  # not the mapping
    assert state["sched"].state_dict() == want["sched"].state_dict()


def test_a_file_that_cannot_be_mapped_fills_the_same(saved, tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "_read_mapped", lambda *a, **k: None)
    state = make(1)
    snapsvc.restore(copied(saved, tmp_path), state)
    want = make(0)["opt"].state_dict()["state"]
    assert all(torch.equal(state["opt"].state_dict()["state"][i][k], v)
               for i, s in want.items() for k, v in s.items())


def test_flipped_byte_in_the_first_piece(saved, tmp_path, parts):
    path = copied(saved, tmp_path)
    first = make(0)["model"][0].weight  # the file's first tensor
    at = data_offset(path, first) + 5
    assert at < streams.FUSE_PIECE
    flip(path, at)
    refused(path, "CRC-32")


def test_flipped_byte_in_the_last_piece(saved, tmp_path, parts):
    """The last piece is checksummed (and copied into the fresh state) last of all."""
    path = copied(saved, tmp_path)
    state = make(0)
    last = max((t for s in state["opt"].state.values() for t in s.values() if t.dim()),
               key=lambda t: data_offset(path, t))
    at = data_offset(path, last) + last.nbytes - 1
    assert os.path.getsize(path) - at < streams.FUSE_PIECE
    flip(path, at)
    refused(path, "CRC-32")


def test_damaged_entry_header_reports_the_crc_first(saved, tmp_path, parts):
    """An entry name damaged: decoding the unchecked file finds a name the metadata
    does not know, but the error says the file is corrupt."""
    path = copied(saved, tmp_path)
    data = path.read_bytes()
    at = data.find(b"0.bias")
    assert at > 0
    flip(path, at + 1)
    refused(path, "CRC-32")


@pytest.mark.parametrize("cut", [1, 4096])
def test_truncated_file(saved, tmp_path, cut):
    path = copied(saved, tmp_path)
    os.truncate(path, os.path.getsize(path) - cut)
    refused(path, "truncated")


def test_bad_ram_copy_with_no_disk_copy(tmp_path, parts):
    """A memory-only snapshot damaged in the sidecar's RAM: no disk copy to fall
    back to, so the restore refuses it, and nothing live changed."""
    d = tmp_path / "ck"
    with snapsvc.SnapshotWriter(d) as w:
        w.submit(make(0), "s.fdl", persist=False).result(timeout=60)
        ram = ramtier.held(d / "s.fdl")
        assert ram is not None and not (d / "s.fdl").exists()
        state = make(1)
        snapsvc.restore(d / "s.fdl", state)  # whole: read from RAM
        assert torch.equal(state["model"][2].bias, make(0)["model"][2].bias)
        last = max((t for s in state["opt"].state.values() for t in s.values() if t.dim()),
                   key=lambda t: data_offset(Path(ram), t))
        flip(Path(ram), data_offset(Path(ram), last) + last.nbytes - 1)
        state = make(1)
        before = snapshot(state)
        with pytest.raises(FormatError, match="CRC-32"):
            snapsvc.restore(d / "s.fdl", state)
        assert unchanged(state, before)


def test_piece_copier_fills_every_destination_of_overlapping_sources() -> None:
    """Two destinations of one span (metadata naming an entry twice) and one of a span
    inside another: each is filled, the ones the in-cache walk cannot take after the check
    (review: the walk assumed disjoint spans and left a fresh tensor unfilled)."""
    from snapsvc.files.fused import PieceCopier
    buf = bytearray(torch.arange(1 << 20, dtype=torch.int32).numpy().tobytes())  # 4 MiB
    whole = torch.frombuffer(buf, dtype=torch.int32)
    sources = [whole, whole, whole[1000:3000], whole[(1 << 19):]]
    pairs = [(s, torch.empty_like(s)) for s in sources]
    copier = PieceCopier(buf, len(buf), pairs)
    streams.crc32_of(memoryview(buf), copier.populate, copier)
    copier.copy_rest()
    for i, (src, dst) in enumerate(pairs):
        assert torch.equal(src, dst), i

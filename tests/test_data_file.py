"""Tensors whose dtype .fdl has no tag for: through the slot into the data file beside the
checkpoint (``x.fdl.data``), committed with it, checked on read, rotated with it; the
``.fdl`` stays what flodl loads. Old checkpoints, which kept such tensors in the
metadata, still load."""

from __future__ import annotations

import dataclasses
import os
import zlib

import pytest
import torch
from torch import nn

import snapsvc
from snapsvc.files.durable import commit
from snapsvc.files.meta import Meta, data_path, read_meta, stage_meta, write_with_meta
from snapsvc.format import datafile, fdl
from snapsvc.format.protocol import InlineTensor, TensorRef
from snapsvc.format.streams import MemoryReader
from test_state import assert_same

pytest_plugins = ["remote_fixtures"]  # s3: skipped without obstore, moto or boto3

# no_leaks on each test but the table's, which shares one writer (one sidecar start)
pytestmark = pytest.mark.timeout(180)
leak_checked = pytest.mark.usefixtures("no_leaks")


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Every bit pattern the dtype takes (bool: 0 and 1), from random bytes."""
    g = torch.Generator().manual_seed(seed)
    n = torch.Size(shape).numel() * dtype.itemsize
    raw = torch.randint(0, 2 if dtype == torch.bool else 256, (n,), dtype=torch.uint8,
                        generator=g)
    return raw.view(dtype).reshape(shape)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    return {"model": nn.Linear(3, 2), "mask": _random(torch.bool, (4, 5), seed),
            "q": {"w": _random(torch.int8, (7,), seed + 1)}, "rng": torch.get_rng_state(),
            "step": 3}


@pytest.fixture(scope="module")
def writer(tmp_path_factory):
    with snapsvc.SnapshotWriter(tmp_path_factory.mktemp("dtypes")) as w:
        yield w


@pytest.mark.parametrize("dtype", list(datafile.DTYPE_TO_TAG), ids=str)
def test_every_dtype_of_the_table_round_trips_bit_exact(writer, dtype):
    assert datafile.TAG_TO_DTYPE[datafile.DTYPE_TO_TAG[dtype]] == dtype  # both directions
    assert len(datafile.TAG_TO_DTYPE) == len(datafile.DTYPE_TO_TAG)
    values = {"x": _random(dtype, (3, 5)), "scalar": _random(dtype, (), 1),
              "empty": torch.empty(0, 2, dtype=dtype), "strided": _random(dtype, (4, 6), 2)[:, ::2]}
    name = f"{str(dtype)[6:]}.fdl"
    writer.submit({"model": nn.Linear(2, 2), **values}, name).result(timeout=60)
    path = os.path.join(writer.directory, name)
    back = snapsvc.load(path)
    for key, want in values.items():
        assert back[key].dtype == dtype and back[key].shape == want.shape, key
        assert _bits(back[key]) == _bits(want), key
    meta = read_meta(path)
    assert meta.data["entries"] == len(values) and os.path.exists(data_path(path))
    assert all(type(meta.state[k]) is TensorRef for k in values)  # not in the metadata
    assert snapsvc.verify(path).ok


@leak_checked
def test_fdl_is_the_same_bytes_as_a_checkpoint_of_the_tagged_tensors_alone(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    extras = {"mask": _random(torch.bool, (8, 8)), "codes": _random(torch.uint8, (100,))}
    with snapsvc.SnapshotWriter(tmp_path) as w:
        w.submit({"model": model, "opt": opt, **extras}, "with.fdl").result(timeout=60)
        w.submit({"model": model, "opt": opt}, "without.fdl").result(timeout=60)
    with_, without = tmp_path / "with.fdl", tmp_path / "without.fdl"
    assert with_.read_bytes() == without.read_bytes()
    assert os.path.exists(data_path(with_)) and not os.path.exists(data_path(without))
    back = snapsvc.load(with_)
    assert _bits(back["mask"]) == _bits(extras["mask"])
    assert _bits(back["codes"]) == _bits(extras["codes"])


@leak_checked
def test_a_models_own_untagged_buffer_goes_to_the_data_file_and_flodl_loads_the_rest(tmp_path):
    def make(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        m.register_buffer("keep", _random(torch.bool, (4,), seed))
        return m
    model = make(0)
    with snapsvc.SnapshotWriter(tmp_path) as w:
        w.submit({"model": model}, "s.fdl").result(timeout=60)
        w.submit(model, "m.fdl").result(timeout=60)   # a model submit, too
    for name in ("s.fdl", "m.fdl"):
        ckpt = snapsvc.read_checkpoint(tmp_path / name)  # what flodl reads: tagged dtypes only
        assert {t.dtype for t in ckpt.entries.values()} <= set(fdl.DTYPE_TO_TAG)
        fresh = make(1)
        report = snapsvc.load_checkpoint(tmp_path / name, fresh)  # the model's own hash
        assert report.missing == ["keep"] and not report.skipped, name
        assert torch.equal(fresh[0].weight, model[0].weight)
    fresh = make(2)
    snapsvc.restore(tmp_path / "s.fdl", {"model": fresh})
    assert torch.equal(fresh.keep, model.keep)
    fresh = make(3)
    assert "keep" in snapsvc.restore(tmp_path / "m.fdl", fresh).loaded
    assert torch.equal(fresh.keep, model.keep)
    assert torch.equal(snapsvc.load_snapshot(tmp_path / "m.fdl").buffers["keep"], model.keep)


@leak_checked
def test_large_bool_mask_is_written_and_read_back(tmp_path):
    mask = _random(torch.bool, (8192, 8192))  # 64 MiB, no float temporary
    with snapsvc.SnapshotWriter(tmp_path, slots=1) as w:
        w.submit({"mask": mask}, "mask.fdl").result(timeout=120)
    assert torch.equal(snapsvc.load(tmp_path / "mask.fdl")["mask"], mask)
    assert os.path.getsize(tmp_path / "mask.fdl.meta") < 4096  # the tensor is not in there


@leak_checked
def test_80_mib_of_int8_is_written_and_read_back(tmp_path):
    q = torch.randint(-128, 128, (80 << 20,), dtype=torch.int8,
                      generator=torch.Generator().manual_seed(1))
    with snapsvc.SnapshotWriter(tmp_path, slots=1) as w:
        w.submit({"model": nn.Linear(2, 2), "q": q}, "q.fdl").result(timeout=120)
    assert torch.equal(snapsvc.load(tmp_path / "q.fdl")["q"], q)


@leak_checked
def test_data_file_cut_at_every_offset_is_a_format_error_naming_file_and_offset(tmp_path):
    with snapsvc.SnapshotWriter(tmp_path) as w:
        w.submit(_state(), "s.fdl").result(timeout=60)
    path = data_path(tmp_path / "s.fdl")
    good = open(path, "rb").read()
    for n in range(len(good)):
        with pytest.raises(snapsvc.FormatError) as e:
            dec = fdl.Decoder(MemoryReader(memoryview(good[:n])), size=n, path=path,
                              framing=datafile.DATA)
            list(dec.entries())
        assert e.value.path == path and e.value.offset is not None and e.value.offset <= n, n
    for n in (0, 43, len(good) // 2, len(good) - 1):  # through the reader: the file named
        with open(path, "wb") as f:
            f.write(good[:n])
        with pytest.raises(snapsvc.FormatError, match="truncated") as e:
            snapsvc.load(tmp_path / "s.fdl")
        assert e.value.path == path


@leak_checked
def test_corrupt_data_file_is_refused_restore_changes_nothing_verify_catches_each_byte(tmp_path):
    with snapsvc.SnapshotWriter(tmp_path) as w:
        w.submit(_state(0), "s.fdl").result(timeout=60)
    path = data_path(tmp_path / "s.fdl")
    good = open(path, "rb").read()
    target = _state(1)
    before = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in target.items()}
    before["model"] = {k: v.clone() for k, v in target["model"].state_dict().items()}
    before["q"] = {"w": target["q"]["w"].clone()}
    for offset in range(len(good)):
        bad = bytearray(good)
        bad[offset] ^= 0x40
        with open(path, "wb") as f:
            f.write(bad)
        report = snapsvc.verify(tmp_path / "s.fdl")
        assert not report.ok and any(path in p for p in report.problems), offset
        if offset % 16 == 0:  # a sample through restore: the whole restore is checked
            with pytest.raises(snapsvc.FormatError) as e:
                snapsvc.restore(tmp_path / "s.fdl", target)
            assert e.value.path == path
    after = dict(target, model=target["model"].state_dict())
    assert_same({k: after[k] for k in ("mask", "rng", "q", "step")},
                {k: before[k] for k in ("mask", "rng", "q", "step")})
    assert_same(dict(after["model"]), before["model"])
    with open(path, "wb") as f:
        f.write(good)
    report = snapsvc.restore(tmp_path / "s.fdl", target)
    assert _bits(target["mask"]) == _bits(_state(0)["mask"]) and "mask" in report.loaded


@leak_checked
def test_cli_verify_and_inspect_know_the_data_file(tmp_path, capsys):
    from snapsvc.cli import main
    with snapsvc.SnapshotWriter(tmp_path) as w:
        w.submit(_state(), "s.fdl").result(timeout=60)
    files = sorted(str(p) for p in tmp_path.iterdir())
    assert main(["verify", *files]) == 0
    out = capsys.readouterr().out
    assert f"{data_path(tmp_path / 's.fdl')}: OK, checked as the data file of" in out
    assert main(["inspect", str(tmp_path / "s.fdl")]) == 0
    assert "data file: 3 entries in s.fdl.data" in capsys.readouterr().out
    assert main(["inspect", data_path(tmp_path / "s.fdl")]) == 0
    out = capsys.readouterr().out
    assert "mask" in out and "bool" in out and "format:          data" in out


@leak_checked
def test_keep_last_removes_data_files_and_an_overwrite_without_one_drops_it(tmp_path):
    with snapsvc.SnapshotWriter(tmp_path, keep_last=1) as w:
        for i in (1, 2):
            w.submit(_state(i), f"step{i}.fdl").result(timeout=60)
        # the names go before the report; their data is freed just after it
        assert [n for n in os.listdir(tmp_path) if n.startswith("step1")] == []
        assert snapsvc.checkpoint_files(tmp_path / "step2.fdl") == [
            str(tmp_path / n) for n in ("step2.fdl.meta", "step2.fdl.data", "step2.fdl")]
        w.submit({"model": nn.Linear(3, 2)}, "step2.fdl").result(timeout=60)
    assert sorted(os.listdir(tmp_path)) == ["step2.fdl", "step2.fdl.meta"]
    assert snapsvc.verify(tmp_path / "step2.fdl").ok


@leak_checked
def test_old_checkpoint_with_tensors_in_the_metadata_still_loads(tmp_path):
    """Before the data file, such tensors were InlineTensor nodes (kind 4) of the tree."""
    with snapsvc.SnapshotWriter(tmp_path) as w:
        w.submit({"model": nn.Linear(3, 2), "step": 3}, "old.fdl").result(timeout=60)
    path = tmp_path / "old.fdl"
    meta = read_meta(path)
    mask = _random(torch.bool, (4, 5))
    rng = torch.get_rng_state()
    state = dict(meta.state, mask=InlineTensor("bool", (4, 5), _bits(mask)),
                 rng=InlineTensor("uint8", tuple(rng.shape), _bits(rng)))
    commit(stage_meta(path, dataclasses.replace(meta, state=state)))
    back = snapsvc.load(path)
    assert torch.equal(back["mask"], mask) and torch.equal(back["rng"], rng)
    target = {"mask": torch.zeros(4, 5, dtype=torch.bool), "rng": torch.zeros_like(rng)}
    snapsvc.restore(path, target)
    assert torch.equal(target["mask"], mask) and torch.equal(target["rng"], rng)
    assert snapsvc.verify(path).ok


def test_remote_tier_uploads_fetches_checks_and_rotates_the_data_file(tmp_path, s3):
    with snapsvc.SnapshotWriter(tmp_path, remote=s3.url, remote_keep_last=1) as w:
        for i in (1, 2):
            w.submit(_state(i), f"step{i}.fdl").uploaded(timeout=60)
    assert sorted(s3.keys()) == ["step2.fdl", "step2.fdl.data", "step2.fdl.meta"]
    url = f"{s3.url}/step2.fdl"
    assert _bits(snapsvc.load(url)["mask"]) == _bits(_state(2)["mask"])
    good = s3.read("step2.fdl.data")
    bad = bytearray(good)
    bad[-2] ^= 0x10
    s3.write("step2.fdl.data", bytes(bad))
    target = _state(3)
    with pytest.raises(snapsvc.FormatError, match=r"step2\.fdl\.data") as e:
        snapsvc.restore(url, target)
    assert s3.url in str(e.value) and _bits(target["mask"]) == _bits(_state(3)["mask"])
    assert not snapsvc.verify(url).ok


@leak_checked
def test_a_snapshot_with_a_bool_buffer_saves_and_loads_with_its_data_file(tmp_path):
    model = nn.Linear(3, 2)
    model.register_buffer("keep", _random(torch.bool, (5,)))
    snap = snapsvc.snapshot_cpu(model)
    snap.save_file(tmp_path / "snap.fdl")
    back = snapsvc.load_snapshot(tmp_path / "snap.fdl")
    assert torch.equal(back.buffers["keep"], model.keep) and snapsvc.verify(tmp_path / "snap.fdl").ok


@leak_checked
def test_the_data_file_joins_the_all_or_nothing_commit(tmp_path):
    import commit_hooks
    target, flag = tmp_path / "s.fdl", tmp_path / commit_hooks.FLAG
    with snapsvc.SnapshotWriter(fault_hook=commit_hooks.fail_at) as w:
        w.submit(_state(0), target).result(timeout=60)
        before = {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)}
        for step in ("fsync:data", "rename:data", "rename:meta", "fsync:dir"):
            flag.write_text(step)
            with pytest.raises(snapsvc.WriteFailedError):
                w.submit(_state(1), target).result(timeout=60)
            flag.unlink()
            assert {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)} == before, step
            assert _bits(snapsvc.load(target)["mask"]) == _bits(_state(0)["mask"]), step


@leak_checked
@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_convert_keeps_the_data_file_in_formats_that_hold_its_dtypes(tmp_path, suffix):
    with snapsvc.SnapshotWriter(tmp_path) as w:
        w.submit(_state(), "s.fdl").result(timeout=60)
    out = tmp_path / f"s{suffix}"
    snapsvc.convert_file(tmp_path / "s.fdl", out)
    from snapsvc.files.convert import read_tensors
    got = dict(read_tensors(out).entries)
    assert _bits(got["mask"]) == _bits(_state()["mask"]) and got["q/w"].dtype == torch.int8
    assert "weight" in got
    snapsvc.convert_file(tmp_path / "s.fdl", tmp_path / "copy.fdl")  # .fdl: its own entries
    assert (tmp_path / "copy.fdl").read_bytes() == (tmp_path / "s.fdl").read_bytes()


def test_declared_lengths_of_a_data_file_are_bounded_before_anything_is_allocated(tmp_path):
    import struct
    import zlib
    from snapsvc.files.checkpoint import read_verified
    head = datafile.MAGIC + struct.pack("<I", datafile.VERSION) + bytes(32)
    entry = struct.pack("<I", 1) + b"m" + struct.pack("<Iq", 1, 1 << 40)  # 1 TiB of bool
    bombs = {"entry count": head + struct.pack("<I", 0xFFFFFFFF),
             "declares": head + struct.pack("<I", 1) + entry + struct.pack("<BQ", 1, 1 << 40),
             "unknown dtype tag": head + struct.pack("<I", 1) + entry[:-8]
             + struct.pack("<qBQ", 1, 99, 1),
             "unsupported data file version": datafile.MAGIC + struct.pack("<I", 7) + bytes(36),
             "bad magic": fdl.MAGIC + struct.pack("<I", 2) + bytes(36)}
    for what, raw in bombs.items():
        path = tmp_path / "x.fdl.data"
        path.write_bytes(raw)
        with pytest.raises(snapsvc.FormatError, match=what) as e:
            read_verified(path, len(raw), zlib.crc32(raw), framing=datafile.DATA)
        assert e.value.path == str(path) and e.value.offset is not None, what


class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.register_buffer("mask", torch.tensor([True, False, True, True, False, True]))


_MASK = bytes([1, 0, 1, 1, 0, 1])


def _bad_bool_file(tmp_path, kind: str) -> tuple[str, str, int | None]:
    """A file whose bool entry "mask" holds 0x02 at byte 1, every CRC valid; (path to
    read, the file the error must name, the bad byte's offset there or None)."""
    if kind in ("data file (load)", "data file (restore)"):
        path = os.fspath(tmp_path / "m.fdl")
        snapsvc.snapshot_cpu(_Masked()).save_file(path)
        raw = bytearray(open(data_path(path), "rb").read())
        at = raw.index(_MASK) + 1
        raw[at] = 2
        with open(data_path(path), "wb") as f:
            f.write(raw)
        meta = read_meta(path)
        data = dict(meta.data, crc32=zlib.crc32(raw))
        commit(stage_meta(path, dataclasses.replace(meta, data=data)))
        return path, data_path(path), at
    if kind == "metadata (inline, old format)":
        path = os.fspath(tmp_path / "old.fdl")
        state = {"mask": InlineTensor("bool", (2,), b"\x02\xff")}
        write_with_meta(path, [], Meta(state=state))
        return path, path + ".meta", None
    mask = torch.tensor(list(_MASK), dtype=torch.uint8)
    mask[1] = 2
    if kind == ".safetensors":
        path = os.fspath(tmp_path / "m.safetensors")
        snapsvc.write_safetensors(path, [("mask", torch.ones(6, dtype=torch.bool))])
        raw = bytearray(open(path, "rb").read())
        at = len(raw) - 6 + 1
        raw[at] = 2
        open(path, "wb").write(raw)
        return path, path, at
    path = os.fspath(tmp_path / "m.pt")
    torch.save({"mask": mask.view(torch.bool)}, path)
    return path, path, None


_BOOL_READS = {
    "data file (load)": lambda p: snapsvc.load(p),
    "data file (restore)": lambda p: snapsvc.restore(p, _Masked()),
    "metadata (inline, old format)": lambda p: snapsvc.load(p),
    ".safetensors": lambda p: snapsvc.convert_file(p, p + ".fdl"),
    ".pt": lambda p: snapsvc.convert_file(p, p + ".fdl"),
}


@pytest.mark.parametrize("kind", list(_BOOL_READS))
def test_a_bool_byte_other_than_0_and_1_is_a_format_error_on_every_read_path(tmp_path, kind):
    """Issue 30 item 3: torch hands out a bool tensor holding 0x02; every reader refuses it,
    naming the file, the entry and (where the file has one) the offset."""
    path, named, offset = _bad_bool_file(tmp_path, kind)
    with pytest.raises(snapsvc.FormatError) as info:
        _BOOL_READS[kind](path)
    e = info.value
    assert isinstance(e, ValueError) and "0x02" in e.reason and "other than 0 and 1" in e.reason
    assert e.path == named and e.offset == offset
    assert e.entry in ("mask", "state['mask']")
    assert not os.path.exists(path + ".fdl")


@leak_checked
def test_an_overwrite_leaves_no_companion_file_of_the_previous_checkpoint(tmp_path, capsys):
    """Issue 30 item 8: with or without an optimizer, with or without a data file, through
    the sidecar or a local save_file: only the new checkpoint's files stay, and
    `snapsvc verify dir/*` passes. A name that is a checkpoint of its own stays."""
    from snapsvc.cli import main
    path = tmp_path / "c.fdl"
    plain, masked = nn.Linear(2, 2), _Masked()
    opt = torch.optim.Adam(masked.parameters())
    masked.fc(torch.ones(1, 2)).sum().backward()
    opt.step()
    every = ["c.fdl.meta", "c.optim.fdl", "c.fdl.data", "c.fdl"]

    def check(want: list[str]) -> None:  # dir/*: the hidden names of old data go just after
        assert sorted(n for n in os.listdir(tmp_path) if n[0] != ".") == sorted(want)
        assert snapsvc.checkpoint_files(path) == [str(tmp_path / n) for n in every if n in want]
        assert main(["verify", *sorted(str(tmp_path / n) for n in want)]) == 0
        capsys.readouterr()

    with snapsvc.SnapshotWriter(tmp_path) as w:
        w.submit(masked, "c.fdl", optimizer=opt).result(timeout=60)
        check(every)
        w.submit(plain, "c.fdl").result(timeout=60)
        check(["c.fdl.meta", "c.fdl"])
        w.submit(masked, "c.fdl", optimizer=opt).result(timeout=60)
        w.submit(masked, "c.fdl").result(timeout=60)  # the data file stays, the optimizer's goes
        check(["c.fdl.meta", "c.fdl.data", "c.fdl"])
        w.submit(masked, "c.fdl", optimizer=opt).result(timeout=60)
    snapsvc.snapshot_cpu(plain).save_file(path)  # a local write
    check(["c.fdl.meta", "c.fdl"])
    snapsvc.snapshot_cpu(plain).save_file(tmp_path / "c.optim.fdl")  # a checkpoint of its own
    snapsvc.snapshot_cpu(masked).save_file(path)
    assert sorted(n for n in os.listdir(tmp_path) if n[0] != ".") == [
        "c.fdl", "c.fdl.data", "c.fdl.meta", "c.optim.fdl", "c.optim.fdl.meta"]
    assert snapsvc.verify(tmp_path / "c.optim.fdl").ok and snapsvc.verify(path).ok


def test_a_remote_overwrite_leaves_no_companion_of_the_previous_copy(tmp_path, s3):
    """Issue 30 item 8, the remote tier: the remote copy matches the local one."""
    masked = _Masked()
    opt = torch.optim.Adam(masked.parameters())
    masked.fc(torch.ones(1, 2)).sum().backward()
    opt.step()
    with snapsvc.SnapshotWriter(tmp_path, remote=s3.url) as w:
        w.submit(masked, "c.fdl", optimizer=opt).uploaded(timeout=60)
        assert sorted(s3.keys()) == ["c.fdl", "c.fdl.data", "c.fdl.meta", "c.optim.fdl"]
        w.submit(nn.Linear(2, 2), "c.fdl").uploaded(timeout=60)
    assert sorted(s3.keys()) == ["c.fdl", "c.fdl.meta"]
    assert list(snapsvc.load(f"{s3.url}/c.fdl")) == ["model"]

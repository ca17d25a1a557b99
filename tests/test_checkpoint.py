"""The public checkpoint API: save, load, read, keys, version, migrate, hash."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import snapsvc
from snapsvc.format import fdl
from snapsvc.files.durable import TMP_SUFFIX
from conftest import Net


def state(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items()}


def assert_same(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


EXPECTED_NAMES = ["encoder.weight", "encoder.bias", "norm.weight", "norm.bias", "head.weight",
                  "head.bias", "norm.running_mean", "norm.running_var", "norm.num_batches_tracked"]


@pytest.mark.parametrize("suffix", [".fdl", ".fdl.gz"])
def test_module_roundtrip_bit_exact(tmp_path, net, suffix):
    path = tmp_path / f"m{suffix}"
    snapsvc.save_checkpoint(path, net)
    assert snapsvc.checkpoint_keys(path) == EXPECTED_NAMES  # params, then persistent buffers
    fresh = Net()
    report = snapsvc.load_checkpoint(path, fresh)
    assert report.loaded == EXPECTED_NAMES and report.skipped == [] and report.missing == []
    assert_same(state(fresh), state(net))
    assert snapsvc.read_checkpoint(path).structural_hash == snapsvc.structural_hash(net)


def test_mapping_and_pairs_keep_given_order(tmp_path):
    params = {"z": torch.ones(2), "a": torch.zeros(3)}
    buffers = [("m", torch.tensor(5)), ("b", torch.ones(1, dtype=torch.float64))]
    snapsvc.save_checkpoint(tmp_path / "x.fdl", params, buffers)
    ckpt = snapsvc.read_checkpoint(tmp_path / "x.fdl")
    assert list(ckpt.entries) == ["z", "a", "m", "b"]
    assert ckpt.structural_hash is None and ckpt.version == 2


@pytest.mark.parametrize("given", ["ab" * 32, bytes.fromhex("ab" * 32)])
def test_structural_hash_argument_forms(given):
    buf = io.BytesIO()
    snapsvc.save_checkpoint(buf, {"w": torch.zeros(1)}, structural_hash=given)
    assert buf.getvalue()[8:40] == bytes.fromhex("ab" * 32)
    assert snapsvc.read_checkpoint(io.BytesIO(buf.getvalue())).structural_hash == "ab" * 32


@pytest.mark.parametrize("bad", ["abc", "zz" * 32, b"\0" * 31])
def test_bad_structural_hash_argument(bad):
    with pytest.raises(ValueError, match="structural_hash"):
        snapsvc.save_checkpoint(io.BytesIO(), {"w": torch.zeros(1)}, structural_hash=bad)


def test_gzip_is_one_standard_member(tmp_path, net):
    snapsvc.save_checkpoint(tmp_path / "a.fdl", net)
    snapsvc.save_checkpoint(tmp_path / "a.fdl.gz", net)
    plain = (tmp_path / "a.fdl").read_bytes()
    packed = (tmp_path / "a.fdl.gz").read_bytes()
    assert gzip.decompress(packed) == plain
    # A single member: the stdlib decompressor consumes the whole file in one member.
    d = __import__("zlib").decompressobj(wbits=31)
    assert d.decompress(packed) == plain and d.eof and d.unused_data == b""
    assert subprocess.run(["gzip", "-t", str(tmp_path / "a.fdl.gz")]).returncode == 0


def test_gzip_bytes_are_deterministic(tmp_path, net):
    snapsvc.save_checkpoint(tmp_path / "a.fdl.gz", net)
    snapsvc.save_checkpoint(tmp_path / "b.fdl.gz", net)
    assert (tmp_path / "a.fdl.gz").read_bytes() == (tmp_path / "b.fdl.gz").read_bytes()


def test_misnamed_gzip_still_loads(tmp_path, net):
    snapsvc.save_checkpoint(tmp_path / "a.fdl.gz", net)
    os.rename(tmp_path / "a.fdl.gz", tmp_path / "misnamed.fdl")
    fresh = Net()
    snapsvc.load_checkpoint(tmp_path / "misnamed.fdl", fresh)
    assert_same(state(fresh), state(net))
    with open(tmp_path / "misnamed.fdl", "rb") as f:  # and as a file object
        assert snapsvc.checkpoint_keys(f) == EXPECTED_NAMES


def test_file_object_destination_and_source(net):
    buf = io.BytesIO()
    snapsvc.save_checkpoint(buf, net)
    assert buf.getvalue()[:4] == b"FDLC"
    buf.seek(0)
    fresh = Net()
    snapsvc.load_checkpoint(buf, fresh)
    assert_same(state(fresh), state(net))


def test_path_write_is_atomic_and_fsynced(tmp_path, net, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")),
                                                 real_fsync(fd)))
    snapsvc.save_checkpoint(tmp_path / "m.fdl", net)
    assert len(synced) == 2
    assert synced[0].startswith(str(tmp_path / ".m.fdl.")) and synced[0].endswith(TMP_SUFFIX)
    assert synced[1] == str(tmp_path)  # the directory, after the rename
    assert os.listdir(tmp_path) == ["m.fdl"]


def test_refused_dtype_leaves_previous_file_and_no_temp(tmp_path):
    path = tmp_path / "m.fdl"
    snapsvc.save_checkpoint(path, {"w": torch.ones(2)})
    before = path.read_bytes()
    with pytest.raises(snapsvc.EncodeError, match="'mask'.*supported dtypes"):
        snapsvc.save_checkpoint(path, {"w": torch.zeros(2), "mask": torch.zeros(2, dtype=torch.bool)})
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["m.fdl"]


def test_load_converts_dtype_and_copies_in_place(tmp_path, net):
    doubled = {k: v.double() if v.is_floating_point() else v for k, v in state(net).items()}
    snapsvc.save_checkpoint(tmp_path / "d.fdl", doubled)
    fresh = Net()
    opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
    ptrs = {n: p.data_ptr() for n, p in fresh.named_parameters()}
    snapsvc.load_checkpoint(tmp_path / "d.fdl", fresh)
    assert_same(state(fresh), state(net))  # float32 again, values exact
    assert {n: p.data_ptr() for n, p in fresh.named_parameters()} == ptrs
    assert opt.param_groups[0]["params"][0] is fresh.encoder.weight


def test_load_report_skipped_missing_and_strict(tmp_path, net):
    snapsvc.save_checkpoint(tmp_path / "p.fdl", {"encoder.weight": net.encoder.weight,
                                                 "extra.thing": torch.zeros(1)})
    fresh = Net()
    before = state(fresh)
    with pytest.raises(snapsvc.StrictLoadError, match="extra.thing") as ei:
        snapsvc.load_checkpoint(tmp_path / "p.fdl", fresh, strict=True)
    assert str(tmp_path / "p.fdl") in str(ei.value)
    assert_same(state(fresh), before)  # nothing copied on refusal
    report = snapsvc.load_checkpoint(tmp_path / "p.fdl", fresh)
    assert report.loaded == ["encoder.weight"] and report.skipped == ["extra.thing"]
    assert report.missing == EXPECTED_NAMES[1:]
    assert torch.equal(fresh.encoder.weight, net.encoder.weight)


def test_shape_mismatch_is_an_error_and_model_untouched(tmp_path, net):
    snapsvc.save_checkpoint(tmp_path / "s.fdl", {**state(net), "head.bias": torch.zeros(3)})
    fresh = Net()
    before = state(fresh)
    with pytest.raises(snapsvc.ShapeMismatchError) as ei:
        snapsvc.load_checkpoint(tmp_path / "s.fdl", fresh)
    assert "'head.bias'" in str(ei.value) and "[3]" in str(ei.value) and "[2]" in str(ei.value)
    assert_same(state(fresh), before)


def test_architecture_mismatch(tmp_path, net):
    snapsvc.save_checkpoint(tmp_path / "h.fdl", net)
    other = Net(hidden=5)
    with pytest.raises(snapsvc.ArchitectureMismatchError, match="architecture mismatch") as ei:
        snapsvc.load_checkpoint(tmp_path / "h.fdl", other)
    assert snapsvc.structural_hash(net) in str(ei.value)
    assert snapsvc.structural_hash(other) in str(ei.value)
    # A zero hash on either side skips the check (then the shapes speak).
    with pytest.raises(snapsvc.ShapeMismatchError):
        snapsvc.load_checkpoint(tmp_path / "h.fdl", other, structural_hash="00" * 32)


def test_hash_check_uses_given_hash(tmp_path, net):
    snapsvc.save_checkpoint(tmp_path / "h.fdl", net, structural_hash="11" * 32)
    with pytest.raises(snapsvc.ArchitectureMismatchError):
        snapsvc.load_checkpoint(tmp_path / "h.fdl", Net())
    snapsvc.load_checkpoint(tmp_path / "h.fdl", Net(), structural_hash="11" * 32)


def test_structural_hash_is_the_documented_text():
    text = ("snapsvc-structural-hash-v1\n"
            "param\tweight\tfloat32\t3,2\n"
            "param\tbias\tfloat32\t3\n")
    torch.manual_seed(1)
    assert snapsvc.structural_hash(nn.Linear(2, 3)) == hashlib.sha256(text.encode()).hexdigest()


def test_structural_hash_covers_buffers_not_values(net):
    h = snapsvc.structural_hash(net)
    with torch.no_grad():
        net.encoder.weight.add_(1)
    assert snapsvc.structural_hash(net) == h
    assert snapsvc.structural_hash(Net(hidden=5)) != h
    net.norm.running_mean = torch.zeros(4, dtype=torch.float64)
    assert snapsvc.structural_hash(net) != h


@pytest.mark.timeout(120)
def test_structural_hash_stable_across_processes(net):
    code = ("import sys; sys.path.insert(0, 'tests'); import torch, snapsvc; from conftest import Net;"
            "print(snapsvc.structural_hash(Net()))")
    hashes = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True, env={**os.environ, "PYTHONHASHSEED": str(seed)}
                             ).stdout.strip() for seed in (1, 2)}
    assert hashes == {snapsvc.structural_hash(net)}


def test_keys_seek_past_data(tmp_path):
    big = {f"t{i}": torch.zeros(1 << 18) for i in range(8)}  # 8 MiB of data
    snapsvc.save_checkpoint(tmp_path / "k.fdl", big)

    class Counting(io.FileIO):
        read_bytes = 0

        def read(self, n=-1):
            out = super().read(n)
            Counting.read_bytes += len(out)
            return out

        def readinto(self, b):
            n = super().readinto(b)
            Counting.read_bytes += n
            return n

    with Counting(tmp_path / "k.fdl", "rb") as f:
        assert snapsvc.checkpoint_keys(f) == list(big)
    assert Counting.read_bytes < 1024


def test_checkpoint_version(tmp_path, net):
    snapsvc.save_checkpoint(tmp_path / "v.fdl.gz", net)
    assert snapsvc.checkpoint_version(tmp_path / "v.fdl.gz") == fdl.VERSION == 2


class Renamed(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(3, 4)                  # was encoder.*
        self.norm = nn.BatchNorm1d(4)               # unchanged names
        self.out = nn.Linear(4, 2)                  # was head.*
        self.new_gate = nn.Parameter(torch.zeros(7))  # nothing in the file fits


def test_migrate_renamed_model(tmp_path, net):
    snapsvc.save_checkpoint(tmp_path / "old.fdl", {**state(net), "orphan": torch.zeros(9)})
    report = snapsvc.migrate_checkpoint(tmp_path / "old.fdl", tmp_path / "new.fdl", Renamed())
    assert report.unchanged == ["norm.weight", "norm.bias", "norm.running_mean",
                                "norm.running_var", "norm.num_batches_tracked"]
    assert report.remapped == [("encoder.weight", "enc.weight"), ("encoder.bias", "enc.bias"),
                               ("head.weight", "out.weight"), ("head.bias", "out.bias")]
    assert report.dropped == ["orphan"] and report.missing == ["new_gate"]
    assert not report.is_complete()
    text = str(report)
    assert "4 remapped" in text and "encoder.weight -> enc.weight" in text and "new_gate" in text
    new = snapsvc.read_checkpoint(tmp_path / "new.fdl")
    assert new.structural_hash is None
    assert list(new.entries) == ["enc.weight", "enc.bias", "norm.weight", "norm.bias",
                                 "out.weight", "out.bias", "norm.running_mean",
                                 "norm.running_var", "norm.num_batches_tracked"]
    target = Renamed()
    snapsvc.load_checkpoint(tmp_path / "new.fdl", target)
    assert torch.equal(target.enc.weight, net.encoder.weight)
    assert torch.equal(target.out.bias, net.head.bias)


def test_migrate_same_model_is_complete(tmp_path, net):
    snapsvc.save_checkpoint(tmp_path / "a.fdl", net)
    report = snapsvc.migrate_checkpoint(tmp_path / "a.fdl", tmp_path / "b.fdl", Net())
    assert report.is_complete() and report.unchanged == EXPECTED_NAMES and not report.remapped
    assert "(complete)" in str(report)


def test_migrate_remap_needs_same_dtype(tmp_path):
    snapsvc.save_checkpoint(tmp_path / "a.fdl", {"old": torch.zeros(3, dtype=torch.float64)})

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.new = nn.Parameter(torch.zeros(3))

    report = snapsvc.migrate_checkpoint(tmp_path / "a.fdl", tmp_path / "b.fdl", M())
    assert report.remapped == [] and report.dropped == ["old"] and report.missing == ["new"]

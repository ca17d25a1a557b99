"""The ``snapsvc`` command line and the conversions behind it (snapsvc.files.convert).

Commands run in-process through ``snapsvc.cli.main`` (output captured with
capsys); one test runs ``python -m snapsvc`` as a subprocess. Hostile
``.safetensors`` files are built by hand with ``struct`` and ``json`` from the
format's description, never with snapsvc's writer.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import logging
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import snapsvc
from snapsvc import EncodeError, FormatError, cli
from snapsvc.files import convert as conv
from snapsvc.files import safetensors as safetensors_mod
from snapsvc.files.checkpoint import model_tensors
from snapsvc.cli import files as cli_files
from snapsvc.cli import main

TESTS = Path(__file__).parent
pytestmark = pytest.mark.timeout(60)

FDL_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64]
NON_FDL_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16]


@pytest.fixture(autouse=True)
def _restore_log_level():
    logger = logging.getLogger("snapsvc")
    level = logger.level
    yield
    logger.setLevel(level)


def run(capsys, *argv: str | os.PathLike[str]) -> tuple[int, str, str]:
    code = main([os.fspath(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(err: str, *fragments: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("snapsvc: error: "), err
    assert "Traceback" not in err
    for f in fragments:
        assert f in lines[0], (f, err)


def raw_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())


def assert_bit_exact(got: list[tuple[str, torch.Tensor]], want: list[tuple[str, torch.Tensor]]):
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, a), (_, b) in zip(got, want):
        assert a.dtype == b.dtype, name
        assert a.shape == b.shape, name
        assert raw_bytes(a) == raw_bytes(b), name


def no_temps(directory: Path) -> None:
    assert not [p.name for p in directory.iterdir() if p.name.endswith(".snapsvc-tmp")]


def special_values(dtype: torch.dtype, n: int = 6) -> torch.Tensor:
    """Values that a lossy round trip would change: NaN, -0.0, inf, extremes."""
    if dtype.is_floating_point:
        base = torch.tensor([math.nan, -0.0, math.inf, -math.inf, 1.5, -2.25])
        return base[:n].to(dtype)
    info = torch.iinfo(dtype)
    return torch.tensor([info.min, info.max, 0, -1, 1, 7][:n], dtype=torch.int64).to(dtype)


def all_dtype_entries(dtypes=FDL_DTYPES) -> list[tuple[str, torch.Tensor]]:
    """Every dtype in several shapes: scalar, empty, 3-d, and special values."""
    torch.manual_seed(0)
    out = []
    for d in dtypes:
        name = str(d).removeprefix("torch.")
        if d is torch.bool:
            out.append((f"{name}.values", torch.tensor([True, False, True])))
        else:
            out.append((f"{name}.values", special_values(d)))
        out.append((f"{name}.scalar", torch.ones((), dtype=torch.float64).to(d)))
        out.append((f"{name}.empty", torch.zeros(0, 3, dtype=d)))
        out.append((f"{name}.cube", (torch.rand(2, 3, 4) * 100).to(d)))
    return out


def read_any(path: Path) -> list[tuple[str, torch.Tensor]]:
    return conv.read_tensors(path).entries


# ----------------------------------------------------------------------------------
# version, help, usage errors
# ----------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_python_m_snapsvc_version_matches_package():
    proc = subprocess.run([sys.executable, "-m", "snapsvc", "--version"], capture_output=True,
                          text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"snapsvc {snapsvc.__version__}"


def test_version_in_process(capsys):
    code, out, _ = run(capsys, "--version")
    assert (code, out.strip()) == (0, f"snapsvc {snapsvc.__version__}")


def test_help_lists_commands_and_exit_codes(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0
    for name in ("inspect", "verify", "convert", "migrate"):
        assert name in out
    assert "exit codes" in out and "3  migrate" in out


def test_migrate_help_documents_exit_codes(capsys):
    code, out, _ = run(capsys, "migrate", "--help")
    assert code == 0
    assert "0 complete, 3 incomplete" in out


@pytest.mark.parametrize("argv, fragment", [
    ([], "a command is required"),
    (["frobnicate"], "invalid choice"),
    (["inspect"], "required: FILE"),
    (["verify"], "required: FILE"),
    (["convert", "a.fdl"], "required: DST"),
    (["convert", "a.fdl", "b.txt"], "unknown file type"),
    (["convert", "a.npz", "b.fdl"], "unknown file type"),
    (["migrate", "a.fdl", "b.fdl"], "--model"),
    (["migrate", "a.fdl", "b.fdl", "--model", "no_colon"], "MODULE:FACTORY"),
    (["migrate", "a.safetensors", "b.fdl", "--model", "m:f"], "convert' first"),
    (["inspect", "x.fdl", "--bogus"], "unrecognized arguments"),
])
def test_usage_errors_exit_2_with_one_line(capsys, argv, fragment):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert_one_line_error(err, fragment)


def test_registry_accepts_new_commands(capsys):
    def arguments(p):
        p.add_argument("--name", default="world")

    @cli.register("hello-test", help="say hello", arguments=arguments)
    def hello(args):
        print(f"hello {args.name}")
        return 0

    try:
        with pytest.raises(ValueError, match="already registered"):
            cli.register("hello-test", help="again")(hello)
        assert run(capsys, "hello-test", "--name", "fdl")[:2] == (0, "hello fdl\n")
        assert "hello-test" in run(capsys, "--help")[1]
    finally:
        cli.COMMANDS.pop("hello-test")


# ----------------------------------------------------------------------------------
# inspect
# ----------------------------------------------------------------------------------
class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(3, 4)
        self.norm = nn.BatchNorm1d(4)


@pytest.fixture
def small() -> Small:
    torch.manual_seed(0)
    m = Small()
    m.norm.num_batches_tracked.fill_(5)
    return m


@pytest.fixture(params=["plain", "gzip"])
def ckpt_path(request, tmp_path) -> Path:
    return tmp_path / ("model.fdl" if request.param == "plain" else "model.fdl.gz")


def expected_rows(model: nn.Module) -> list[tuple[str, str, list[int], int]]:
    return [(n, str(t.dtype).removeprefix("torch."), list(t.shape), t.numel() * t.element_size())
            for n, t in model_tensors(model)]


@pytest.mark.parametrize("with_meta", [True, False], ids=["meta", "no-meta"])
def test_inspect_json(capsys, small, ckpt_path, with_meta):
    if with_meta:
        snapsvc.snapshot_cpu(small, metrics={"loss": 0.5, "acc": 0.75}, epoch=4).save_file(ckpt_path)
    else:
        snapsvc.save_checkpoint(ckpt_path, small)
    code, out, err = run(capsys, "inspect", "--json", ckpt_path)
    assert (code, err) == (0, "")
    doc = json.loads(out)
    assert out.count("\n") == 1  # one JSON object, one line
    assert doc["format"] == "fdl" and doc["version"] == 2
    assert doc["gzip"] is ckpt_path.name.endswith(".gz")
    assert doc["file_bytes"] == ckpt_path.stat().st_size
    assert [(e["name"], e["dtype"], e["shape"], e["bytes"]) for e in doc["entries"]] \
        == expected_rows(small)
    assert doc["tensor_bytes"] == sum(e["bytes"] for e in doc["entries"])
    if with_meta:
        meta = snapsvc.files.meta.read_meta(ckpt_path)
        m = doc["meta"]
        assert m["epoch"] == 4 and m["metrics"] == {"loss": 0.5, "acc": 0.75}
        assert m["buffers"] == 3 and m["size"] == ckpt_path.stat().st_size
        assert m["crc32"] == f"{meta.crc32:08x}"
        created = dt.datetime.fromisoformat(m["created"])
        assert abs(created.timestamp() - meta.created) < 1
        assert doc["structural_hash"] is None  # snapshots are written with a zero hash
    else:
        assert doc["meta"] is None and doc["meta_error"] is None
        assert doc["structural_hash"] == snapsvc.structural_hash(small)


@pytest.mark.parametrize("with_meta", [True, False], ids=["meta", "no-meta"])
def strict_json(text: str) -> object:
    def refuse(token: str):
        raise AssertionError(f"not strict JSON: {token}")
    return json.loads(text, parse_constant=refuse)


def test_inspect_json_is_strict_with_non_finite_metrics(capsys, small, tmp_path):
    path = tmp_path / "diverged.fdl"
    snapsvc.snapshot_cpu(small, metrics={"loss": math.nan, "best": math.inf, "worst": -math.inf,
                                         "lr": 0.5}).save_file(path)
    code, out, _ = run(capsys, "inspect", "--json", path)
    assert code == 0
    assert strict_json(out)["meta"]["metrics"] == {"loss": "NaN", "best": "Infinity",
                                                   "worst": "-Infinity", "lr": 0.5}
    assert [float(v) for v in strict_json(out)["meta"]["metrics"].values()][1:] == \
        [math.inf, -math.inf, 0.5]  # the strings read back as the numbers they stand for
    assert "NaN" in run(capsys, "inspect", "--help")[1]  # documented


@pytest.mark.parametrize("with_meta", [True, False], ids=["meta", "no-meta"])
def test_inspect_text(capsys, small, ckpt_path, with_meta):
    if with_meta:
        snapsvc.snapshot_cpu(small, metrics={"loss": 0.5}, epoch=4).save_file(ckpt_path)
    else:
        snapsvc.save_checkpoint(ckpt_path, small)
    code, out, err = run(capsys, "inspect", ckpt_path)
    assert (code, err) == (0, "")
    assert "version:         2" in out
    hash_line = "none (all zeros)" if with_meta else snapsvc.structural_hash(small)
    assert f"structural hash: {hash_line}" in out
    table = out.splitlines()
    for name, dtype, shape, nbytes in expected_rows(small):
        row = next(ln for ln in table if ln.split() and ln.split()[0] == name)
        assert dtype in row and "[" + ", ".join(map(str, shape)) + "]" in row
        assert row.rstrip().endswith(str(nbytes))
    if with_meta:
        assert "epoch:    4" in out and "loss=0.5" in out and "buffers:  3" in out
        crc = snapsvc.files.meta.read_meta(ckpt_path).crc32
        assert f"crc32:    {crc:08x}" in out
        created = next(ln for ln in table if "created:" in ln).split("created:")[1].strip()
        dt.datetime.fromisoformat(created)
    else:
        assert "metadata:        none" in out


def test_inspect_reads_no_tensor_data(capsys, small, tmp_path, monkeypatch):
    path = tmp_path / "m.fdl"
    snapsvc.save_checkpoint(path, small)

    def refuse(*a, **k):
        raise AssertionError("inspect loaded tensor data")

    monkeypatch.setattr(snapsvc.format.fdl.Decoder, "_read_data", refuse)
    assert run(capsys, "inspect", path)[0] == 0


def test_inspect_invalid_metadata_is_reported(capsys, small, tmp_path):
    path = tmp_path / "m.fdl"
    snapsvc.save_checkpoint(path, small)
    Path(str(path) + ".meta").write_bytes(b"\xc1 not msgpack")
    code, out, _ = run(capsys, "inspect", "--json", path)
    doc = json.loads(out)
    assert code == 0 and doc["meta"] is None and "msgpack" in doc["meta_error"]
    code, out, _ = run(capsys, "inspect", path)
    assert "metadata:        invalid:" in out


def test_inspect_safetensors_by_header(capsys, tmp_path):
    path = tmp_path / "w.safetensors"
    conv.write_safetensors(path, [("a", torch.ones(2, 3)), ("b", torch.zeros(4, dtype=torch.bool))],
                           metadata={"note": "hi"})
    code, out, _ = run(capsys, "inspect", "--json", path)
    doc = json.loads(out)
    assert code == 0 and doc["format"] == "safetensors"
    assert [(e["name"], e["dtype"], e["shape"], e["bytes"]) for e in doc["entries"]] == [
        ("a", "float32", [2, 3], 24), ("b", "bool", [4], 4)]
    assert doc["safetensors_metadata"] == {"format": "pt", "note": "hi"}


def test_inspect_escapes_control_characters_in_names(capsys, tmp_path):
    path = tmp_path / "odd.fdl"
    snapsvc.save_checkpoint(path, {"evil\x1b[2Jname\n": torch.ones(1)})
    out = run(capsys, "inspect", path)[1]
    assert "\x1b[2J" not in out and "'evil\\x1b[2Jname\\n'" in out


# ----------------------------------------------------------------------------------
# verify
# ----------------------------------------------------------------------------------
def test_verify_good_files(capsys, small, tmp_path):
    paths = [tmp_path / "a.fdl", tmp_path / "b.fdl.gz"]
    for p in paths:
        snapsvc.snapshot_cpu(small).save_file(p)
    code, out, err = run(capsys, "verify", *paths)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert [ln.split(":")[0] for ln in lines[:2]] == [str(p) for p in paths]
    assert all(": OK (" in ln for ln in lines[:2])
    assert lines[2] == "2 of 2 files OK"


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, fragment", [
    (lambda p: flip_byte(p, p.stat().st_size - 3), "crc32"),           # in tensor data
    (lambda p: flip_byte(p, 1), "bad magic"),
    (lambda p: p.write_bytes(p.read_bytes()[:-10]), "metadata says 4"),
    (lambda p: os.unlink(str(p) + ".meta"), "no metadata file"),
], ids=["data-byte", "magic", "truncated", "no-meta"])
def test_verify_corrupt_file_fails_naming_the_problem(capsys, small, tmp_path, damage, fragment):
    good, bad = tmp_path / "good.fdl", tmp_path / "bad.fdl"
    for p in (good, bad):
        snapsvc.snapshot_cpu(small).save_file(p)
    damage(bad)
    code, out, err = run(capsys, "verify", good, bad)
    assert code == 1 and err == ""
    assert f"{good}: OK" in out
    problems = [ln for ln in out.splitlines() if str(bad) in ln]
    assert problems and any(fragment in ln for ln in problems), out
    assert out.splitlines()[-1] == "1 of 2 files OK, 1 failed"


def test_verify_no_meta_flag(capsys, small, tmp_path):
    path = tmp_path / "plain.fdl"
    snapsvc.save_checkpoint(path, small)
    assert run(capsys, "verify", path)[0] == 1
    code, out, _ = run(capsys, "verify", "--no-meta", path)
    assert code == 0 and out.startswith(f"{path}: OK")


@pytest.mark.parametrize("flags", [[], ["--no-meta"]], ids=["meta", "no-meta"])
def test_verify_missing_file_says_no_such_file(capsys, tmp_path, flags):
    absent = tmp_path / "absent.fdl"
    code, out, _ = run(capsys, "verify", *flags, absent)
    assert code == 1 and out == f"{absent}: no such file\n"
    assert snapsvc.verify(absent).problems == [f"{absent}: no such file"]


def test_verify_directory_is_named_as_such(capsys, tmp_path):
    code, out, _ = run(capsys, "verify", tmp_path)
    assert code == 1 and out == f"{tmp_path}: a directory, not a checkpoint file\n"


def checkpoint_dir(tmp_path: Path, small: nn.Module) -> Path:
    """A directory as the writer leaves it: model, optimizer file and metadata of two steps."""
    d = tmp_path / "ck"
    opt = torch.optim.Adam(small.parameters())
    for p in small.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # optimizer state to write
    with snapsvc.SnapshotWriter(d) as w:
        for step in (1, 2):
            w.submit(small, f"step{step}.fdl", optimizer=opt, metrics={"loss": 0.1}).result(60)
    assert sorted(os.listdir(d)) == ["step1.fdl", "step1.fdl.meta", "step1.optim.fdl",
                                     "step2.fdl", "step2.fdl.meta", "step2.optim.fdl"]
    return d


def glob(directory: Path, pattern: str) -> list[str]:
    return sorted(str(p) for p in directory.glob(pattern))


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("no_leaks")
def test_verify_covers_optimizer_and_meta_files(capsys, small, tmp_path):
    d = checkpoint_dir(tmp_path, small)
    for pattern, n in (("*.fdl", 4), ("*", 6)):
        code, out, err = run(capsys, "verify", *glob(d, pattern))
        assert (code, err) == (0, ""), out
        lines = out.splitlines()
        assert lines[-1] == f"{n} of {n} files OK"
        assert f"{d}/step1.optim.fdl: OK, checked as the optimizer file of {d}/step1.fdl" in lines
        if pattern == "*":
            assert f"{d}/step2.fdl.meta: OK, checked as the metadata of {d}/step2.fdl" in lines
    # given alone, a companion file is checked through its checkpoint
    code, out, _ = run(capsys, "verify", d / "step2.fdl.meta")
    assert (code, out) == (0, f"{d}/step2.fdl.meta: OK, checked as the metadata of {d}/step2.fdl\n")

    # a corrupt optimizer file fails its checkpoint and itself, the problem named once
    flip_byte(d / "step1.optim.fdl", (d / "step1.optim.fdl").stat().st_size - 3)
    code, out, _ = run(capsys, "verify", *glob(d, "*"))
    assert code == 1
    problems = [ln for ln in out.splitlines() if "metadata says" in ln]
    assert len(problems) == 1 and problems[0].startswith(f"{d}/step1.optim.fdl: crc32"), out
    assert f"{d}/step1.optim.fdl: FAILED, checked as the optimizer file of {d}/step1.fdl " \
           "(see its problems)" in out
    assert out.splitlines()[-1] == "3 of 6 files OK, 3 failed"
    # alone, the optimizer file shows its checkpoint's problems before its own line
    code, out, _ = run(capsys, "verify", d / "step1.optim.fdl")
    lines = out.splitlines()
    assert code == 1 and lines[0].startswith(f"{d}/step1.optim.fdl: crc32") and \
        lines[1].startswith(f"{d}/step1.optim.fdl: FAILED, checked as")


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("no_leaks")
def test_verify_leftover_optimizer_file_is_not_claimed_as_checked(capsys, small, tmp_path):
    """x.optim.fdl beside an x.fdl whose metadata names no optimizer file (rewritten
    without one) was not checked by x.fdl's verify: say so."""
    d = checkpoint_dir(tmp_path, small)
    snapsvc.snapshot_cpu(small).save_file(d / "step2.fdl")  # no optimizer this time
    code, out, _ = run(capsys, "verify", d / "step2.optim.fdl")
    assert code == 1 and out.startswith(f"{d}/step2.optim.fdl: FAILED: not the optimizer file "
                                        f"of {d}/step2.fdl (its metadata names none)")
    code, out, _ = run(capsys, "verify", "--no-meta", d / "step1.optim.fdl")
    assert code == 0 and "checked as the optimizer file" in out


def test_verify_orphan_optimizer_file_without_metadata(capsys, small, tmp_path):
    """--no-meta and no metadata beside the model: the optimizer file is checked on its own."""
    snapsvc.save_checkpoint(tmp_path / "m.fdl", small)
    snapsvc.save_checkpoint(tmp_path / "m.optim.fdl", {"w": torch.ones(2)})
    code, out, _ = run(capsys, "verify", "--no-meta", tmp_path / "m.optim.fdl")
    assert code == 0 and out.startswith(f"{tmp_path}/m.optim.fdl: OK (1 entries")
    code, out, _ = run(capsys, "verify", tmp_path / "m.optim.fdl")
    assert code == 1 and "no metadata file" in out and f"{tmp_path}/m.fdl.meta" in out


# ----------------------------------------------------------------------------------
# convert: round trips
# ----------------------------------------------------------------------------------
CHAINS = [
    ["fdl", "safetensors", "fdl"],
    ["fdl", "pt", "fdl"],
    ["fdl", "fdl.gz", "fdl"],
    ["fdl", "safetensors", "pt", "fdl.gz", "fdl"],
    ["fdl", "pt", "safetensors", "safetensors", "fdl.gz", "pt", "fdl"],
]


@pytest.mark.parametrize("chain", CHAINS, ids=["-".join(c) for c in CHAINS])
def test_convert_round_trip_bit_exact(capsys, tmp_path, chain):
    entries = all_dtype_entries()
    first = tmp_path / f"f0.{chain[0]}"
    snapsvc.save_checkpoint(first, entries)  # zero hash: the bytes must come back
    prev = first
    for i, kind in enumerate(chain[1:], 1):
        nxt = tmp_path / f"f{i}.{kind}"
        code, out, err = run(capsys, "convert", prev, nxt)
        assert (code, err) == (0, ""), err
        assert out.strip() == f"{prev} -> {nxt}: {len(entries)} entries, " \
            f"{cli.human_bytes(sum(t.numel() * t.element_size() for _, t in entries))} " \
            "of tensor data"
        assert_bit_exact(read_any(nxt), entries)
        prev = nxt
    assert prev.read_bytes() == first.read_bytes()
    no_temps(tmp_path)


@pytest.mark.parametrize("middle", ["safetensors", "fdl.gz"])
def test_structural_hash_survives_safetensors(capsys, small, tmp_path, middle):
    src, mid, back = tmp_path / "a.fdl", tmp_path / f"b.{middle}", tmp_path / "c.fdl"
    snapsvc.save_checkpoint(src, small)
    assert run(capsys, "convert", src, mid)[0] == 0
    assert run(capsys, "convert", mid, back)[0] == 0
    assert back.read_bytes() == src.read_bytes()
    assert snapsvc.read_checkpoint(back).structural_hash == snapsvc.structural_hash(small)


def test_non_fdl_dtypes_round_trip_between_safetensors_and_pt(capsys, tmp_path):
    entries = all_dtype_entries(FDL_DTYPES + NON_FDL_DTYPES)
    a, b, c = tmp_path / "a.safetensors", tmp_path / "b.pt", tmp_path / "c.safetensors"
    conv.write_safetensors(a, entries)
    assert run(capsys, "convert", a, b)[0] == 0
    assert run(capsys, "convert", b, c)[0] == 0
    assert_bit_exact(read_any(b), entries)
    assert_bit_exact(read_any(c), entries)
    assert c.read_bytes() == a.read_bytes()


def test_convert_overwrites_dst_atomically(capsys, tmp_path, small):
    src, dst = tmp_path / "a.fdl", tmp_path / "a.safetensors"
    snapsvc.save_checkpoint(src, small)
    dst.write_bytes(b"old contents")
    assert run(capsys, "convert", src, dst)[0] == 0
    assert [n for n, _ in read_any(dst)] == [n for n, _ in read_any(src)]


def test_pt_views_save_only_their_own_bytes(tmp_path):
    big = torch.arange(1 << 16, dtype=torch.float32)
    path = tmp_path / "v.pt"
    conv.write_state_dict(path, [("slice", big[:4])])
    assert path.stat().st_size < 16 << 10
    assert torch.equal(conv.read_state_dict(path)["slice"], big[:4])


def test_safetensors_writer_layout_by_hand(tmp_path):
    """Our files follow the spec: u64 length, '{'-started JSON padded to 8, tiled buffer."""
    path = tmp_path / "w.safetensors"
    entries = [("x", torch.arange(3, dtype=torch.int16)), ("y", torch.ones(2, 2)), ("z", torch.ones(0))]
    conv.write_safetensors(path, entries)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0 and raw[8:9] == b"{"
    header = json.loads(raw[8:8 + n])
    assert header.pop("__metadata__") == {"format": "pt"}
    assert header == {"x": {"dtype": "I16", "shape": [3], "data_offsets": [0, 6]},
                      "y": {"dtype": "F32", "shape": [2, 2], "data_offsets": [6, 22]},
                      "z": {"dtype": "F32", "shape": [0], "data_offsets": [22, 22]}}
    assert len(raw) == 8 + n + 22
    assert raw[8 + n:8 + n + 6] == struct.pack("<3h", 0, 1, 2)


def test_safetensors_interop_with_reference_library(tmp_path):
    reference = pytest.importorskip("safetensors.torch")
    entries = all_dtype_entries(FDL_DTYPES + NON_FDL_DTYPES)
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    conv.write_safetensors(ours, entries)
    assert_bit_exact(sorted(reference.load_file(ours).items()), sorted(entries))
    reference.save_file(dict(entries), theirs, metadata={"k": "v"})
    tf = conv.read_safetensors(theirs)
    assert_bit_exact(sorted(tf.entries), sorted(entries))
    assert tf.metadata == {"k": "v"}


# ----------------------------------------------------------------------------------
# convert: refusals
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", NON_FDL_DTYPES, ids=str)
@pytest.mark.parametrize("src_kind", ["safetensors", "pt"])
@pytest.mark.parametrize("dst_name", ["out.fdl", "out.fdl.gz"])
def test_dtype_fdl_lacks_is_refused_and_leaves_no_dst(capsys, tmp_path, dtype, src_kind, dst_name):
    src, dst = tmp_path / f"in.{src_kind}", tmp_path / dst_name
    entries = [("fine", torch.ones(3)), ("mask", torch.zeros(4, dtype=dtype))]
    if src_kind == "pt":
        torch.save(dict(entries), src)
    else:
        conv.write_safetensors(src, entries)
    code, out, err = run(capsys, "convert", src, dst)
    assert code == 1 and out == ""
    assert_one_line_error(err, "'mask'", str(dtype))
    assert not dst.exists()
    no_temps(tmp_path)
    with pytest.raises(EncodeError, match="'mask'"):
        conv.convert_file(src, dst)
    assert not dst.exists()


def test_refused_conversion_keeps_an_existing_dst(capsys, tmp_path):
    src, dst = tmp_path / "in.safetensors", tmp_path / "out.fdl"
    conv.write_safetensors(src, [("mask", torch.zeros(2, dtype=torch.bool))])
    dst.write_bytes(b"previous")
    assert run(capsys, "convert", src, dst)[0] == 1
    assert dst.read_bytes() == b"previous"


def test_unsupported_dtype_into_safetensors_names_the_entry(tmp_path):
    with pytest.raises(EncodeError, match="'c'.*complex64"):
        conv.write_safetensors(tmp_path / "c.safetensors", [("c", torch.zeros(2, dtype=torch.complex64))])
    with pytest.raises(EncodeError, match="reserved"):
        conv.write_safetensors(tmp_path / "c.safetensors", [("__metadata__", torch.zeros(2))])
    assert not list(tmp_path.iterdir())


# ----------------------------------------------------------------------------------
# hostile .safetensors
# ----------------------------------------------------------------------------------
def st_file(header: dict | bytes, data: bytes = b"", *, length: int | None = None,
            pad: bool = True) -> bytes:
    """A .safetensors file by hand: u64 header length, header, data."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    if pad:
        raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


F32x2 = struct.pack("<2f", 1.0, 2.0)

HOSTILE = {
    "too-short": (b"\x01\x02\x03", "too short", None),
    "length-beyond-file": (st_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
                                   F32x2, length=1 << 40), "exceeds the", None),
    "length-just-beyond": (st_file(b"{}", length=9), "exceeds the 8 bytes", None),
    "bad-json": (st_file(b'{"a": {"dtype": "F32", '), "not valid UTF-8 JSON", None),
    "bad-utf8": (st_file(b'{"\xff": 1}'), "not valid UTF-8 JSON", None),
    "not-an-object": (st_file(b"[1, 2]"), "must start with '{'", None),
    "nan-constant": (st_file(b'{"a": NaN}'), "not valid", None),
    "duplicate-key": (st_file(b'{"a": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]},'
                              b' "a": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}}'),
                      "duplicate key", None),
    "deep-nesting": (st_file(b"{" + b'"a":[' * 100000 + b"]" * 100000 + b"}"), "JSON", None),
    "info-not-object": (st_file({"a": [1, 2]}), "expected an object", "a"),
    "missing-field": (st_file({"a": {"dtype": "F32", "shape": [2]}}, F32x2), "lacks data_offsets",
                      "a"),
    "unknown-dtype": (st_file({"a": {"dtype": "F128", "shape": [2], "data_offsets": [0, 8]}},
                              F32x2), "unknown dtype 'F128'", "a"),
    "dtype-not-str": (st_file({"a": {"dtype": 3, "shape": [2], "data_offsets": [0, 8]}}, F32x2),
                      "unknown dtype 3", "a"),
    "negative-dim": (st_file({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}},
                             F32x2), "negative dimension", "a"),
    "shape-not-list": (st_file({"a": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}},
                               F32x2), "not a list of integers", "a"),
    "shape-float": (st_file({"a": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}},
                            F32x2), "not a list of integers", "a"),
    "shape-bool": (st_file({"a": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}},
                           F32x2[:4]), "not a list of integers", "a"),
    "huge-rank": (st_file({"a": {"dtype": "F32", "shape": [1] * 65, "data_offsets": [0, 4]}},
                          F32x2[:4]), "rank 65", "a"),
    "offsets-beyond-buffer": (st_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}},
                                      F32x2), "outside the 8-byte data buffer", "a"),
    "offsets-reversed": (st_file({"a": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}},
                                 F32x2), "outside", "a"),
    "offsets-negative": (st_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}},
                                 F32x2), "outside", "a"),
    "offsets-three": (st_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4, 8]}},
                              F32x2), "two integers", "a"),
    "offsets-vs-shape": (st_file({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
                                 F32x2), "needs 12", "a"),
    "huge-shape": (st_file({"a": {"dtype": "F32", "shape": [1 << 62, 1 << 62],
                                  "data_offsets": [0, 8]}}, F32x2), "overflows", "a"),
    "overlap": (st_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                         "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, F32x2),
                "overlaps 'a'", "b"),
    "gap": (st_file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, F32x2),
            "gap of 4 bytes", "a"),
    "unclaimed-tail": (st_file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
                               F32x2), "belong to no tensor", None),
    "metadata-not-str": (st_file({"__metadata__": {"k": 1}}), "__metadata__", None),
    "bool-not-0-1": (st_file({"a": {"dtype": "BOOL", "shape": [2], "data_offsets": [0, 2]}},
                             b"\x01\x02"), "other than 0 and 1", "a"),
    "lone-surrogate-name": (st_file(b'{"\\ud800": {"dtype": "F32", "shape": [0], '
                                    b'"data_offsets": [0, 0]}}'), "not valid UTF-8", "\ud800"),
}


@pytest.mark.parametrize("case", list(HOSTILE), ids=list(HOSTILE))
def test_hostile_safetensors(capsys, tmp_path, case):
    raw, fragment, entry = HOSTILE[case]
    src, dst = tmp_path / "bad.safetensors", tmp_path / "out.fdl"
    src.write_bytes(raw)
    with pytest.raises(FormatError) as ei:
        conv.read_safetensors(src)
    e = ei.value
    assert isinstance(e, ValueError)
    assert e.path == str(src) and str(src) in str(e)
    assert fragment in str(e), str(e)
    assert e.entry == entry
    if entry is not None:
        assert repr(entry) in str(e)
    code, out, err = run(capsys, "convert", src, dst)
    assert code == 1 and out == ""
    assert_one_line_error(err, str(src))
    assert not dst.exists()
    no_temps(tmp_path)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_safetensors_fail_only_with_format_error(tmp_path, data):
    """Random byte edits and cuts of a valid file: a FormatError or a valid read, nothing else."""
    raw = bytearray(st_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                             "m": {"dtype": "BOOL", "shape": [1, 2], "data_offsets": [8, 10]},
                             "__metadata__": {"k": "v"}}, F32x2 + b"\x01\x00"))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    path = tmp_path / "m.safetensors"
    path.write_bytes(bytes(raw[:cut]))
    try:
        tf = conv.read_safetensors(path)
    except FormatError:
        return
    for name, t in tf.entries:
        assert isinstance(name, str) and isinstance(t, torch.Tensor)


def test_header_length_cap(tmp_path, monkeypatch):
    path = tmp_path / "big.safetensors"
    path.write_bytes(st_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, F32x2))
    monkeypatch.setattr(safetensors_mod, "MAX_HEADER", 16)
    with pytest.raises(FormatError, match="exceeds the limit of 16 bytes"):
        conv.read_safetensors(path)


def test_valid_hand_built_safetensors_reads(tmp_path):
    """The hostile cases fail for their flaw, not for being hand-built."""
    path = tmp_path / "ok.safetensors"
    header = {"b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
              "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
              "e": {"dtype": "I64", "shape": [0, 5], "data_offsets": [8, 8]}}
    path.write_bytes(st_file(header, F32x2, pad=False))
    tf = conv.read_safetensors(path)
    assert [n for n, _ in tf.entries] == ["a", "b", "e"]  # data order
    assert [t.tolist() for _, t in tf.entries] == [[1.0], [2.0], []]


# ----------------------------------------------------------------------------------
# .pt input
# ----------------------------------------------------------------------------------
class Marker:
    """Unpickling this would run a command; weights_only must refuse it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


@pytest.mark.parametrize("make, fragment", [
    (lambda d: {"w": torch.ones(2), "step": 3}, "entry 'step'"),
    (lambda d: {"w": torch.ones(2), "nested": {"x": torch.ones(1)}}, "got dict"),
    (lambda d: [torch.ones(2)], "holds a list"),
    (lambda d: torch.ones(2), "holds a Tensor"),
    (lambda d: {1: torch.ones(2)}, "key 1 is not a str"),
    (lambda d: {"state_dict": {"w": torch.ones(1)}, "model": {"w": torch.ones(1)}}, "both"),
    (lambda d: {"state_dict": {"w": "text"}}, "entry 'state_dict.w'"),
    (lambda d: nn.Linear(2, 2), "torch refused to unpickle"),
    (lambda d: {"w": Marker(str(d / "pwned"))}, "torch refused to unpickle"),
], ids=["int-value", "nested", "list", "tensor", "int-key", "ambiguous", "wrapped-str",
        "module", "os-system"])
def test_pt_that_is_not_a_state_dict(capsys, tmp_path, make, fragment):
    src, dst = tmp_path / "in.pt", tmp_path / "out.fdl"
    torch.save(make(tmp_path), src)
    code, out, err = run(capsys, "convert", src, dst)
    assert code == 1
    assert_one_line_error(err, str(src), fragment)
    assert not dst.exists()
    assert not (tmp_path / "pwned").exists()
    with pytest.raises(FormatError):
        conv.read_state_dict(src)


@pytest.mark.parametrize("raw", [b"", b"not a zip at all", b"PK\x03\x04" + bytes(100)],
                         ids=["empty", "garbage", "broken-zip"])
def test_pt_garbage(capsys, tmp_path, raw):
    src = tmp_path / "in.pt"
    src.write_bytes(raw)
    code, _, err = run(capsys, "convert", src, tmp_path / "out.fdl")
    assert code == 1
    assert_one_line_error(err, "not a loadable weights-only torch file")


@pytest.mark.parametrize("key", ["state_dict", "model"])
def test_pt_wrapper_is_unwrapped(capsys, tmp_path, key, caplog):
    sd = {"w": torch.arange(4.0), "b": torch.ones(1)}
    src, dst = tmp_path / "in.pt", tmp_path / "out.fdl"
    torch.save({key: sd, "epoch": 3, "optimizer": {"lr": 0.1}}, src)
    with caplog.at_level(logging.INFO, logger="snapsvc"):
        code, _, _ = run(capsys, "-v", "convert", src, dst)
    assert code == 0
    assert_bit_exact(read_any(dst), list(sd.items()))
    assert f"using '{key}'" in caplog.text and "epoch" in caplog.text


# ----------------------------------------------------------------------------------
# migrate
# ----------------------------------------------------------------------------------
@pytest.fixture
def old_ckpt(tmp_path, monkeypatch) -> Path:
    monkeypatch.syspath_prepend(str(TESTS))
    import cli_models
    path = tmp_path / "old.fdl"
    snapsvc.save_checkpoint(path, cli_models.old_model())
    return path


@pytest.mark.parametrize("factory", ["cli_models:new_model", "cli_models:New",
                                     "cli_models:Factories.build"])
def test_migrate_complete(capsys, tmp_path, old_ckpt, factory):
    import cli_models
    dst = tmp_path / "new.fdl.gz"
    code, out, err = run(capsys, "migrate", old_ckpt, dst, "--model", factory)
    assert (code, err) == (0, "")
    assert out.splitlines()[0] == "Migration: 0 unchanged, 4 remapped, 0 dropped, 0 missing (complete)"
    assert "remapped: encoder.weight -> body.weight" in out
    new = cli_models.New()
    snapsvc.load_checkpoint(dst, new, strict=True)
    old = cli_models.old_model()
    assert torch.equal(new.body.weight, old.encoder.weight)
    assert torch.equal(new.out.bias, old.head.bias)


def test_migrate_incomplete_exits_3(capsys, tmp_path, old_ckpt):
    dst = tmp_path / "wider.fdl"
    code, out, _ = run(capsys, "migrate", old_ckpt, dst, "--model", "cli_models:wider_model")
    assert code == 3
    assert "(incomplete)" in out and "missing:  out.weight" in out and "dropped:  head.weight" in out
    assert dst.exists()


@pytest.mark.parametrize("spec, fragment", [
    ("cli_models:not_a_model", "returned a dict, not a torch.nn.Module"),
    ("cli_models:nothing_here", "has no attribute 'nothing_here'"),
    ("no_such_module_xyz:build", "cannot import 'no_such_module_xyz'"),
    ("cli_models:broken_factory", "RuntimeError: factory failed on purpose"),
])
def test_migrate_bad_factory_fails_with_one_line(capsys, tmp_path, old_ckpt, spec, fragment):
    dst = tmp_path / "new.fdl"
    code, out, err = run(capsys, "migrate", old_ckpt, dst, "--model", spec)
    assert code == 1 and out == ""
    assert_one_line_error(err, fragment)
    assert not dst.exists()


# ----------------------------------------------------------------------------------
# errors, --debug, logging, progress
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, exc", [
    (["inspect", "{bad}"], FormatError),
    (["convert", "{bad}", "{tmp}/out.safetensors"], FormatError),
    (["inspect", "{tmp}/absent.fdl"], FileNotFoundError),
])
def test_errors_are_one_line_and_debug_shows_traceback(capsys, tmp_path, argv, exc):
    bad = tmp_path / "bad.fdl"
    bad.write_bytes(b"FDLX" + bytes(60))
    argv = [a.format(bad=bad, tmp=tmp_path) for a in argv]
    code, out, err = run(capsys, *argv)
    assert code == 1 and out == ""
    assert_one_line_error(err)
    with pytest.raises(exc):
        main(["--debug", *argv])
    with pytest.raises(exc):  # the flag also works after the command
        main([*argv, "--debug"])


def test_unexpected_exception_is_one_line(capsys, tmp_path, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("first line\nsecond line")

    monkeypatch.setattr(cli_files, "describe_file", boom)
    code, _, err = run(capsys, "inspect", tmp_path / "x.fdl")
    assert code == 1
    assert_one_line_error(err, "RuntimeError: first line", "--debug")
    with pytest.raises(RuntimeError):
        main(["--debug", "inspect", str(tmp_path / "x.fdl")])


def test_verbose_logs_what_conversion_drops(capsys, small, tmp_path, caplog):
    src, dst = tmp_path / "a.fdl", tmp_path / "a.pt"
    snapsvc.save_checkpoint(src, small)
    with caplog.at_level(logging.DEBUG, logger="snapsvc"):
        run(capsys, "convert", src, dst)
        assert "structural hash" not in caplog.text  # WARNING by default
        run(capsys, "-v", "convert", src, dst)
        assert "structural hash" in caplog.text and "not kept in .pt" in caplog.text


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_draws_only_on_a_terminal(monkeypatch):
    quiet = io.StringIO()
    monkeypatch.setattr(sys, "stderr", quiet)
    with cli.ProgressBar() as bar:
        bar("reading", 5, 10)
        bar.clear()
    assert quiet.getvalue() == ""

    tty = FakeTTY()
    monkeypatch.setattr(sys, "stderr", tty)
    with cli.ProgressBar() as bar:
        bar("reading", 0, 2048)
        bar("reading", 2048, 2048)
        bar("writing", 7, None)
    text = tty.getvalue()
    assert "reading:   0%|" in text and "0.00/2.00k" in text   # tqdm's bar, in KiB
    assert "writing: 0.00B" in text   # no total: a count
    assert text.endswith("\r")   # erased on exit (leave=False)


def test_convert_draws_progress_on_a_tty(capsys, small, tmp_path, monkeypatch):
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stderr", tty)
    src = tmp_path / "a.fdl"
    snapsvc.save_checkpoint(src, small)
    assert main(["convert", str(src), str(tmp_path / "a.safetensors")]) == 0
    assert "reading:" in tty.getvalue() and "writing:" in tty.getvalue()
    assert "reading" not in capsys.readouterr().out


@pytest.mark.timeout(180)
@pytest.mark.usefixtures("no_leaks")
def test_demo_prints_stall_table_and_restores(tmp_path, capsys):
    code = main(["demo", "--dir", str(tmp_path / "ck"), "--steps", "60", "--every", "20",
                 "--keep-last", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "stall ms" in out and "raw copy ms" in out and "step00060.fdl" in out
    assert "bit-identical to the live model and optimizer" in out
    assert sorted(os.listdir(tmp_path / "ck")) == [
        "step00040.fdl", "step00040.fdl.meta", "step00040.optim.fdl",
        "step00060.fdl", "step00060.fdl.meta", "step00060.optim.fdl"]
    for pattern, n in (("*.fdl", 4), ("*", 6)):  # what a user types next
        code, out, err = run(capsys, "verify", *glob(tmp_path / "ck", pattern))
        assert (code, err, out.splitlines()[-1]) == (0, "", f"{n} of {n} files OK"), out


@pytest.mark.timeout(240)
def test_no_numpy_no_warning(tmp_path):
    """On a machine without numpy, torch warns "Failed to initialize NumPy" when
    imported; no snapsvc command (nor the demo's sidecar) may show it."""
    stub = tmp_path / "no-numpy" / "numpy"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(
        'raise ModuleNotFoundError("No module named \'numpy\'", name="numpy")\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(stub.parent), str(TESTS.parent), os.environ.get("PYTHONPATH", "")])}
    env.pop("PYTHONWARNINGS", None)

    def snapsvc_cli(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "snapsvc", *argv], capture_output=True,
                              text=True, env=env, cwd=tmp_path, timeout=200)

    premise = subprocess.run([sys.executable, "-c", "import numpy"], capture_output=True,
                             env=env, timeout=60)
    assert premise.returncode != 0  # numpy really is missing for these commands
    demo = snapsvc_cli("demo", "--dir", "ck", "--steps", "20", "--every", "10")
    assert (demo.returncode, demo.stderr) == (0, ""), demo.stdout
    files = sorted(os.listdir(tmp_path / "ck"))
    for argv in (["verify", *[f"ck/{f}" for f in files]], ["inspect", "--json", "ck/" + files[0]],
                 ["--version"]):
        proc = snapsvc_cli(*argv)
        assert (proc.returncode, proc.stderr) == (0, ""), (argv, proc.stdout)


def test_demo_rejects_bad_arguments(capsys):
    assert main(["demo", "--steps", "5", "--every", "10"]) == 2
    assert "--every" in capsys.readouterr().err

"""Hostile ``.meta`` files (issue 20, section 4): every reader fails with FormatError.

A metadata file carries its own CRC-32, so a forger simply recomputes it: each
case here rewrites the fields of a real checkpoint's metadata by hand (with
``msgpack`` directly, never snapsvc's packer) and writes a valid CRC. Then
``load``, ``verify``, ``restore``, ``load_snapshot`` and ``snapsvc verify``
must report a :class:`FormatError` naming the file (``verify`` lists it as a
problem), never crash, never raise another type, and use memory in proportion
to the file. The nesting bombs run in a child process: before the fix they
overflow the C stack and kill the interpreter.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import snapsvc
from snapsvc import FormatError, SnapsvcError

pytest_plugins = ["remote_fixtures"]  # s3: skipped without obstore, moto or boto3

LONG_FUZZ = int(os.environ.get("SNAPSVC_FUZZ_EXAMPLES") or 0)
pytestmark = pytest.mark.timeout(120 + LONG_FUZZ // 5)
ROOT = Path(__file__).resolve().parent.parent

# msgpack extension codes of snapsvc.protocol (its docstring): tuple, TensorRef,
# ObjectNode, InlineTensor
TUPLE, REF, OBJECT, INLINE = 1, 2, 3, 4


# ----------------------------------------------------------------------------------
# hand editing of a metadata file
# ----------------------------------------------------------------------------------
def read_fields(meta: Path) -> dict:
    """The metadata's fields, extension values kept as raw ``msgpack.ExtType``."""
    outer = msgpack.unpackb(meta.read_bytes(), raw=False)
    return msgpack.unpackb(outer["fields"], raw=False, strict_map_key=False,
                           ext_hook=msgpack.ExtType)


def write_packed_fields(meta: Path, packed: bytes) -> None:
    """``packed`` as the metadata's fields, under a correct CRC-32."""
    outer = {"magic": "snapsvc-meta", "meta_version": 2, "crc32": zlib.crc32(packed),
             "fields": packed}
    meta.write_bytes(msgpack.packb(outer, use_bin_type=True))


def write_fields(meta: Path, fields: dict) -> None:
    write_packed_fields(meta, msgpack.packb(fields, use_bin_type=True))


def ext(code: int, value) -> msgpack.ExtType:
    return msgpack.ExtType(code, msgpack.packb(value, use_bin_type=True))


def tuple_bomb(depth: int, payload: bytes = b"") -> msgpack.ExtType:
    """``depth`` tuples, each the only item of the next: one C-level unpack call per level."""
    inner = msgpack.packb(payload, use_bin_type=True)
    for _ in range(depth - 1):
        inner = msgpack.packb(msgpack.ExtType(TUPLE, b"\x91" + inner))  # fixarray of 1
    return msgpack.ExtType(TUPLE, b"\x91" + inner)


def array_header_bomb(depth: int, count: int) -> bytes:
    """``depth`` array32 headers, each declaring ``count`` items, and nothing else."""
    return b"\xdd" + count.to_bytes(4, "big") + b"".join(
        b"\xdd" + count.to_bytes(4, "big") for _ in range(depth - 1))


# ----------------------------------------------------------------------------------
# real files to start from
# ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    """A nested-state checkpoint and a model checkpoint with optimizer, from the sidecar."""
    d = tmp_path_factory.mktemp("orig")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    with snapsvc.SnapshotWriter(d) as w:
        w.submit({"model": model, "opt": opt, "n": 3, "t": (1, 2)}, "state.fdl").result(timeout=60)
        w.submit(model, "model.fdl", optimizer=opt, metrics={"loss": 0.5},
                 extra={"step": 1}).result(timeout=60)
        w.submit({"n": 3, "t": (1, 2)}, "plain.fdl").result(timeout=60)  # no tensor at all
    return d


def copy_checkpoint(src_dir: Path, name: str, dst_dir: Path) -> Path:
    for f in os.listdir(src_dir):
        if f.startswith(name.split(".")[0] + "."):
            shutil.copy(src_dir / f, dst_dir / f)
    return dst_dir / name


def fresh_target() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    return model, torch.optim.Adam(model.parameters())


def read_everywhere(path: Path, kind: str) -> list[str]:
    """Every reader on ``path``: [] when all succeed, else each one's error.

    A malformed file is a FormatError; well-formed metadata that describes
    something else (another optimizer class, other shapes) may instead be
    another SnapsvcError. Any other exception fails the test (it propagates);
    ``load`` must return a dict.
    """
    errors = []
    report = snapsvc.verify(path)
    errors += report.problems
    calls = {"state": [lambda: snapsvc.load(path),
                       lambda: snapsvc.restore(path, {"model": fresh_target()[0]})],
             "model": [lambda: snapsvc.load_snapshot(path),
                       lambda: snapsvc.restore(path, *fresh_target()),
                       lambda: snapsvc.load(path)]}[kind]
    for call in calls:
        try:
            got = call()
        except FormatError as e:
            assert e.path is not None, f"{e!r} names no file"
            errors.append(str(e))
            continue
        except SnapsvcError as e:
            assert str(path.parent) in str(e), f"{e!r} names no file"
            errors.append(str(e))
            continue
        if call is calls[0] and kind == "state":
            assert type(got) is dict, f"load() returned a {type(got).__name__}, not a dict"
    return errors


# ----------------------------------------------------------------------------------
# nesting bombs, in a child process
# ----------------------------------------------------------------------------------
CHILD = textwrap.dedent("""
    import json, resource, subprocess, sys
    import snapsvc, torch
    from torch import nn
    path, kind = sys.argv[1], sys.argv[2]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    out = {}
    calls = {"load": lambda: snapsvc.load(path),
             "load_snapshot": lambda: snapsvc.load_snapshot(path),
             "restore": lambda: snapsvc.restore(path, nn.Linear(3, 4))}
    for name, call in calls.items():
        try:
            call()
            out[name] = "returned"
        except snapsvc.FormatError as e:
            out[name] = "FormatError: " + str(e)
        except BaseException as e:
            out[name] = type(e).__name__ + ": " + str(e)[:200]
    out["verify"] = snapsvc.verify(path).problems
    out["rss_growth"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) - before
    print(json.dumps(out))
""")


def run_child(path: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.fspath(ROOT)}
    proc = subprocess.run([sys.executable, "-c", CHILD, os.fspath(path), "any"], env=env,
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, (f"the reader died with {proc.returncode} "
                                  f"(-11 is SIGSEGV): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def cli_verify(path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.fspath(ROOT)}
    return subprocess.run([sys.executable, "-m", "snapsvc", "verify", os.fspath(path)],
                          env=env, capture_output=True, text=True, timeout=100)


def assert_refused_by_every_reader(path: Path, meta: Path, max_rss: int) -> None:
    out = run_child(path)
    for name in ("load", "load_snapshot", "restore"):
        assert out[name].startswith("FormatError: "), f"{name}: {out[name]}"
        assert os.fspath(meta) in out[name], f"{name} does not name the file: {out[name]}"
    assert out["verify"] and any(os.fspath(meta) in p for p in out["verify"]), out["verify"]
    assert out["rss_growth"] < max_rss, f"RSS grew by {out['rss_growth'] >> 20} MiB"


def test_tuple_depth_bomb_is_a_format_error_not_a_crash(originals, tmp_path):
    path = copy_checkpoint(originals, "model.fdl", tmp_path)
    meta = Path(f"{path}.meta")
    fields = read_fields(meta)
    fields["extra"] = tuple_bomb(250)
    write_fields(meta, fields)
    assert meta.stat().st_size < 2048  # a 1.4 KB file
    assert_refused_by_every_reader(path, meta, max_rss=64 << 20)
    proc = cli_verify(path)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    assert os.fspath(meta) in proc.stdout + proc.stderr


def test_deep_object_and_inline_nesting_is_refused(originals, tmp_path):
    """The same bomb through the other extension types and plain arrays."""
    path = copy_checkpoint(originals, "state.fdl", tmp_path)
    meta = Path(f"{path}.meta")
    fields = read_fields(meta)
    value = ext(INLINE, ["bool", [1], b"\x01"])
    for i in range(300):
        value = ext(OBJECT, ["stateful", "X", [value]]) if i % 2 else [value]
    fields["state"] = {"x": value}
    write_fields(meta, fields)
    assert_refused_by_every_reader(path, meta, max_rss=64 << 20)


def test_expansion_bomb_takes_memory_in_proportion_to_the_file(originals, tmp_path):
    """2 MiB of bytes nested 150 tuples deep: each level would hold its own copy (300 MiB)."""
    path = copy_checkpoint(originals, "model.fdl", tmp_path)
    meta = Path(f"{path}.meta")
    fields = read_fields(meta)
    fields["extra"] = tuple_bomb(150, b"\x00" * (2 << 20))
    write_fields(meta, fields)
    assert_refused_by_every_reader(path, meta, max_rss=64 << 20)


def test_declared_counts_bounded_by_the_bytes_left(originals, tmp_path):
    """Nested headers that each declare as many items as the file has bytes."""
    path = copy_checkpoint(originals, "model.fdl", tmp_path)
    meta = Path(f"{path}.meta")
    fields = read_fields(meta)
    fields.pop("extra_state", None)  # so that "state" is the last field
    packed = msgpack.packb(fields, use_bin_type=True)
    # the map's last value (its "state": None) becomes the bomb, padded to 1 MiB
    assert packed.endswith(b"\xa5state\xc0")
    bomb = array_header_bomb(500, 1 << 20)
    write_packed_fields(meta, packed[:-1] + bomb + b"\x00" * ((1 << 20) - len(bomb)))
    assert_refused_by_every_reader(path, meta, max_rss=64 << 20)


# ----------------------------------------------------------------------------------
# malformed field types
# ----------------------------------------------------------------------------------
MODEL_CASES = {
    "size-str": ("size", "12"),
    "crc-str": ("crc32", "x"),
    "crc-list": ("crc32", [1]),
    "entries-float": ("entries", 1.5),
    "buffers-int": ("buffers", 5),
    "buffers-of-ints": ("buffers", [1, 2]),
    "epoch-str": ("epoch", "3"),
    "epoch-list": ("epoch", [3]),
    "metrics-list": ("metrics", [1.0]),
    "metrics-str-value": ("metrics", {"loss": "low"}),
    "hash-int": ("structural_hash", 7),
    "hash-not-hex": ("structural_hash", "zz"),
    "created-str": ("created", "now"),
    "optimizer-list": ("optimizer", [1, 2]),
    "optimizer-no-class": ("optimizer", {"groups": [], "scalars": {}}),
    "optimizer-groups-str": ("optimizer", {"class": "Adam", "groups": "x", "scalars": {},
                                           "file": "model.optim.fdl", "size": 1, "crc32": 1}),
    "optimizer-size-str": ("optimizer", {"class": "Adam", "groups": [], "scalars": {},
                                         "file": "model.optim.fdl", "size": "1", "crc32": "x"}),
    "format-version-str": ("format_version", "2"),
}

STATE_CASES = {
    "state-list": ("state", [1, 2]),
    "state-int": ("state", 3),
    "state-str": ("state", "x"),
    "object-cls-int": ("state", {"model": ext(OBJECT, ["module", 5, {}])}),
    "object-kind-unknown": ("state", {"opt": ext(OBJECT, ["nope", "Adam", {}])}),
    "object-module-list": ("state", {"model": ext(OBJECT, ["module", "Sequential", [1]])}),
    "optimizer-node-garbage": ("state", {"model": ext(OBJECT, ["optimizer", "Adam",
                                                              {"state": [], "param_groups": 1}])}),
    "ref-not-utf8": ("state", {"model": msgpack.ExtType(REF, b"\xff\xfe")}),
    "inline-unknown-dtype": ("state", {"model": ext(INLINE, ["cplx9", [1], b"\x00"])}),
    "inline-huge-shape": ("state", {"model": ext(INLINE, ["bool", [1 << 62, 4, 0], b""])}),
    "inline-shape-str": ("state", {"model": ext(INLINE, ["bool", "1", b"\x00"])}),
    "unhashable-key": None,  # built by hand below: a map with an array as a key
    "timestamp-ext": ("state", {"model": msgpack.Timestamp(0)}),
    "unknown-ext": ("state", {"model": msgpack.ExtType(9, b"")}),
}


@pytest.mark.parametrize("case", MODEL_CASES, ids=list(MODEL_CASES))
def test_malformed_model_metadata_is_a_format_error(originals, tmp_path, case):
    path = copy_checkpoint(originals, "model.fdl", tmp_path)
    meta = Path(f"{path}.meta")
    key, value = MODEL_CASES[case]
    fields = read_fields(meta)
    fields[key] = value
    write_fields(meta, fields)
    assert read_everywhere(path, "model"), "a malformed field went unnoticed"


@pytest.mark.parametrize("case", STATE_CASES, ids=list(STATE_CASES))
def test_malformed_state_metadata_is_a_format_error(originals, tmp_path, case):
    path = copy_checkpoint(originals, "state.fdl", tmp_path)
    meta = Path(f"{path}.meta")
    fields = read_fields(meta)
    if STATE_CASES[case] is None:
        fields.pop("extra_state", None)  # so that "state" is the last field
        packed = msgpack.packb({**fields, "state": None}, use_bin_type=True)
        assert packed.endswith(b"\xa5state\xc0")
        write_packed_fields(meta, packed[:-1] + b"\x81\x91\x01\x02")  # {[1]: 2}
    else:
        key, value = STATE_CASES[case]
        fields[key] = value
        write_fields(meta, fields)
    assert read_everywhere(path, "state"), "a malformed field went unnoticed"


@pytest.mark.parametrize("state", [[1, 2], 3, "x", None, ext(TUPLE, [1])],
                         ids=["list", "int", "str", "none", "tuple"])
def test_load_never_returns_a_non_map(originals, tmp_path, state):
    """A state checkpoint without tensors: nothing else would notice a replaced tree.
    No tree at all is a model checkpoint (of a model without tensors): a map too."""
    path = copy_checkpoint(originals, "plain.fdl", tmp_path)
    meta = Path(f"{path}.meta")
    fields = read_fields(meta)
    fields["state"] = state
    write_fields(meta, fields)
    if state is None:
        assert snapsvc.load(path) == {"model": {}}
        return
    with pytest.raises(FormatError) as info:
        snapsvc.load(path)
    assert info.value.path == os.fspath(path) or info.value.path == os.fspath(meta)


# ----------------------------------------------------------------------------------
# fuzz: random values in random fields, and random bytes under a valid CRC
# ----------------------------------------------------------------------------------
def fuzz_settings(default_examples: int):
    return settings(max_examples=LONG_FUZZ or default_examples, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


leaves = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1),
                   st.floats(allow_nan=True), st.text(max_size=8), st.binary(max_size=8))


def values(depth: int = 3):
    return st.recursive(
        leaves,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4),
            st.dictionaries(st.one_of(st.text(max_size=6), st.integers(-3, 3)), inner, max_size=4),
            st.builds(lambda v: ext(TUPLE, v), st.lists(inner, max_size=3)),
            st.builds(lambda k, c, v: ext(OBJECT, [k, c, v]),
                      st.sampled_from(["module", "optimizer", "stateful", "x"]),
                      st.one_of(st.text(max_size=6), st.integers(-5, 5)), inner),
            st.builds(lambda d, s, b: ext(INLINE, [d, s, b]),
                      st.sampled_from(["bool", "uint8", "int16", "complex64", "float32"]),
                      st.lists(st.integers(-2, 1 << 63), max_size=3), st.binary(max_size=8)),
            st.builds(lambda n: msgpack.ExtType(REF, n.encode()),
                      st.sampled_from(["0.weight", "model/0.weight", "x", ""])),
            st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=6)),
            st.builds(msgpack.Timestamp, st.integers(0, 1 << 33)),
        ),
        max_leaves=12)


FIELDS = ["format_version", "size", "crc32", "entries", "buffers", "epoch", "metrics",
          "structural_hash", "created", "extra", "optimizer", "state", "extra_state"]


@fuzz_settings(60)
@given(kind=st.sampled_from(["state", "model"]),
       changes=st.dictionaries(st.sampled_from(FIELDS), values(), min_size=1, max_size=3))
def test_random_field_values_fail_only_with_format_error(originals, tmp_path_factory, kind,
                                                         changes):
    d = tmp_path_factory.mktemp("fuzz")
    path = copy_checkpoint(originals, f"{kind}.fdl", d)
    meta = Path(f"{path}.meta")
    fields = read_fields(meta)
    fields.update(changes)
    write_fields(meta, fields)
    read_everywhere(path, kind)


@fuzz_settings(60)
@given(kind=st.sampled_from(["state", "model"]),
       ops=st.lists(st.tuples(st.sampled_from(["flip", "insert", "delete", "byte"]),
                              st.integers(0, 1 << 16), st.integers(0, 255)),
                    min_size=1, max_size=4))
def test_mutated_fields_under_a_valid_crc_fail_only_with_format_error(originals,
                                                                      tmp_path_factory, kind,
                                                                      ops):
    d = tmp_path_factory.mktemp("fuzz")
    path = copy_checkpoint(originals, f"{kind}.fdl", d)
    meta = Path(f"{path}.meta")
    data = bytearray(msgpack.unpackb(meta.read_bytes(), raw=False)["fields"])
    for op, at, byte in ops:
        at %= len(data) + 1
        if op == "flip" and at < len(data):
            data[at] ^= 1 << (byte % 8)
        elif op == "insert":
            data[at:at] = bytes([byte])
        elif op == "delete":
            del data[at:at + 1 + byte % 4]
        elif op == "byte" and at < len(data):
            data[at] = byte  # 0xdd, 0xdf, 0xc9...: hostile headers
    write_packed_fields(meta, bytes(data))
    read_everywhere(path, kind)


# ----------------------------------------------------------------------------------
# safetensors: a shape past int64
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [[1 << 63, 0], [1 << 64, 0], [1 << 40, 1 << 40, 0],
                                   [(1 << 63) - 1, 2, 0]])
def test_safetensors_shape_beyond_int64_is_a_format_error(tmp_path, shape):
    header = json.dumps({"x": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}).encode()
    src = tmp_path / "big.safetensors"
    src.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(FormatError, match="shape") as info:
        snapsvc.convert_file(src, tmp_path / "out.fdl")
    assert info.value.path == os.fspath(src)
    assert not (tmp_path / "out.fdl").exists()


COMPANION_NAMES = {  # (field, the name it records) -> what it points at
    ("optimizer", "model.fdl"): "the checkpoint", ("optimizer", "model.fdl.meta"): "its .meta",
    ("optimizer", "model.fdl.data"): "the data file", ("data", "model.optim.fdl"): "the optimizer",
    ("data", "model.fdl"): "the checkpoint", ("data", "model.fdl.meta"): "its .meta",
    ("optimizer", "/tmp/model.optim.fdl"): "absolute", ("data", "/tmp/x"): "absolute",
    ("optimizer", ".."): "..", ("data", ".."): "..", ("optimizer", "../model.optim.fdl"): "up",
    ("optimizer", "sub/model.optim.fdl"): "separator", ("data", "sub/model.fdl.data"): "separator",
}


def test_companion_names_that_point_elsewhere_are_format_errors(originals, tmp_path, s3):
    """Issue 30 item 32: a CRC-valid .meta whose optimizer or data file name is the
    checkpoint, its .meta, the other companion, or not a plain file name here: every
    reader, local and remote, raises FormatError naming the .meta and the field (the
    remote fetch raised FileExistsError for the checkpoint's own name)."""
    path = copy_checkpoint(originals, "model.fdl", tmp_path)
    meta = Path(f"{path}.meta")
    good = read_fields(meta)
    for n in ("model.fdl", "model.optim.fdl"):
        s3.write(n, (tmp_path / n).read_bytes())
    both = dict(good, data={"file": "model.fdl.data", "size": 0, "crc32": 0, "entries": 0})
    write_fields(meta, both)
    with pytest.raises(FileNotFoundError):  # names fine: the data file is missing
        snapsvc.load(path)
    for (field, name), what in COMPANION_NAMES.items():
        fields = dict(good)
        fields[field] = dict(good["optimizer"], file=name) if field == "optimizer" else \
            {"file": name, "size": 0, "crc32": 0, "entries": 0}
        write_fields(meta, fields)
        errors = read_everywhere(path, "model")
        assert len(errors) == 4 and all(f"{meta}: the metadata field {field!r}" in e
                                        for e in errors), (what, errors)
        s3.write("model.fdl.meta", meta.read_bytes())
        with pytest.raises(FormatError) as info:
            snapsvc.load(f"{s3.url}/model.fdl")
        assert info.value.path == f"{s3.url}/model.fdl.meta", what
        assert f"field {field!r}" in info.value.reason, what

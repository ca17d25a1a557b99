"""File modes and file-name lengths of what snapsvc writes (snapsvc.files.durable).

Final files get the mode ``open()`` would give them (0666 less the umask),
in-process and from the sidecar, which inherits the trainer's umask. A final
name up to the file system's limit (255 bytes) gets a temp name that fits; a
longer one is a ``PathError`` before anything is written.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import snapsvc
from snapsvc import PathError, SnapsvcError
from snapsvc.files.durable import (TMP_SUFFIX, check_final_name, discard, remove_stale_temps,
                             staged_write)
from snapsvc.files.meta import meta_path
from snapsvc.state.resume import optim_path

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(60)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))


def temps(directory: Path) -> list[str]:
    return [n for n in os.listdir(directory) if n.endswith(TMP_SUFFIX)]


def mode(path: str | os.PathLike[str]) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# ----------------------------------------------------------------------------------
# permissions
# ----------------------------------------------------------------------------------
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.timeout(30)  # it forks
def test_the_umask_read_follows_a_change_a_fork_and_a_closed_file():
    """The umask is read from a status file kept open (issue 34): it still
    follows os.umask, a forked child reads its own process, and a file
    descriptor closed under it is opened again."""
    from snapsvc.files import durable
    old = os.umask(0o022)
    try:
        assert durable.current_umask() == 0o022
        os.umask(0o027)
        assert durable.current_umask() == 0o027
        os.close(durable._status[0])  # as a daemonizing library closes every fd
        assert durable.current_umask() == 0o027
        other = os.open(os.devnull, os.O_RDONLY)  # a file now where our descriptor was
        try:
            durable._status = (other, *durable._status[1:])
            assert durable.current_umask() == 0o027
            assert os.fstat(other)  # told apart, and left open: not ours
        finally:
            os.close(other)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: its own umask, through its own status file
            os.umask(0o077)
            os.write(write, b"%o" % durable.current_umask())
            os._exit(0)
        os.close(write)
        assert os.waitpid(pid, 0)[1] == 0
        assert os.read(read, 16) == b"77"
        os.close(read)
        assert durable.current_umask() == 0o027  # the parent's, unchanged by the child
    finally:
        os.umask(old)


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("no_leaks")
@pytest.mark.parametrize("umask, want", [(0o022, 0o644), (0o077, 0o600), (0o027, 0o640)])
def test_final_files_follow_the_umask(tmp_path, umask, want):
    m = model()
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(2, 3)).sum().backward()
    opt.step()
    old = os.umask(umask)
    try:
        snapsvc.save_checkpoint(tmp_path / "plain.fdl", m)  # atomic_write, in-process
        snapsvc.snapshot_cpu(m).save_file(tmp_path / "snap.fdl")  # checkpoint + .meta
        with snapsvc.SnapshotWriter(tmp_path / "w") as w:  # the sidecar inherits the umask
            w.submit(m, "side.fdl", optimizer=opt).result(timeout=60)
    finally:
        os.umask(old)
    side = tmp_path / "w" / "side.fdl"
    files = [tmp_path / "plain.fdl", tmp_path / "snap.fdl", meta_path(tmp_path / "snap.fdl"),
             side, meta_path(side), optim_path(side)]
    assert {os.fspath(f): oct(mode(f)) for f in files} == {os.fspath(f): oct(want) for f in files}
    assert snapsvc.verify(side).ok


# ----------------------------------------------------------------------------------
# long file names
# ----------------------------------------------------------------------------------
LONG_NAMES = {
    "ascii": "a" * 246 + ".fdl",               # 250 bytes; its .meta is 255
    "utf8": "\u00e9" * 123 + ".fdl",           # 250 bytes of 2-byte characters
    "utf8-3": "b" + "\u20ac" * 81 + ".fdl",    # 248 bytes of 3-byte characters: the temp
}                                              # name's cut may land inside one


@pytest.mark.parametrize("name", LONG_NAMES.values(), ids=LONG_NAMES.keys())
def test_long_name_through_save_checkpoint(tmp_path, name):
    assert len(os.fsencode(name)) <= 250
    m = model()
    snapsvc.save_checkpoint(tmp_path / name, m)
    assert os.listdir(tmp_path) == [name]
    assert set(snapsvc.read_checkpoint(tmp_path / name).entries) == set(m.state_dict())


@pytest.mark.parametrize("name", LONG_NAMES.values(), ids=LONG_NAMES.keys())
def test_long_name_with_its_meta_in_process(tmp_path, name):
    path = tmp_path / name
    snapsvc.snapshot_cpu(model(), epoch=3).save_file(path)
    assert sorted(os.listdir(tmp_path)) == sorted([name, name + ".meta"])
    assert snapsvc.verify(path).ok and snapsvc.load_snapshot(path).epoch == 3


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("no_leaks")
def test_long_name_through_submit(tmp_path):
    name = LONG_NAMES["ascii"]
    with snapsvc.SnapshotWriter(tmp_path) as w:
        report = w.submit(model(), name, metrics={"loss": 0.5}).result(timeout=60)
    assert report.path == os.fspath(tmp_path / name)
    assert sorted(os.listdir(tmp_path)) == [name, name + ".meta"]  # 250 and 255 bytes
    check = snapsvc.verify(tmp_path / name)
    assert check.ok, check


def test_check_final_name():
    ok = "/tmp/" + "a" * 255
    check_final_name(ok)
    check_final_name("relative/" + "\u00e9" * 127)  # 254 bytes, in a directory not made yet
    too_long = "/tmp/" + "\u00e9" * 128  # 128 characters, 256 bytes
    with pytest.raises(PathError) as e:
        check_final_name(too_long)
    assert isinstance(e.value, ValueError) and isinstance(e.value, SnapsvcError)
    msg = str(e.value)
    assert msg.startswith(too_long) and "256 bytes" in msg and "255" in msg and "shorter" in msg


def test_too_long_name_fails_before_writing(tmp_path):
    with pytest.raises(PathError, match="256 bytes"):
        snapsvc.save_checkpoint(tmp_path / ("c" * 252 + ".fdl"), model())
    assert os.listdir(tmp_path) == []


def test_too_long_meta_name_leaves_no_checkpoint_without_metadata(tmp_path):
    """251 bytes: the checkpoint's name fits, its .meta's (256) does not. The
    checkpoint must not be renamed into place as an unfinished write."""
    name = "d" * 247 + ".fdl"
    (tmp_path / name).write_bytes(b"old")  # an earlier file of that name stays untouched
    with pytest.raises(PathError, match=r"\.meta: the file name is 256 bytes"):
        snapsvc.snapshot_cpu(model()).save_file(tmp_path / name)
    assert os.listdir(tmp_path) == [name] and (tmp_path / name).read_bytes() == b"old"


@pytest.mark.timeout(120)
def test_stale_temp_of_a_long_name_is_removed(tmp_path):
    """A writer that died mid-write leaves a shortened temp name; the pid in it
    still identifies the dead writer to remove_stale_temps."""
    name = "e" * 250
    script = ("import os, sys\n"
              "from snapsvc.files.durable import staged_write\n"
              "cm = staged_write(sys.argv[1]); f = cm.__enter__(); f.write(b'partial'); "
              "f.flush()\n"
              "os._exit(0)  # dies holding the temp file\n")
    subprocess.run([sys.executable, "-c", script, os.fspath(tmp_path / name)], cwd=ROOT,
                   check=True, timeout=110)
    left = temps(tmp_path)
    assert len(left) == 1 and len(os.fsencode(left[0])) <= 255
    with staged_write(tmp_path / name) as live:  # a live writer's temp (ours) is kept
        assert remove_stale_temps(tmp_path) == [os.fspath(tmp_path / left[0])]
        assert temps(tmp_path) == [os.path.basename(live.tmp_path)]
    discard(live)
    assert os.listdir(tmp_path) == []

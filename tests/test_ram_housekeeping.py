"""The RAM tier's housekeeping (issue 31/32 review): adoption by one of two writers
starting at once, symlinks in the private tree, and the sweep of what dead holders left."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import snapsvc
from snapsvc.files import ramtier
from snapsvc.files.metafile import meta_path

ROOT = Path(os.environ.get("SNAPSVC_TEST_ROOT", Path(__file__).resolve().parents[1]))
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A whole checkpoint (``t.fdl`` and its metadata): a RAM copy is the same files."""
    d = tmp_path_factory.mktemp("template")
    with snapsvc.SnapshotWriter(d) as w:
        w.submit({"w": torch.arange(4096.0), "step": 7}, "t.fdl").result(60)
    return d / "t.fdl"


@pytest.fixture(scope="module")
def dead_pid():
    """The pid of a process that has exited."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, timeout=30)
    return int(dead.stdout)


def _dead_holders_copy(directory, template, pid, name="good5.fdl") -> str:
    """What a SIGKILLed holder leaves for ``directory``: a whole RAM copy ``name`` and
    its mark, no longer locked. The copy's RAM path."""
    ram = ramtier.ram_path(os.path.join(directory, name), create=True)
    shutil.copyfile(template, ram)
    shutil.copyfile(meta_path(str(template)), meta_path(ram))
    open(os.path.join(os.path.dirname(ram), f".owner-{pid}"), "w").close()
    return ram


_ADOPTER = r"""
import sys, time
from snapsvc.files import ramtier


def preempted(frame, event, arg):
    # a busy machine's preemption, made sure: a pause right after the process has
    # marked the folder as its own (claim), before it looks at the others' marks
    if event == "return" and frame.f_code.co_name in ("claim", "_mark") \
            and frame.f_globals["__name__"] == ramtier.__name__:
        time.sleep(0.3)


sys.setprofile(preempted)
got = []
for line in sys.stdin:
    if line.strip() == "go":    # what a sidecar or service does first at its start
        got = ramtier.adopt(sys.argv[1])
        print(len(got), flush=True)
    else:                        # its exit: what it held goes
        for _, ram in got:
            ramtier.drop(ram)
        ramtier.release_marks()
        print("released", flush=True)
"""


@pytest.mark.timeout(120)
def test_two_writers_starting_at_once_adopt_a_dead_holders_copies_exactly_once(
        tmp_path, template, dead_pid):
    """Two sidecars of one directory starting together after its holder was SIGKILLed:
    one adopts the copies, the other sees that one's live mark; never both nothing
    (each saw the other's fresh mark as live, and the copies stayed)."""
    procs = [subprocess.Popen([sys.executable, "-c", _ADOPTER, str(tmp_path)], cwd=ROOT,
                              env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        for round_ in range(3):
            ram = _dead_holders_copy(tmp_path, template, dead_pid)
            for p in procs:
                p.stdin.write("go\n")
            for p in procs:
                p.stdin.flush()
            got = sorted(int(p.stdout.readline()) for p in procs)
            assert got == [0, 1], f"round {round_}: copies adopted per process: {got}"
            for p in procs:
                p.stdin.write("release\n")
                p.stdin.flush()
            assert [p.stdout.readline().strip() for p in procs] == ["released"] * 2
            assert not os.path.exists(os.path.dirname(ram))   # nothing left behind
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(30)


@pytest.mark.timeout(120)
def test_a_symlinked_owner_mark_is_removed_not_followed_and_the_writer_starts(
        tmp_path, no_leaks):
    """A ``.owner-*`` entry that is a symlink (to a file of the user's elsewhere) in the
    directory's RAM folder: the writer's sidecar starts and holds a memory-only
    snapshot; the link is removed, its target untouched (never opened, never locked)."""
    outside = tmp_path / "outside.txt"
    outside.write_text("the user's own file")
    folder = os.path.dirname(ramtier.ram_path(tmp_path / "x", create=True))
    link = os.path.join(folder, ".owner-424242")
    os.symlink(outside, link)
    with snapsvc.SnapshotWriter(tmp_path) as w:
        w.submit({"w": torch.arange(64.0), "step": 3}, "m3.fdl", persist=False).result(60)
        target = {"w": torch.zeros(64), "step": 0}
        assert snapsvc.restore(tmp_path / "m3.fdl", target).state["step"] == 3
        assert torch.equal(target["w"], torch.arange(64.0))
        assert not os.path.lexists(link)
    assert outside.read_text() == "the user's own file"


def test_symlinks_anywhere_in_the_ram_tier_are_removed_with_a_warning_never_followed(
        tmp_path, template, dead_pid):
    """Siblings, at adoption and sweep: a symlinked copy and metadata (to a whole
    checkpoint elsewhere), a symlinked mark, and a symlinked folder in the user's
    root: each removed with a warning naming it, never read nor adopted; the
    targets stay as they were."""
    ram = _dead_holders_copy(tmp_path, template, dead_pid)
    folder = os.path.dirname(ram)
    other = tmp_path / "elsewhere"
    other.mkdir()
    links = {os.path.join(folder, "evil9.fdl"): template,
             meta_path(os.path.join(folder, "evil9.fdl")): meta_path(str(template)),
             os.path.join(folder, ".owner-1"): template,
             os.path.join(ramtier.ram_root(), "0123456789abcdef"): other}
    for link, target in links.items():
        os.symlink(target, link)
    before = template.read_bytes()
    with pytest.warns(RuntimeWarning) as seen:
        got = ramtier.adopt(tmp_path)
    try:
        assert [p for p, _ in got] == [str(tmp_path / "good5.fdl")]   # the real copy only
        text = "\n".join(str(w.message) for w in seen)
        for link in links:
            assert f"{link} is a symlink" in text and not os.path.lexists(link)
        assert template.read_bytes() == before and other.is_dir()
    finally:
        for _, copy in got:
            ramtier.drop(copy)
        ramtier.release_marks()
    assert not os.path.exists(folder)

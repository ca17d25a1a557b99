"""The RAM tier's housekeeping (issue 31/32 review): adoption by one of two writers
starting at once, symlinks in the private tree, and the sweep of what dead holders left."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

import snapsvc
from snapsvc.distributed.replicas import replica_file
from snapsvc.distributed.replicas.keep import Keeper
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


@pytest.fixture
def own_root(tmp_path, monkeypatch):
    """A RAM tier of this test's own (in this process). For the tests that put a foreign
    entry in the user's root on purpose (a symlinked or swapped folder): in the shared
    /dev/shm root the sweeps of writers starting beside them (other tests, other
    workers) would remove it first, or warn about it in their output."""
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(ramtier, "SHM", str(shm))


def _dead_holders_copy(directory, template, pid, name="good5.fdl") -> str:
    """What a SIGKILLed holder leaves for ``directory``: a whole RAM copy ``name`` and
    its mark, no longer locked. The copy's RAM path."""
    ram = ramtier.ram_path(os.path.join(directory, name), create=True)
    shutil.copyfile(template, ram)
    shutil.copyfile(meta_path(str(template)), meta_path(ram))
    open(os.path.join(os.path.dirname(ram), f".owner-{pid}"), "w").close()
    return ram


# the package registered, its __init__ (torch: seconds) never run, as the sidecar does
_NO_TORCH = ("import sys, importlib.util as u; s = u.find_spec('snapsvc'); "
             "sys.modules['snapsvc'] = u.module_from_spec(s)\n")
_ADOPTER = _NO_TORCH + r"""
import time
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
        tmp_path, template, dead_pid, own_root):
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


_LINGERING = ("import os, signal, sys, torch, snapsvc\n"
              "w = snapsvc.SnapshotWriter(sys.argv[1], linger=60)\n"
              "w.submit({'w': torch.arange(4096.0), 'step': 1}, 'm1.fdl',\n"
              "         persist=False).result(30)\n"
              "print(w.pid, flush=True)\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")


@pytest.mark.timeout(120)
def test_a_killed_holders_copies_go_once_its_directory_is_gone(tmp_path, no_leaks):
    """A trainer SIGKILLed, then its lingering sidecar SIGKILLed too (nothing could free
    its RAM copy), then its directory deleted: the next writer of any directory sweeps
    the dead holder's folder away, copy, marks and all."""
    gone = tmp_path / "gone"
    gone.mkdir()
    with tempfile.TemporaryFile() as out:   # a file: the lingering sidecar inherits it
        run = subprocess.run([sys.executable, "-c", _LINGERING, str(gone)], cwd=ROOT, env=ENV,
                             stdout=out, stderr=subprocess.DEVNULL, timeout=60)
        out.seek(0)
        text = out.read().decode()
    assert run.returncode == -signal.SIGKILL, text
    sidecar = int(text.split()[-1])
    folder = os.path.dirname(ramtier.held(gone / "m1.fdl"))
    os.kill(sidecar, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{sidecar}") and time.monotonic() < deadline:
        time.sleep(0.05)
    shutil.rmtree(gone)
    assert os.listdir(folder)   # left behind: the copy and the dead sidecar's mark
    other = tmp_path / "other"
    with snapsvc.SnapshotWriter(other) as w:
        w.submit({"w": torch.arange(8.0)}, "d1.fdl").result(60)   # its sidecar has started
        assert not os.path.lexists(folder)


_HOLDER = (_NO_TORCH +
           "from snapsvc.files import ramtier\n"
           "path = sys.argv[1] + '/a1.fdl'\n"
           "ram = ramtier.ram_path(path, create=True)\n"
           "ramtier.claim(ram, path)\n"
           "open(ram, 'w').write('held')\n"
           "print(ram, flush=True)\n"
           "sys.stdin.read()\n")


@pytest.mark.timeout(60)
def test_the_sweep_removes_only_what_no_live_process_holds(tmp_path, template, dead_pid):
    """Siblings of the sweep: a live holder's folder stays though its directory is gone;
    a dead holder's copies of a directory that exists stay for its next writer (its
    dead marks go); a folder of dead marks only goes; an empty folder goes once old,
    not while its maker may be about to write in it."""
    live_dir, kept_dir, marks_dir = (tmp_path / n for n in ("live", "kept", "marks"))
    for d in (live_dir, kept_dir, marks_dir):
        d.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(live_dir)], cwd=ROOT, env=ENV,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        live = holder.stdout.readline().strip()
        shutil.rmtree(live_dir)
        kept = _dead_holders_copy(kept_dir, template, dead_pid)
        ramtier.claim(kept, str(kept_dir / "good5.fdl"))   # its record, as a holder makes it
        ramtier.release_marks()
        open(os.path.join(os.path.dirname(kept), f".owner-{dead_pid}"), "w").close()
        marks = os.path.dirname(_dead_holders_copy(marks_dir, template, dead_pid))
        for name in os.listdir(marks):
            if not name.startswith("."):
                os.unlink(os.path.join(marks, name))
        old = os.path.dirname(ramtier.ram_path(tmp_path / "old" / "x", create=True))
        os.utime(old, (time.time() - 120,) * 2)
        fresh = os.path.dirname(ramtier.ram_path(tmp_path / "fresh" / "x", create=True))
        ramtier.sweep()
        assert open(live).read() == "held"
        assert sorted(os.listdir(os.path.dirname(kept))) == [
            ".snapsvc-dir", "good5.fdl", "good5.fdl.meta"]
        assert not os.path.exists(marks) and not os.path.exists(old) and os.path.isdir(fresh)
        got = ramtier.adopt(kept_dir)   # the next writer of that directory takes them
        assert got == [(str(kept_dir / "good5.fdl"), kept)]
        ramtier.drop(kept)
        ramtier.release_marks()
        os.rmdir(fresh)
    finally:
        holder.stdin.close()
        holder.wait(30)
    ramtier.sweep()   # the holder has exited: its folder is a dead one's, directory gone
    assert not os.path.exists(os.path.dirname(live))


_RECEIVING = r"""
import os, sys, time
import torch.distributed as dist
from snapsvc.distributed.replicas.keep import Keeper
from snapsvc.distributed.replicas.send import Replicator
from snapsvc.distributed.replicas.transport import _send_bytes
from snapsvc.format.protocol import pack_value
d, rank = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"file://{sys.argv[3]}", rank=rank, world_size=2)
k = Keeper(d, rank, 2, 2, None)
r = Replicator(d, None, rank, 2, 1, "AB"[rank], 30.0, k)
if rank == 0:   # the origin: step 10's header, then its bytes never come
    _send_bytes(pack_value({"names": ["rank0.fdl", "rank0.fdl.meta"], "sizes": [100, 100],
                            "error": None}), 1, None, 30.0)
    sys.stdin.read()
else:           # the holder: a spare kept from an earlier round, then the receive
    k.reserve([1 << 20])
    print(k.spares()[0], flush=True)
    r._receive(0, 10)
"""


@pytest.mark.timeout(60)
def test_a_replica_holder_killed_mid_receive_leaves_no_temp_or_spare_file(tmp_path):
    """A rank holding replicas SIGKILLed while it receives one: its temp file and its
    spare files go at the next start of any writer (the sweep), though the directory
    stays; while it lives, the sweep leaves them alone."""
    (tmp_path / "step_10").mkdir()
    origin, holder = (subprocess.Popen(
        [sys.executable, "-c", _RECEIVING, str(tmp_path), str(rank), str(tmp_path / "store")],
        cwd=ROOT, env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for rank in (0, 1))
    try:
        spare = holder.stdout.readline().strip()
        deadline, temp = time.monotonic() + 30, ""
        while not os.path.exists(temp) and time.monotonic() < deadline:
            time.sleep(0.05)   # its folder is made as the receive starts
            ram = ramtier.ram_path(replica_file(str(tmp_path), 10, 1, "rank0.fdl"))
            temp = f"{ram}.{holder.pid}.tmp"
        folders = [os.path.dirname(temp), os.path.dirname(spare)]
        ramtier.sweep()   # while it lives: left alone
        assert os.path.exists(temp) and os.path.exists(spare)
        holder.kill()
        holder.wait(30)
    finally:
        for p in (origin, holder):
            p.kill()
            p.wait(30)
    ramtier.sweep()   # what the next sidecar's or service's start does
    assert not any(os.path.lexists(f) for f in folders)


@pytest.mark.parametrize("record", [b"", b"relative/dir", None])
def test_a_dead_holders_copies_stay_when_its_record_is_empty_or_unreadable(
        tmp_path, template, dead_pid, record):
    """A holder killed while it wrote its folder's record (an empty one, as the older
    writer left it), a record that is no absolute path, or the record of a directory
    whose name is no UTF-8: the directory exists, so the sweep keeps its whole copies
    for the next writer to adopt; never a silent loss."""
    directory = tmp_path / "d" if record is not None else Path(os.fsdecode(
        bytes(tmp_path) + b"/caf\xe9"))
    directory.mkdir()
    ram = _dead_holders_copy(directory, template, dead_pid)
    folder = os.path.dirname(ram)
    if record is None:   # the record, as a holder of that directory writes it
        ramtier.claim(ram, os.path.join(directory, "good5.fdl"))
        ramtier.release_marks()
        open(os.path.join(folder, f".owner-{dead_pid}"), "w").close()
    else:
        Path(folder, ".snapsvc-dir").write_bytes(record)
    ramtier.sweep()
    assert sorted(n for n in os.listdir(folder) if not n.startswith(".owner")) == [
        ".snapsvc-dir", "good5.fdl", "good5.fdl.meta"]
    got = ramtier.adopt(directory)
    try:
        assert got == [(os.path.join(directory, "good5.fdl"), ram)]
    finally:
        for _, copy in got:
            ramtier.drop(copy)
        ramtier.release_marks()
    assert not os.path.exists(folder)


_SAME_PID = (_NO_TORCH +   # a process of another container, with the pid of ours
             "import fcntl, os\n"
             "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)\n"
             "fcntl.flock(fd, fcntl.LOCK_EX)\n"
             "print('held', flush=True)\n"
             "sys.stdin.read()\n")


@pytest.mark.timeout(60)
def test_a_live_mark_of_another_container_with_our_pid_is_never_taken_as_ours(tmp_path):
    """Containers sharing /dev/shm: a live process elsewhere holds a mark named by
    our pid (an older version's ``.owner-<pid>``). Our claim neither waits for it to
    exit (holding the folder's lock meanwhile) nor takes it as ours: our release
    leaves it, and the sweep keeps the folder while it lives."""
    ram = ramtier.ram_path(tmp_path / "a1.fdl", create=True)
    folder = os.path.dirname(ram)
    theirs = os.path.join(folder, f".owner-{os.getpid()}")
    other = subprocess.Popen([sys.executable, "-c", _SAME_PID, theirs], cwd=ROOT, env=ENV,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "held"
        done = threading.Event()
        threading.Thread(target=lambda: (ramtier.claim(ram, str(tmp_path / "a1.fdl")),
                                         done.set()), daemon=True).start()
        assert done.wait(10), "claim waited for another process's mark"
        marks = [n for n in os.listdir(folder) if n.startswith(".owner-")]
        assert len(marks) == 2   # theirs and ours, under a name of its own
        ramtier.release_marks()
        ramtier.sweep()
        assert os.path.exists(theirs)   # a live process's: kept, and its folder
    finally:
        other.stdin.close()
        other.wait(30)
    ramtier.sweep()   # it has exited: its folder goes
    assert not os.path.exists(folder)


def test_a_replica_refused_for_memory_limit_leaves_no_ram_folder(tmp_path, no_leaks):
    """A holder short of room (``memory_limit``) refuses step 10's replica: no copy
    lands, and no folder with its mark and record is left in /dev/shm for it."""
    (tmp_path / "step_10").mkdir()
    keeper = Keeper(str(tmp_path), 1, 2, 2, memory_limit=1 << 10)
    keeper.seen.add(10)
    assert "memory_limit=1024" in keeper.room(1 << 20)
    assert ramtier.ram_folder(tmp_path / "step_10" / ".replicas" / "held-by-1") is None


@pytest.mark.parametrize("swap", ["symlink", "file"])
def test_a_ram_folder_swapped_while_it_is_locked_is_refused_by_name(tmp_path, swap, own_root):
    """The directory's RAM folder replaced (by a symlink to a folder elsewhere, or by a
    file) between its check and its opening: refused with UnsafePathError naming it,
    never followed; not a bare OSError."""
    ram = ramtier.ram_path(tmp_path / "a1.fdl", create=True)
    folder = os.path.dirname(ram)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    checked = []

    def swapped(frame, event, arg):
        # right after check_private passed the folder: the swap a race would make
        if event == "return" and frame.f_code.co_name == "check_private" \
                and frame.f_locals.get("path") == folder and not checked:
            checked.append(folder)
            os.rmdir(folder)   # empty: just made
            if swap == "symlink":
                os.symlink(elsewhere, folder)
            else:
                open(folder, "w").close()

    sys.setprofile(swapped)
    try:
        with pytest.raises(snapsvc.errors.UnsafePathError, match=folder):
            ramtier.claim(ram, str(tmp_path / "a1.fdl"))
    finally:
        sys.setprofile(None)
    assert checked and not os.listdir(elsewhere)   # nothing made through the link
    os.unlink(folder)

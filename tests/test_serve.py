"""``snapsvc serve`` (issue 31): the sidecar as a service that outlives its trainers."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

import snapsvc
from snapsvc.files import ramtier, rendezvous
from snapsvc.files.metafile import meta_path

ROOT = Path(__file__).resolve().parents[1]


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(128, 64, generator=g), "step": seed}


def _start(directory, *args: str) -> subprocess.Popen:
    """``python -m snapsvc serve DIRECTORY ...``, once it is registered."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "snapsvc", "serve", str(directory), *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    # its first line, printed once it listens and is registered
    if select.select([proc.stdout], [], [], 30)[0] and proc.stdout.readline().startswith(
            b"snapsvc serve:"):
        return proc
    proc.kill()
    raise AssertionError(f"the service did not start: {proc.communicate(timeout=10)}")


@pytest.fixture
def serve(tmp_path):
    """Start services on demand; each is stopped at the end if still running."""
    procs: list[subprocess.Popen] = []

    def start(*args: str, directory=tmp_path) -> subprocess.Popen:
        procs.append(_start(directory, *args))
        return procs[-1]
    yield start
    for p in procs:
        if p.poll() is None:
            p.terminate()
        try:
            p.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate(timeout=10)


def _alive(proc: subprocess.Popen) -> bool:
    return proc.poll() is None


def _trainer_killed_after_memory_only_submit(directory) -> None:
    code = ("import os, signal, sys, torch, snapsvc\n"
            "g = torch.Generator().manual_seed(7)\n"
            "state = {'w': torch.randn(128, 64, generator=g), 'step': 7}\n"
            "w = snapsvc.SnapshotWriter(sys.argv[1])\n"
            "w.submit(state, 'step7.fdl', persist=False).result(30)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    done = subprocess.run([sys.executable, "-c", code, str(directory)], cwd=ROOT,
                          capture_output=True, timeout=60)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()


@pytest.mark.timeout(90)
def test_two_trainers_in_turn_share_ram_copies_and_keep_last_then_sigterm_cleans_up(tmp_path, no_leaks, serve):
    service = serve("--keep", "2")
    with snapsvc.SnapshotWriter(tmp_path) as w:   # found through the service's record
        assert w.pid == service.pid and w.attached is not None and w.attached.held == []
        w.submit(_state(1), "step1.fdl").result(30)
        w.submit(_state(2), "step2.fdl").result(30)
        report = w.submit(_state(3), "mem3.fdl", persist=False).result(30)
        assert report.in_memory
    assert _alive(service)  # a clean close() leaves the service and its RAM copies
    assert not (tmp_path / "mem3.fdl").exists() and ramtier.held(tmp_path / "mem3.fdl")
    with snapsvc.SnapshotWriter(tmp_path) as w:
        assert w.pid == service.pid and w.attached.held == [str(tmp_path / "mem3.fdl")]
        target = {"w": torch.zeros(128, 64), "step": 0}
        snapsvc.restore(tmp_path / "mem3.fdl", target)
        assert torch.equal(target["w"], _state(3)["w"])
        assert snapsvc.load(tmp_path / "mem3.fdl")["step"] == 3
        # one trainer at a time: a second one is refused and starts its own sidecar
        with snapsvc.SnapshotWriter(tmp_path) as other:
            assert other.pid != service.pid
            other.submit(_state(9), "other.fdl").result(30)
        # keep_last=2 goes on across trainers: step1 is rotated away by step3
        w.submit(_state(3), "step3.fdl").result(30)
        assert sorted(p.name for p in tmp_path.glob("step*.fdl")) == ["step2.fdl", "step3.fdl"]
    assert _alive(service)
    # SIGTERM ends it: no process, socket, record or /dev/shm folder is left (no_leaks too)
    sock, ram = rendezvous.service_socket(str(tmp_path)), ramtier.held(tmp_path / "mem3.fdl")
    assert sock is not None and ram is not None
    service.send_signal(signal.SIGTERM)
    assert service.wait(20) == 0
    assert not os.path.exists(sock) and rendezvous.service_socket(str(tmp_path)) is None
    assert not os.path.exists(os.path.dirname(ram))
    assert os.path.exists(meta_path(tmp_path / "step3.fdl"))  # durable writes stay
    with snapsvc.SnapshotWriter(tmp_path) as w:  # nothing registered: a sidecar as ever
        assert w.attached is None and w.pid != service.pid
        w.submit(_state(4), "step4.fdl").result(30)


@pytest.mark.timeout(90)
def test_a_killed_trainer_leaves_the_service_up_for_the_next(tmp_path, serve):
    short = tempfile.mkdtemp(prefix="svc", dir="/tmp")  # a Unix socket path is short
    try:
        sock = os.path.join(short, "s.sock")
        service = serve("--socket", sock)
        assert rendezvous.service_socket(str(tmp_path)) == sock
        _trainer_killed_after_memory_only_submit(tmp_path)
        time.sleep(0.3)
        assert _alive(service)
        with snapsvc.SnapshotWriter(tmp_path, service=sock) as w:
            assert w.pid == service.pid
            assert w.attached.held == [str(tmp_path / "step7.fdl")]
            assert torch.equal(snapsvc.load(tmp_path / "step7.fdl")["w"], _state(7)["w"])
            w.submit(_state(8), "step8.fdl").result(30)
        assert _alive(service)
    finally:
        for name in os.listdir(short):
            os.unlink(os.path.join(short, name))
        os.rmdir(short)


@pytest.mark.timeout(90)
def test_service_killed_fails_pending_handles_and_the_next_submit_recovers(tmp_path, serve):
    service = serve()
    with snapsvc.SnapshotWriter(tmp_path, slots=1) as w:
        w.submit(_state(1), "a1.fdl").result(30)    # its slot is registered with the service
        os.kill(service.pid, signal.SIGSTOP)
        handle = w.submit(_state(2), "a2.fdl")      # queued, never written
        os.kill(service.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(snapsvc.BrokenWriterError, match="service"):
            handle.result(30)
        assert time.monotonic() - started < 5
        report = w.submit(_state(3), "a3.fdl").result(30)   # a sidecar of its own now
        assert not report.in_memory and w.pid != service.pid
        assert torch.equal(snapsvc.load(tmp_path / "a3.fdl")["w"], _state(3)["w"])
        # a service back on the directory: the next restart re-attaches to it
        again = serve()
        own = w.pid
        os.kill(own, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{own}") and time.monotonic() < deadline:
            with open(f"/proc/{own}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.05)
        w.submit(_state(4), "a4.fdl").result(30)
        assert w.pid == again.pid


@pytest.mark.timeout(30)
def test_service_path_with_nothing_listening_names_it(tmp_path):
    missing = tmp_path / "none.sock"
    w = snapsvc.SnapshotWriter(tmp_path, service=missing)
    with pytest.raises(snapsvc.BrokenWriterError, match=str(missing)):
        w.start()
    w.close()


SYSTEM_PY = "/usr/bin/python3"  # one a second uid may run (the venv's may sit under /root)


def _as_nobody() -> None:
    os.setgid(65534)
    os.setuid(65534)


@pytest.mark.timeout(60)
@pytest.mark.skipif(os.getuid() != 0 or not os.path.exists(SYSTEM_PY),
                    reason="switching to a second uid needs root and a system python")
def test_only_the_same_uid_gets_in_on_either_end(tmp_path, serve):
    short = tempfile.mkdtemp(prefix="svc", dir="/tmp")
    try:
        os.chmod(short, 0o777)
        sock = os.path.join(short, "s.sock")
        service = serve("--socket", sock)
        os.chmod(sock, 0o666)  # past the file's mode: the service's SO_PEERCRED check decides
        code = ("import socket, sys; s = socket.socket(socket.AF_UNIX); s.settimeout(5); "
                "s.connect(sys.argv[1]); print(repr(s.recv(1)))")
        out = subprocess.run([SYSTEM_PY, "-c", code, sock], preexec_fn=_as_nobody,
                             capture_output=True, timeout=30)
        assert out.stdout.strip() == b"b''", out  # hung up on at once, not served
        assert _alive(service)
        # the trainer's end: a socket served by another uid is refused, never used
        other = os.path.join(short, "other.sock")
        listener = subprocess.Popen(
            [SYSTEM_PY, "-c", "import socket, sys, time; s = socket.socket(socket.AF_UNIX);"
             " s.bind(sys.argv[1]); s.listen(); print('up', flush=True); time.sleep(60)", other],
            preexec_fn=_as_nobody, stdout=subprocess.PIPE)
        try:
            assert listener.stdout.readline() == b"up\n"
            w = snapsvc.SnapshotWriter(tmp_path, service=other)
            with pytest.raises(snapsvc.UnsafePathError, match="uid 65534"):
                w.start()
            w.close()
        finally:
            listener.kill()
            listener.wait(10)
    finally:
        for name in os.listdir(short):
            os.unlink(os.path.join(short, name))
        os.rmdir(short)


def _lingering_sidecar_left_alone(directory) -> int:
    """A trainer with ``linger`` SIGKILLed after memory-only submits: its sidecar lingers
    with no trainer attached. The sidecar's pid."""
    code = ("import os, signal, sys, torch, snapsvc\n"
            "w = snapsvc.SnapshotWriter(sys.argv[1], linger=60)\n"
            "for name, seed in (('good1.fdl', 1), ('bad2.fdl', 2), ('cut3.fdl', 3)):\n"
            "    g = torch.Generator().manual_seed(seed)\n"
            "    w.submit({'w': torch.randn(128, 64, generator=g), 'step': seed}, name,\n"
            "             persist=False).result(30)\n"
            "print(w.pid, flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    with tempfile.TemporaryFile() as out:   # a file: the lingering sidecar inherits it
        done = subprocess.run([sys.executable, "-c", code, str(directory)], cwd=ROOT,
                              stdout=out, stderr=subprocess.DEVNULL, timeout=60)
        out.seek(0)
        text = out.read().decode()
    assert done.returncode == -signal.SIGKILL, text
    return int(text.split()[-1])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("holder", ["service", "lingering sidecar"])
def test_ram_copies_of_a_holder_killed_with_no_trainer_go_to_the_next_writer(
        tmp_path, no_leaks, serve, holder):
    """A ``snapsvc serve`` (or a lingering sidecar) SIGKILLed while no trainer is
    attached cannot free its RAM copies: the next writer of the directory adopts them,
    serves the whole one and drops the rest, and frees them all when it closes."""
    if holder == "service":
        service = serve()
        with snapsvc.SnapshotWriter(tmp_path) as w:
            assert w.pid == service.pid
            for name, seed in (("good1.fdl", 1), ("bad2.fdl", 2), ("cut3.fdl", 3)):
                w.submit(_state(seed), name, persist=False).result(30)
        pid = service.pid   # a clean close() leaves it holding them, with no trainer
    else:
        pid = _lingering_sidecar_left_alone(tmp_path)
    os.kill(pid, signal.SIGKILL)
    if holder == "service":
        service.wait(10)
    else:   # reparented: gone once its new parent reaps it
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{pid}")
    good, bad, cut = (ramtier.held(tmp_path / n) for n in ("good1.fdl", "bad2.fdl", "cut3.fdl"))
    assert good and bad and cut
    folder = os.path.dirname(good)
    with open(bad, "r+b") as f:   # a damaged copy: one byte flipped mid-file
        f.seek(os.path.getsize(bad) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.unlink(meta_path(cut))   # a copy killed mid-write: its data, no metadata yet
    with snapsvc.SnapshotWriter(tmp_path) as w:
        w.submit(_state(4), "disk4.fdl").result(30)   # its sidecar is up, and has adopted
        assert w.pid != pid
        # the whole copy is served, bit-exact, from RAM (there is no disk copy)
        assert not (tmp_path / "good1.fdl").exists()
        target = {"w": torch.zeros(128, 64), "step": 0}
        assert snapsvc.restore(tmp_path / "good1.fdl", target).state["step"] == 1
        assert torch.equal(target["w"], _state(1)["w"])
        # the damaged and the partial ones are skipped: gone, never served
        assert ramtier.held(tmp_path / "bad2.fdl") is None and not os.path.exists(bad)
        assert not os.path.exists(cut)
        assert snapsvc.latest(tmp_path) in (str(tmp_path / "good1.fdl"),
                                            str(tmp_path / "disk4.fdl"))
        assert sorted(n for n in os.listdir(folder) if not n.startswith(".")) == [
            "good1.fdl", "good1.fdl.meta"]
    # the writer's sidecar freed what it adopted: no folder left (no_leaks checks too)
    assert not os.path.exists(folder)

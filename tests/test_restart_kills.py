"""Issue 31's proofs: trainers SIGKILLed at random points resume bit-exactly from the
RAM tier; resources stay flat over many submits; forks never touch the restart tier."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from snapsvc.files import ramtier, rendezvous

HERE = Path(__file__).resolve().parent


@pytest.mark.timeout(180)
def test_twenty_trainers_sigkilled_at_random_points_each_resume_bit_exact_from_ram(tmp_path):
    seed = int(os.environ.get("SNAPSVC_KILL_SEED", random.randrange(1 << 30)))
    why = f"(seed {seed}: rerun with SNAPSVC_KILL_SEED={seed})"
    d, out = tmp_path / "ckpt", tmp_path / "log.jsonl"
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    with open(tmp_path / "stderr", "w") as err:  # a file: lingering sidecars inherit it
        done = subprocess.run([sys.executable, str(HERE / "restart_kill_script.py"), str(d), "20",
                               str(seed), str(out)], env=env, stdout=subprocess.DEVNULL,
                              stderr=err, timeout=170)
    assert done.returncode == 0, f"{why}: {(tmp_path / 'stderr').read_text()[-3000:]}"
    records = [json.loads(line) for line in out.read_text().splitlines()]
    starts = [r for r in records if "point" in r]
    assert [r["round"] for r in starts] == list(range(20)), why
    handed: dict[int, list[int]] = {}   # the steps each trainer's submit returned for
    tried: dict[int, list[int]] = {}
    for r in records:
        if "submitted" in r:
            handed.setdefault(r["round"], []).append(r["submitted"])
        if "submitting" in r:
            tried.setdefault(r["round"], []).append(r["submitting"])
    ends = {r["round"]: r for r in records if "killed" in r}
    assert all(ends[i]["killed"] and ends[i]["lingering"] for i in range(20)), why
    assert starts[0]["newest"] is None and starts[0]["attached"] is False, why
    newest_handed = 0
    for r in starts[1:]:
        prev = r["round"] - 1
        newest_handed = max([newest_handed, *handed.get(prev, [])])
        where = f"round {r['round']}, killed {starts[prev]['point']} {why}"
        # the sidecar the killed trainer left: attached to, not a new one
        assert isinstance(r["attached"], int) and r["attached"] > 0, where
        # nothing handed over is lost; a submit killed mid-copy may have made it or not
        allowed = {newest_handed, max(tried.get(prev, [0]))}
        assert r["step"] in allowed, f"{where}: restored step {r['step']}, expected {allowed}"
        assert r["exact"] is True, f"{where}: not bit-exact with torch.save's: {r['exact']}"
        if r["newest"] is None:  # every trainer so far killed before a submit returned
            assert r["step"] == 0 and newest_handed == 0, where
            continue
        newest_handed = r["step"]
        on_disk = os.path.exists(r["newest"])
        assert r["from_ram"] or on_disk, where  # a memory-only step is read from RAM
    assert sum(r["from_ram"] for r in starts) >= 10, why   # persist_every=3: most are in RAM
    assert {r["point"] for r in starts} == {"mid-copy", "mid-write", "between"}
    assert records[-1] == {"final": True, "attached": True}, why
    # the last writer closed cleanly: nothing lingers
    assert ramtier.ram_path(d / "x") is None, why
    sock = rendezvous.socket_path(str(d))
    assert sock is None or not os.path.exists(sock), why


# -- flat resources over many submits ----------------------------------------------
import torch  # noqa: E402

import snapsvc  # noqa: E402
from conftest import _shm_entries  # noqa: E402


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def _footprint(pid: int, directory) -> dict[str, int]:
    """What could grow: both processes' RSS and fds, /dev/shm entries, the RAM copies'
    bytes, the checkpoints on disk (not dot names: a temp, or a rotated file being unlinked)."""
    ram = ramtier.ram_path(directory / "x")
    folder = os.path.dirname(ram) if ram is not None else None
    return {"rss": _rss(os.getpid()), "sidecar_rss": _rss(pid),
            "fds": len(os.listdir("/proc/self/fd")), "sidecar_fds": len(os.listdir(f"/proc/{pid}/fd")),
            # this test's segments and its own RAM folder: other folders in the per-user
            # root belong to tests running beside it (and a start's sweep removes them)
            "shm": len({e for e in _shm_entries() if not e.startswith(f"snapsvc-{os.getuid()}/")})
            + (folder is not None and os.path.isdir(folder)),
            "ram_files": len(os.listdir(folder)) if folder else 0,
            "ram_bytes": sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder))
            if folder else 0,
            "disk_files": len([n for n in os.listdir(directory) if not n.startswith(".")])}


@pytest.mark.timeout(120)
def test_rss_shm_and_fds_stay_flat_over_200_submits_with_persist_every(tmp_path, no_leaks):
    state = {"w": torch.randn(512, 512), "opt": {"m": torch.zeros(512, 512)}, "step": 0}  # 2 MiB
    seen = []
    with snapsvc.SnapshotWriter(tmp_path, persist_every=10, keep_last=2, linger=30) as w:
        for step in range(1, 201):
            state["w"].add_(1.0)
            state["step"] = step
            report = w.submit(state, f"step{step}.fdl").result(30)
            assert report.in_memory == (step % 10 != 0)
            if step in (40, 200):   # after warm-up (allocator, pools, first rotations), at the end
                seen.append(_footprint(w.pid, tmp_path))
        assert snapsvc.load(tmp_path / "step200.fdl")["step"] == 200
        assert snapsvc.load(tmp_path / "step199.fdl")["step"] == 199   # held in RAM
    warm, end = seen
    # 160 more submits of a 2 MiB state: a leak of one copy each would be 320 MiB
    for key in ("rss", "sidecar_rss"):
        assert end[key] - warm[key] < 24 << 20, (key, warm, end)
    for key in ("fds", "sidecar_fds", "shm", "ram_files", "disk_files"):
        assert end[key] == warm[key], (key, warm, end)
    assert abs(end["ram_bytes"] - warm["ram_bytes"]) < 1024, (warm, end)  # the names' digits


# -- forks ---------------------------------------------------------------------------
_FORKS = """
import json, os, signal, sys, time, torch, snapsvc
from snapsvc.files import ramtier, rendezvous
d = sys.argv[1]
w = snapsvc.SnapshotWriter(d, linger=30)
w.submit({"w": torch.ones(8), "step": 1}, "step1.fdl", persist=False).result(30)
sidecar = w.pid
out = {}

def child(how):
    pid = os.fork()
    if pid == 0:
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "writer":   # a writer of its own on the same directory: nothing to attach to
            with snapsvc.SnapshotWriter(d, linger=30) as own:
                own.start()
                with open(os.path.join(d, "child.json"), "w") as f:
                    json.dump({"attached": own.attached is not None,
                               "own": own.pid != sidecar}, f)
        sys.exit(0)   # through the interpreter's exit: atexit, the parent's writer's finalizers
    _, status = os.waitpid(pid, 0)
    out[how] = os.WIFSIGNALED(status) and os.WTERMSIG(status)

for how in ("exit", "sigkill", "writer"):
    child(how)
time.sleep(1.0)   # a sidecar that took a child's exit for its trainer's death would linger by now
sock = rendezvous.socket_path(d)
out.update(same=w.pid == sidecar, alive=os.path.exists(f"/proc/{sidecar}"),
           lingering=sock is not None and os.path.exists(sock),
           held=ramtier.held(os.path.join(d, "step1.fdl")) is not None,
           child=json.load(open(os.path.join(d, "child.json"))))
w.submit({"w": torch.ones(8), "step": 2}, "step2.fdl").result(30)
out["after"] = w.pid == sidecar and snapsvc.load(os.path.join(d, "step2.fdl"))["step"]
w.close()
print(json.dumps(out), flush=True)
"""


@pytest.mark.timeout(60)
def test_a_forked_child_never_attaches_lingers_or_stops_the_parents_sidecar(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    done = subprocess.run([sys.executable, "-c", _FORKS, str(tmp_path)], env=env, cwd=HERE,
                          capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out == {"exit": 0, "sigkill": 9, "writer": 0, "same": True, "alive": True,
                   "lingering": False, "held": True,
                   "child": {"attached": False, "own": True}, "after": 2}, done.stderr[-3000:]
    # the parent's clean close: nothing of the directory is left in RAM or on a socket
    assert ramtier.ram_path(tmp_path / "x") is None
    sock = rendezvous.socket_path(str(tmp_path))
    assert sock is None or not os.path.exists(sock)


# -- snapsvc serve SIGKILLed: what it leaves -----------------------------------------
@pytest.mark.timeout(90)
def test_a_sigkilled_service_leaves_nothing_once_its_trainer_closes(tmp_path):
    from test_serve import _start
    service = _start(tmp_path)
    try:
        with snapsvc.SnapshotWriter(tmp_path) as w:
            assert w.pid == service.pid
            w.submit({"w": torch.ones(4), "step": 1}, "m1.fdl", persist=False).result(30)
            service.kill()
            service.wait(10)
            assert snapsvc.load(tmp_path / "m1.fdl")["step"] == 1   # nothing lost meanwhile
            report = w.submit({"w": torch.ones(4), "step": 2}, "m2.fdl", persist=False).result(30)
            assert report.in_memory and w.pid != service.pid   # recovered: a sidecar of its own
            # the new sidecar adopted the dead service's copy: m2 replaces it (keep_in_memory=1)
            assert snapsvc.load(tmp_path / "m2.fdl")["step"] == 2
            assert not os.path.exists(ramtier.ram_path(tmp_path / "m1.fdl"))
        sock = rendezvous.socket_path(str(tmp_path))
        assert ramtier.ram_path(tmp_path / "x") is None   # no /dev/shm entry of the directory
        assert sock is None or not os.path.exists(sock)    # no socket file
        assert rendezvous.service_socket(str(tmp_path)) is None   # no record
    finally:
        if service.poll() is None:
            service.kill()
        service.communicate(timeout=10)
        # what the dead service left: this test's own clean-up
        ram = ramtier.ram_path(tmp_path / "x")
        if ram is not None:
            for name in os.listdir(os.path.dirname(ram)):
                ramtier.drop(os.path.join(os.path.dirname(ram), name))
        for path in (rendezvous.socket_path(str(tmp_path)),
                     rendezvous.socket_path(str(tmp_path), suffix=".service")):
            if path is not None and os.path.exists(path):
                os.unlink(path)


# -- restore from RAM: straight from the checked mapping --------------------------------
@pytest.mark.timeout(60)
def test_a_restore_from_ram_copies_from_the_mapping_and_the_optimizer_owns_its_state(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    expected = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                "opt": opt.state_dict()}
    with snapsvc.SnapshotWriter(tmp_path) as w:
        w.submit({"model": model, "opt": opt, "w": torch.arange(8.0)}, "s1.fdl",
                 persist=False).result(30)
        torch.manual_seed(1)
        live = torch.nn.Linear(64, 64)
        live_opt = torch.optim.AdamW(live.parameters())
        w_live = torch.zeros(8)
        snapsvc.restore(tmp_path / "s1.fdl", {"model": live, "opt": live_opt, "w": w_live})
    # the RAM copy is gone with its sidecar; what was restored stays, and is the saved state
    assert ramtier.held(tmp_path / "s1.fdl") is None
    assert all(torch.equal(v, expected["model"][k]) for k, v in live.state_dict().items())
    assert torch.equal(w_live, torch.arange(8.0))
    # its own memory, not a view of the mapped RAM copy (which it would pin while it lives)
    with open("/proc/self/maps") as f:
        mapped = [tuple(int(x, 16) for x in line.split()[0].split("-"))
                  for line in f if "/dev/shm/snapsvc-" in line]
    for p, state in live_opt.state.items():
        for key, t in state.items():
            assert not any(lo <= t.data_ptr() < hi for lo, hi in mapped), key
    saved = expected["opt"]["state"]
    assert all(torch.equal(live_opt.state_dict()["state"][i][k], saved[i][k])
               for i in saved for k in saved[i])


class _Interrupting:
    """A stateful object whose load_state_dict sends this process a SIGINT (a Ctrl-C mid-restore)."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.n = sd["n"]
        os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.timeout(60)
def test_a_ctrl_c_mid_restore_lands_once_the_restore_is_whole(tmp_path):
    """The tensor copies keep no undo copy (they cannot fail): a KeyboardInterrupt
    between two of them would leave half a state, so it waits for the end."""
    saved = {"obj": _Interrupting(), "a": torch.full((1 << 16,), 1.0), "b": torch.full((8,), 2.0)}
    saved["obj"].n = 5
    with snapsvc.SnapshotWriter(tmp_path) as w:
        w.submit(saved, "s.fdl", persist=False).result(30)
        live = {"obj": _Interrupting(), "a": torch.zeros(1 << 16), "b": torch.zeros(8)}
        with pytest.raises(KeyboardInterrupt):
            snapsvc.restore(tmp_path / "s.fdl", live)
    assert live["obj"].n == 5 and torch.equal(live["a"], saved["a"]) \
        and torch.equal(live["b"], saved["b"])
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler   # put back

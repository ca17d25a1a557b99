"""The sidecar starts clean: it never imports the user's ``__main__``.

Each test runs a small training script in a fresh interpreter, the way a user
would: from ``python -c``, from a pipe into ``python -`` (what a REPL or a
notebook cell amounts to: a ``__main__`` that is no importable file), or as a
script file with and without the ``if __name__ == "__main__"`` guard. The
script's top level prints a marker and imports a module that logs which
process imported it: only the trainer may ever run either. Start time itself
is a figure of ``benchmarks/stall.py``, never asserted here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import snapsvc

pytestmark = pytest.mark.timeout(240)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(snapsvc.__file__)))
RUN_S = 200  # two interpreters importing torch on a loaded 2-core box

# Stands for a heavy import (transformers, lightning): it records the pid of
# every process that imports it.
SLOW_MODULE = """
import os
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "imported_by.txt"), "a") as f:
    f.write(f"{os.getpid()}\\n")
"""

BODY = """
import os
import torch
import snapsvc
w = snapsvc.SnapshotWriter({ckpt!r})
w.submit(torch.nn.Linear(3, 2), "c.fdl", epoch=4).result(timeout=120)
print("SIDECAR", w.pid, flush=True)
w.close()
print("DONE", os.getpid(), flush=True)
"""

TOP = """
import slow_module_marker
print("TOP-LEVEL RAN AS", __name__, flush=True)
"""


def run(args: list[str], cwd, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, str(cwd)])}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, input=stdin,
                          capture_output=True, text=True, timeout=RUN_S)


def check(proc: subprocess.CompletedProcess, tmp_path) -> None:
    """The script wrote its checkpoint, ran its top level once, and only the
    trainer imported the script's imports."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert snapsvc.verify(tmp_path / "ck" / "c.fdl").ok
    assert snapsvc.load_snapshot(tmp_path / "ck" / "c.fdl").epoch == 4
    lines = proc.stdout.splitlines()
    done = [int(x.split()[1]) for x in lines if x.startswith("DONE")]
    sidecar = [int(x.split()[1]) for x in lines if x.startswith("SIDECAR")]
    assert len(done) == 1 and len(sidecar) == 1 and sidecar != done, out
    assert [x for x in lines if x.startswith("TOP-LEVEL")] == ["TOP-LEVEL RAN AS __main__"], out
    importers = (tmp_path / "imported_by.txt").read_text().split()
    assert importers == [str(done[0])], f"imported by {importers}; trainer {done[0]}, " \
                                        f"sidecar {sidecar[0]}\n{out}"


def script(tmp_path, guard: bool) -> str:
    (tmp_path / "slow_module_marker.py").write_text(SLOW_MODULE)
    body = BODY.format(ckpt=str(tmp_path / "ck"))
    if guard:
        body = "def main():\n" + textwrap.indent(body, "    ") \
            + '\n\nif __name__ == "__main__":\n    main()\n'
    return TOP + body


@pytest.mark.parametrize("how", ["-c", "stdin"])
def test_an_unguarded_script_from_python_c_or_a_pipe_writes_a_checkpoint(tmp_path, how):
    code = script(tmp_path, guard=False)
    if how == "-c":
        proc = run(["-c", code], tmp_path)
    else:
        proc = run(["-"], tmp_path, stdin=code)
    check(proc, tmp_path)


@pytest.mark.parametrize("guard", [False, True], ids=["unguarded", "guarded"])
def test_a_script_file_runs_its_top_level_once(tmp_path, guard):
    """Unguarded, a re-import would start a writer inside the sidecar; guarded,
    it still re-runs the top level and its heavy imports there."""
    path = tmp_path / "train.py"
    path.write_text(script(tmp_path, guard))
    check(run([str(path)], tmp_path), tmp_path)


def test_a_module_run_with_python_m_runs_its_top_level_once(tmp_path):
    (tmp_path / "train_mod.py").write_text(script(tmp_path, guard=False))
    check(run(["-m", "train_mod"], tmp_path), tmp_path)


@pytest.mark.usefixtures("no_leaks")
def test_the_sidecar_never_imports_torch(tmp_path):
    """It answers READY within a bare interpreter's start and writes every kind
    of file without torch (start time, memory, CPU: benchmarks/sidecar_cost.py):
    a model with its optimizer state, gzip, keep_last's rotation, and a nested
    state with a bool tensor (the data file). Both the Python module and the
    shared library are checked, after the last write."""
    import functools

    import torch

    import hooks
    from snapsvc.files.meta import data_path, optim_path
    record = tmp_path / "torch-seen"
    hook = functools.partial(hooks.note_torch, str(record))
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(net.parameters())
    net(torch.ones(1, 3)).sum().backward()
    opt.step()
    state = {"model": net, "optimizer": opt, "mask": torch.tensor([True, False]), "step": 3}
    with snapsvc.SnapshotWriter(tmp_path, fault_hook=hook, keep_last=1) as w:
        assert record.read_text() == "start False"
        for i in (1, 2):
            w.submit(net, f"m{i}.fdl.gz", epoch=i, optimizer=opt).result(timeout=120)
        w.submit(state, "s.fdl").result(timeout=120)
        stage, seen = record.read_text().split()
        assert stage != "start" and seen == "False"  # as the last write ended
        with open(f"/proc/{w.pid}/maps") as f:
            assert "libtorch" not in f.read()
    assert os.path.exists(optim_path(tmp_path / "m2.fdl.gz"))
    assert not os.path.exists(tmp_path / "m1.fdl.gz")  # keep_last=1
    assert os.path.exists(data_path(tmp_path / "s.fdl"))
    assert snapsvc.load_snapshot(tmp_path / "m2.fdl.gz").epoch == 2
    back = snapsvc.load(tmp_path / "s.fdl")
    assert torch.equal(back["mask"], state["mask"]) and back["step"] == 3


@pytest.mark.parametrize("method", ["spawn", "fork", "forkserver"])
def test_start_method_is_still_accepted_and_says_it_is_ignored(tmp_path, method):
    with pytest.warns(DeprecationWarning, match="start_method"):
        w = snapsvc.SnapshotWriter(tmp_path, start_method=method)
    w.close()

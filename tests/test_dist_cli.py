"""Distributed checkpoints from the command line, and what the messages say (issue 21, 12-15).

One spawned gloo world of 1 rank (tests/dist_world.py) saves two multi-rank
checkpoints: ``step_1`` from an FSDP2-sharded model with Adam, ``step_2`` from a
plain one. Then, in this process:

- 12: ``snapsvc consolidate STEP out.safetensors`` / ``out.pt`` writes that format;
- 13: a corrupt ``rank0.fdl.meta`` fails ``restore_distributed`` before anything changes;
- 14: a missing checkpoint, step directory or destination directory is named as such;
- 15: ``snapsvc verify STEP_DIR`` checks the manifest and every rank's files;
  ``snapsvc verify step_N/*`` passes; ``snapsvc bench`` fails when every cell failed;
- Hardening 3, 20: ``snapsvc ls`` lists each complete step as one checkpoint.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys

import pytest
import torch
from torch import nn

import snapsvc
from dist_world import run_world
from snapsvc.cli import main
from snapsvc.errors import FormatError

pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 needs torch.distributed")
pytestmark = [pytest.mark.timeout(150)]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _plain(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    torch.manual_seed(5)
    model(torch.randn(3, 4)).square().mean().backward()
    opt.step()


def scenario_save(rank: int, world: int, tmp: str) -> dict:
    from torch.distributed.fsdp import fully_shard
    sharded = _plain(0)
    fully_shard(sharded)
    opt = torch.optim.Adam(sharded.parameters(), lr=0.01)
    _train(sharded, opt)
    plain = _plain(1)
    popt = torch.optim.Adam(plain.parameters(), lr=0.01)
    _train(plain, popt)
    ckpt = os.path.join(tmp, "ckpt")
    with snapsvc.DistributedSnapshotWriter(ckpt, coord_timeout=60) as w:
        w.submit(sharded, 1, optimizer=opt, epoch=1).result(timeout=60)
        w.submit(plain, 2, optimizer=popt, epoch=2).result(timeout=60)
        # moved away (SnapsvcTrainer renames each to checkpoint-<N>), then saved again,
        # as a trainer resumed from an earlier checkpoint does (issue 21, 8)
        os.rename(os.path.join(ckpt, "step_2"), os.path.join(tmp, "moved_step_2"))
        w.submit(plain, 2, optimizer=popt, epoch=2).result(timeout=60)
        try:   # committed, and still there: its files must not change under its manifest
            w.submit(plain, 1, optimizer=popt)
            refused = None
        except ValueError as e:
            refused = str(e)
    return {"ok": True, "refused": refused}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("world1")
    codes, results = run_world(tmp, 1, scenario_save)
    assert codes == [0] and results[0]["ok"]
    return tmp, results[0]


@pytest.fixture
def world1(world):
    return world[0] / "ckpt"


def test_a_step_is_saved_again_once_resolved_unless_committed(world):
    tmp, result = world
    assert (tmp / "ckpt" / "step_2" / "manifest.msgpack").exists()
    assert result["refused"] is not None and "complete checkpoint" in result["refused"]


def _copy(world1, tmp_path):
    shutil.copytree(world1, tmp_path / "ckpt")
    return tmp_path / "ckpt"


# -- 12 -----------------------------------------------------------------------------
def test_consolidate_writes_the_format_its_suffix_names(world1, tmp_path):
    step = str(world1 / "step_1")
    assert main(["consolidate", step, str(tmp_path / "whole.fdl")]) == 0
    want = {n: t for n, t in snapsvc.read_checkpoint(tmp_path / "whole.fdl").entries.items()}
    assert len(want) == 4
    safetensors = pytest.importorskip("safetensors.torch")
    assert main(["consolidate", step, str(tmp_path / "whole.safetensors")]) == 0
    got = safetensors.load_file(str(tmp_path / "whole.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    assert main(["consolidate", step, str(tmp_path / "whole.pt")]) == 0
    got = torch.load(tmp_path / "whole.pt", weights_only=True)
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


def test_consolidate_draws_progress_only_on_a_terminal(world1, tmp_path, monkeypatch, capsys):
    import io

    class TTY(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = TTY()
    monkeypatch.setattr(sys, "stderr", tty)
    assert main(["consolidate", str(world1 / "step_1"), str(tmp_path / "a.fdl")]) == 0
    assert "reading:" in tty.getvalue() and "writing:" in tty.getvalue()   # tqdm's bars
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert main(["consolidate", str(world1 / "step_1"), str(tmp_path / "b.fdl")]) == 0
    assert sys.stderr.getvalue() == ""
    assert capsys.readouterr().out.split() == [str(tmp_path / "a.fdl"), str(tmp_path / "b.fdl")]


def test_consolidate_refuses_a_suffix_it_cannot_write(world1, tmp_path, capsys):
    assert main(["consolidate", str(world1 / "step_1"), str(tmp_path / "whole.bin")]) == 2
    assert "whole.bin" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


# -- 13 -----------------------------------------------------------------------------
@pytest.mark.parametrize("step", [1, 2], ids=["sharded", "plain"])
def test_corrupt_rank_metadata_fails_restore_before_anything_changes(world1, tmp_path, step):
    ckpt = _copy(world1, tmp_path)
    meta = ckpt / f"step_{step}" / "rank0.fdl.meta"
    data = bytearray(meta.read_bytes())
    data[-3] ^= 0xFF   # inside the packed fields: their CRC-32 no longer matches
    meta.write_bytes(bytes(data))
    model = _plain(7)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _train(model, opt)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt_before = opt.state_dict()
    opt_before = {i: {k: v.clone() for k, v in s.items()} for i, s in opt_before["state"].items()}
    with pytest.raises(FormatError, match="rank0.fdl.meta"):
        snapsvc.restore_distributed(ckpt / f"step_{step}", model, opt)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed by a restore that failed"
    for i, s in opt.state_dict()["state"].items():
        for k, v in s.items():
            assert torch.equal(v, opt_before[i][k]), f"optimizer state {i}/{k} changed"


# -- 14 -----------------------------------------------------------------------------
def test_a_missing_checkpoint_is_not_called_an_unfinished_write(tmp_path):
    missing = tmp_path / "nowhere.fdl"
    for call in (lambda: snapsvc.load(missing), lambda: snapsvc.restore(missing, nn.Linear(2, 2))):
        with pytest.raises(FileNotFoundError) as e:
            call()
        assert "unfinished" not in str(e.value) and str(missing) in str(e.value)
    # a checkpoint file without its metadata is still an unfinished write
    snapsvc.save_checkpoint(tmp_path / "half.fdl", {"w": torch.ones(2)})
    with pytest.raises(FormatError, match="unfinished write"):
        snapsvc.load(tmp_path / "half.fdl")


def test_the_lightning_plugin_reports_a_missing_path_as_stock_does(tmp_path):
    pytest.importorskip("lightning")
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    from snapsvc.lightning import SnapsvcCheckpointIO
    missing = str(tmp_path / "epoch=0.ckpt")
    with pytest.raises(FileNotFoundError):   # the control
        TorchCheckpointIO().load_checkpoint(missing)
    with pytest.raises(FileNotFoundError) as e:
        SnapsvcCheckpointIO().load_checkpoint(missing)
    assert "unfinished" not in str(e.value) and missing in str(e.value)


def test_consolidate_and_verify_of_a_missing_step_directory_say_so(tmp_path, capsys):
    missing = str(tmp_path / "step_9")
    assert main(["consolidate", missing, str(tmp_path / "x.fdl")]) == 1
    err = capsys.readouterr().err
    assert "still running" not in err and "incomplete" not in err and missing in err
    assert "no such" in err.lower() or "not found" in err.lower() or "does not exist" in err


@pytest.mark.parametrize("dest", ["nodir/out.safetensors", "adir.fdl"])
def test_a_bad_destination_is_named_not_a_temp_file(world1, tmp_path, capsys, dest):
    (tmp_path / "adir.fdl").mkdir()
    src = tmp_path / "src.fdl"
    snapsvc.save_checkpoint(src, {"w": torch.ones(2)})
    target = str(tmp_path / dest)
    for argv in (["convert", str(src), target], ["consolidate", str(world1 / "step_1"), target]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert "snapsvc-tmp" not in err, err
        assert os.path.dirname(target) in err or target in err, err
    with pytest.raises(OSError) as e:
        snapsvc.save_checkpoint(target, {"w": torch.ones(2)})
    assert "snapsvc-tmp" not in str(e.value)


# -- 15 -----------------------------------------------------------------------------
@pytest.mark.parametrize("step", [1, 2], ids=["sharded", "plain"])
def test_verify_a_step_directory_checks_the_whole_checkpoint(world1, tmp_path, capsys, step):
    ckpt = _copy(world1, tmp_path)
    d = ckpt / f"step_{step}"
    assert main(["verify", str(d)]) == 0
    out = capsys.readouterr().out
    assert "manifest.msgpack" in out and "rank0.fdl" in out
    # every file of the step, as a shell glob gives them
    assert main(["verify", *sorted(glob.glob(str(d / "*")))]) == 0, capsys.readouterr()
    capsys.readouterr()
    # a rank file changed after the commit fails the step
    rank0 = d / "rank0.fdl"
    data = bytearray(rank0.read_bytes())
    data[-1] ^= 0xFF
    rank0.write_bytes(bytes(data))
    assert main(["verify", str(d)]) == 1
    assert "rank0.fdl" in capsys.readouterr().out


def test_verify_a_step_directory_without_its_manifest_fails(world1, tmp_path, capsys):
    ckpt = _copy(world1, tmp_path)
    os.remove(ckpt / "step_2" / "manifest.msgpack")
    assert main(["verify", str(ckpt / "step_2")]) == 1
    assert "manifest" in capsys.readouterr().out


# -- Hardening 3, 20 --------------------------------------------------------------------
def test_ls_lists_each_complete_step_as_one_checkpoint(world1, tmp_path, capsys):
    """A DistributedSnapshotWriter directory, and a copy as its remote tier: each step is
    one checkpoint with its step, the bytes of all its files, metrics and tiers; step 2,
    its manifest removed locally, is incomplete there and listed on the remote only, as a
    file without its .meta is not listed. Before, each rank<r>.fdl was listed on its own,
    with its rank as its step, incomplete steps too."""
    ckpt = _copy(world1, tmp_path)
    remote = tmp_path / "remote"
    shutil.copytree(ckpt, remote)
    os.remove(ckpt / "step_2" / "manifest.msgpack")
    capsys.readouterr()
    assert main(["ls", str(ckpt), "--remote", str(remote), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["checkpoints"]
    assert [(c["name"], c["step"], c["tiers"]) for c in listed] == [
        ("step_2", 2, ["remote"]), ("step_1", 1, ["local", "remote"])]
    assert listed[1]["bytes"] == sum(p.stat().st_size for p in (ckpt / "step_1").iterdir())
    assert listed[1]["metrics"] == {} and listed[1]["created"] > 0
    assert main(["ls", str(ckpt)]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    assert len(rows) == 1 and rows[0].split()[:2] == ["step_1", "1"], rows
    assert main(["ls", str(ckpt / "step_1"), "--json"]) == 0   # the step directory itself
    assert [(c["name"], c["step"]) for c in json.loads(capsys.readouterr().out)[
        "checkpoints"]] == [(".", 1)]


@pytest.mark.timeout(120)
def test_bench_fails_when_every_cell_failed(tmp_path, capfd, monkeypatch):
    # in this process: the benchmark is a process of its own (its workers import this tree)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    code = main(["bench", "--plot", str(tmp_path / "p.png"), "--json", str(tmp_path / "j.json"),
                 "--", "--models", "nosuch", "--methods", "torch.save", "--writer-model", "none",
                 "--reps", "1", "--start-reps", "0",   # no sidecar-start timing: not a cell
                 "--dir", str(tmp_path)])
    out = capfd.readouterr().out
    assert "ERROR" in out
    assert code == 1, out[-2000:]

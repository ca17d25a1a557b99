"""Reads over the restart tier (issue 31): ``snapsvc.latest`` with a remote URL, and
the CLI (``inspect``, ``verify``, ``ls``) and ``restore_distributed`` reading RAM copies."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import snapsvc
from snapsvc.files import ramtier
from snapsvc.files.metafile import meta_path

pytest_plugins = ["remote_fixtures"]  # s3: skipped without obstore, moto or boto3


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "step": seed}


def _flip(path: str) -> None:
    """Flip one byte in the middle of ``path`` (its tensor data)."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.timeout(90)
def test_latest_across_ram_disk_and_s3_ties_to_the_fastest_and_skips_a_bad_ram_copy(s3, tmp_path):
    d = tmp_path / "ckpt"
    url = s3.url
    with snapsvc.SnapshotWriter(d, remote=url) as w:
        assert snapsvc.latest(d, remote=url) is None
        w.submit(_state(2), "step2.fdl").uploaded(60)
        w.submit(_state(3), "step3.fdl", persist=False).result(30)
        assert snapsvc.latest(d, remote=url) == str(d / "step3.fdl")   # RAM holds the newest
        for suffix in ("", ".meta"):   # the remote tier alone holds a newer step
            s3.write(f"step5.fdl{suffix}", s3.read(f"step2.fdl{suffix}"))
        assert snapsvc.latest(d, remote=url) == f"{url}/step5.fdl"
        assert snapsvc.latest(d) == str(d / "step3.fdl")
        for suffix in ("", ".meta"):
            s3.client.delete_object(Bucket=s3.bucket, Key=f"{s3.prefix}/step5.fdl{suffix}")
        s3.write("step6.fdl", s3.read("step2.fdl"))   # no .meta: incomplete, never the answer
        # step4 on disk and remote, and a newer copy of it in RAM: a tie, RAM's path wins
        w.submit(_state(4), "step4.fdl").uploaded(60)
        assert snapsvc.latest(d, remote=url) == str(d / "step4.fdl")   # disk and remote: disk
        w.submit(_state(44), "step4.fdl", persist=False).result(30)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            newest = snapsvc.latest(d, remote=url)
            assert newest == str(d / "step4.fdl") and snapsvc.load(newest)["step"] == 44
        # a bad RAM copy is skipped: the disk copy is next
        _flip(ramtier.held(d / "step4.fdl"))
        with pytest.warns(RuntimeWarning, match="RAM copy of .*step4.fdl is bad"):
            newest = snapsvc.latest(d, remote=url)
        assert newest == str(d / "step4.fdl")
        with pytest.warns(RuntimeWarning, match="reading it from disk"):
            assert snapsvc.load(newest)["step"] == 4
        # with the disk copy gone too, the remote one
        for p in (d / "step4.fdl", meta_path(d / "step4.fdl")):
            os.unlink(p)
        with pytest.warns(RuntimeWarning, match="RAM copy of .*step4.fdl is bad"):
            newest = snapsvc.latest(d, remote=url)
        assert newest == f"{url}/step4.fdl"
        assert snapsvc.load(newest)["step"] == 4



def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.timeout(120)
def test_restore_distributed_reads_a_held_ram_copy_of_a_rank_file_and_falls_back(world1, tmp_path):
    d = tmp_path / "ckpt"
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    with snapsvc.DistributedSnapshotWriter(d, coord_timeout=60) as w:
        w.submit(model, 1).result(60)
    step, rank = d / "step_1", d / "step_1" / "rank0.fdl"
    good = rank.read_bytes()
    with snapsvc.SnapshotWriter(step) as w:
        w.submit(model, "rank0.fdl", persist=False).result(30)   # the RAM tier holds a copy
        ram = ramtier.held(rank)
        assert ram is not None
        _flip(str(rank))   # only the RAM copy can restore it now
        back = torch.nn.Linear(8, 4)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            snapsvc.restore_distributed(step, back)
        assert _same(model, back)
        rank.write_bytes(good)
        # a corrupted RAM copy is reported and skipped: the step directory is read
        _flip(ram)
        back = torch.nn.Linear(8, 4)
        with pytest.warns(RuntimeWarning, match=r"RAM copy of .*rank0.fdl is bad .*crc32"):
            snapsvc.restore_distributed(step, back)
        assert _same(model, back)
        # a RAM copy without its .meta is not held: the step directory, without a word
        os.unlink(meta_path(ram))
        _flip(ram)   # good bytes again, but no metadata vouches for them
        back = torch.nn.Linear(8, 4)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            snapsvc.restore_distributed(step, back)
        assert _same(model, back)
        # a good copy that is not the committed one (another model) is skipped too
        os.unlink(ram)
        w.submit(torch.nn.Linear(8, 4), "rank0.fdl", persist=False).result(30)
        back = torch.nn.Linear(8, 4)
        with pytest.warns(RuntimeWarning, match="not the committed one .*the manifest says"):
            snapsvc.restore_distributed(step, back)
        assert _same(model, back)


def _cli(capsys, *argv: str) -> tuple[int, str]:
    from snapsvc.cli import main

    code = main([str(a) for a in argv])
    return code, capsys.readouterr().out


@pytest.mark.timeout(60)
def test_cli_inspect_verify_and_ls_read_the_ram_tier_and_fall_back(tmp_path, capsys):
    import json

    d = tmp_path
    with snapsvc.SnapshotWriter(d, keep_in_memory=2) as w:
        w.submit(_state(2), "step2.fdl").result(30)
        w.submit(_state(3), "step3.fdl", persist=False).result(30)   # RAM only
        w.submit(_state(4), "step4.fdl", metrics={"loss": 1.0}).result(30)
        w.submit(_state(44), "step4.fdl", metrics={"loss": 2.0}, persist=False).result(30)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            code, out = _cli(capsys, "inspect", "--json", d / "step4.fdl")
            shown = json.loads(out)
            assert code == 0 and shown["meta"]["metrics"] == {"loss": 2.0}   # the RAM copy
            assert shown["path"] == str(d / "step4.fdl")
            code, out = _cli(capsys, "inspect", d / "step3.fdl")
            assert code == 0 and "tier: RAM" in out and str(d / "step3.fdl") in out
            code, out = _cli(capsys, "verify", d / "step3.fdl", d / "step4.fdl")
            assert code == 0 and "2 of 2 files OK" in out
            code, out = _cli(capsys, "ls", "--json", d)
            rows = json.loads(out)["checkpoints"]
            assert [(r["name"], r["tiers"]) for r in rows] == [
                ("step4.fdl", ["ram"]), ("step4.fdl", ["local"]),   # two copies that differ
                ("step3.fdl", ["ram"]), ("step2.fdl", ["local"])]
            code, out = _cli(capsys, "ls", d)
            assert "ram" in out and "local" in out
        # a corrupted RAM copy: reported, and the disk copy is read
        _flip(ramtier.held(d / "step4.fdl"))
        with pytest.warns(RuntimeWarning, match="RAM copy of .*step4.fdl is bad"):
            code, out = _cli(capsys, "inspect", "--json", d / "step4.fdl")
        assert code == 0 and json.loads(out)["meta"]["metrics"] == {"loss": 1.0}
        with pytest.warns(RuntimeWarning, match="RAM copy of .*step4.fdl is bad"):
            code, out = _cli(capsys, "verify", d / "step4.fdl")
        assert code == 0 and "OK" in out
        with pytest.warns(RuntimeWarning, match="RAM copy of step4.fdl is bad"):
            rows = json.loads(_cli(capsys, "ls", "--json", d)[1])["checkpoints"]
        assert [r["tiers"] for r in rows if r["name"] == "step4.fdl"] == [["local"]]
        # a bad RAM copy with no disk copy: verify fails (exit 1)
        _flip(ramtier.held(d / "step3.fdl"))
        with pytest.warns(RuntimeWarning, match="RAM copy of .*step3.fdl is bad"):
            code, out = _cli(capsys, "verify", d / "step3.fdl")
        assert code == 1
        _flip(ramtier.held(d / "step3.fdl"))   # whole again
        # a RAM copy without its .meta is not held: the disk copy, without a word
        os.unlink(meta_path(ramtier.held(d / "step4.fdl")))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            code, out = _cli(capsys, "inspect", "--json", d / "step4.fdl")
            assert code == 0 and json.loads(out)["meta"]["metrics"] == {"loss": 1.0}
            assert _cli(capsys, "verify", d / "step4.fdl")[0] == 0
            rows = json.loads(_cli(capsys, "ls", "--json", d)[1])["checkpoints"]
            assert {r["name"]: r["tiers"] for r in rows} == {
                "step4.fdl": ["local"], "step3.fdl": ["ram"], "step2.fdl": ["local"]}

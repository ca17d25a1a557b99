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

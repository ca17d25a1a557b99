"""The remote tier's parts against a real S3 server on loopback (moto) and a directory:
the store, the uploader thread and the checked fetch. The writer's use of
them is in tests/test_remote.py."""

from __future__ import annotations

import io
import json
import os
import queue
import shutil
import sys
import time

import pytest
import torch
from torch import nn

import snapsvc
pytest_plugins = ["remote_fixtures"]  # s3, unreachable_s3, fault_proxy, secret

pytest.importorskip("obstore")
from snapsvc.remote import fetched, open_store  # noqa: E402
from snapsvc.remote.fetch import run_sync  # noqa: E402
from snapsvc.remote.store import PART, CorruptSource  # noqa: E402
from snapsvc.remote.upload import Uploader  # noqa: E402

pytestmark = pytest.mark.timeout(120)

FILES = ("step1.fdl", "step2.fdl", "step3.fdl", "best.fdl", "big.fdl")


def _crc(data: bytes) -> int:
    from isal import isal_zlib
    return isal_zlib.crc32(data)


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> str:
    """Checkpoints written by a real writer: a series step1-3 with optimizer
    files, best.fdl, and big.fdl (over one multipart part)."""
    d = tmp_path_factory.mktemp("made")
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    big = nn.Linear(1024, (PART // 4096) + 64)  # a little over PART bytes of weights
    with snapsvc.SnapshotWriter(d) as w:
        for i in (1, 2, 3):
            w.submit(model, f"step{i}.fdl", optimizer=opt, metrics={"loss": 1.0 / i}).result(60)
            time.sleep(0.02)  # distinct .meta mtimes: recovery goes newest first
        w.submit(model, "best.fdl").result(60)
        w.submit(big, "big.fdl").result(60)
    return str(d)


@pytest.fixture
def local(made, tmp_path) -> str:
    d = tmp_path / "local"
    shutil.copytree(made, d)
    return str(d)


class Done:
    """on_done results, in the order the uploader reported them."""

    def __init__(self) -> None:
        self.q: queue.Queue = queue.Queue()

    def __call__(self, job, url, error, skipped) -> None:
        self.q.put((os.path.basename(job.path), url, error, skipped))

    def take(self, n: int, timeout: float = 60) -> list[tuple]:
        return [self.q.get(timeout=timeout) for _ in range(n)]


def _uploader(location, local, done, **kw) -> Uploader:
    kw.setdefault("remote_timeout", 30.0)
    kw.setdefault("options", None)
    kw.setdefault("keep_last", None)
    return Uploader(location, local, on_done=done, **kw)


def test_put_and_ranged_reads_bit_exact(s3, tmp_path):
    """Multipart (several parts) and single PUT; ranged reads back."""
    store = open_store(s3.url)
    data = os.urandom(2 * PART + 12345)
    (tmp_path / "src").write_bytes(data)
    with open(tmp_path / "src", "rb") as f:
        run_sync(store.put("a/big.bin", f, size=len(data), crc32=_crc(data)))
    run_sync(store.put("small.bin", io.BytesIO(b"xyz"), size=3, crc32=_crc(b"xyz")))
    assert s3.keys() == {"a/big.bin": len(data), "small.bin": 3}
    back = b"".join(bytes(run_sync(store.get_range("a/big.bin", at, min(at + PART, len(data)))))
                    for at in range(0, len(data), PART))
    assert back == data
    assert s3.multipart_uploads() == []


@pytest.mark.parametrize("size", [1000, 2 * PART + 7])
def test_put_refuses_bytes_unlike_their_metadata(s3, tmp_path, size):
    """A source whose CRC differs from the one recorded is not stored under the
    final name, and no multipart upload is left behind."""
    data = os.urandom(size)
    with pytest.raises(CorruptSource, match="crc32"):
        run_sync(open_store(s3.url).put("x.fdl", io.BytesIO(data), size=size,
                                        crc32=_crc(data) ^ 1))
    with pytest.raises(CorruptSource, match="bytes"):  # truncated
        run_sync(open_store(s3.url).put("x.fdl", io.BytesIO(data[:-1]), size=size,
                                        crc32=_crc(data)))
    assert s3.keys() == {}
    assert s3.multipart_uploads() == []


def test_only_abandoned_multipart_uploads_of_owned_keys_are_aborted(s3):
    """Begun before ``before`` and owned: aborted; any other (maybe live) is kept,
    at a bucket's root too, where keys are relative to the bucket."""
    for key in ("step9.fdl", "rank1.fdl", "../other/app.bin"):
        s3.client.create_multipart_upload(Bucket=s3.bucket,
                                          Key=os.path.normpath(f"{s3.prefix}/{key}"))
    later = time.time() + 60  # every upload above began before it
    assert run_sync(open_store(s3.url).abort_stale_uploads(0.0, lambda k: True)) == 0
    assert run_sync(open_store(s3.url).abort_stale_uploads(
        later, lambda k: k.startswith("step"))) == 1
    assert sorted(s3.multipart_uploads()) == [f"{s3.prefix}/rank1.fdl", "other/app.bin"]
    root = open_store(f"s3://{s3.bucket}")
    assert run_sync(root.abort_stale_uploads(later, lambda k: k == "other/app.bin")) == 1
    assert s3.multipart_uploads() == [f"{s3.prefix}/rank1.fdl"]


def test_uploader_commits_each_checkpoint_meta_last(s3, local):
    for name in FILES[1:]:
        for p in snapsvc.checkpoint_files(os.path.join(local, name)):
            os.unlink(p)
    done = Done()
    up = _uploader(s3.url, local, done)
    up.start()
    up.enqueue(7, os.path.join(local, "step1.fdl"))
    (name, url, error, skipped), = done.take(1)
    assert (name, url, error, skipped) == ("step1.fdl", f"{s3.url}/step1.fdl", None, False)
    up.close(10)
    assert done.q.empty()  # once: not queued again by the scan at start
    assert sorted(s3.keys()) == ["step1.fdl", "step1.fdl.meta", "step1.optim.fdl"]
    for name in s3.keys():
        assert s3.read(name) == open(os.path.join(local, name), "rb").read()


def test_restart_uploads_what_is_local_only_newest_first(s3, local):
    """Checkpoints durable locally before the uploader started are queued at start;
    with the backlog bounded, the newest go and the oldest are reported skipped."""
    done = Done()
    up = _uploader(s3.url, local, done, backlog=3)
    up.start()
    results = done.take(len(FILES))
    up.close(30)
    uploaded = [r[0] for r in results if r[1]]
    skipped = [r[0] for r in results if r[3]]
    assert uploaded == ["big.fdl", "best.fdl", "step3.fdl"]  # newest first
    assert sorted(skipped) == ["step1.fdl", "step2.fdl"]
    assert all("fell behind" in r[2] for r in results if r[3])
    # a second start finds nothing to do for what is committed, and does the rest
    done2 = Done()
    up2 = _uploader(s3.url, local, done2)
    up2.start()
    assert sorted(r[0] for r in done2.take(2)) == ["step1.fdl", "step2.fdl"]
    up2.close(30)
    assert done2.q.empty()
    assert {f + ".meta" for f in FILES} <= set(s3.keys())


def test_remote_retention_deletes_meta_first_and_keeps_best(s3, local):
    done = Done()
    up = _uploader(s3.url, local, done, keep_last=2, backlog=len(FILES))
    up.start()
    # step1 is not uploaded: the rotation would remove it at once
    assert sorted(r[0] for r in done.take(len(FILES) - 1)) == [
        "best.fdl", "big.fdl", "step2.fdl", "step3.fdl"]
    up.close(30)
    assert done.q.empty()
    keys = set(s3.keys())
    assert {"step2.fdl", "step2.fdl.meta", "step2.optim.fdl", "step3.fdl", "step3.fdl.meta",
            "step3.optim.fdl", "best.fdl", "best.fdl.meta", "big.fdl", "big.fdl.meta"} == keys


def test_unreachable_remote_fails_within_remote_timeout(unreachable_s3, local, secret):
    done = Done()
    up = _uploader(unreachable_s3, local, done, remote_timeout=3.0)
    t0 = time.monotonic()
    up.start()
    up.enqueue(1, os.path.join(local, "best.fdl"))
    (name, url, error, _), = done.take(1, timeout=30)
    elapsed = time.monotonic() - t0
    up.close(5)
    assert url is None and name == "best.fdl"
    assert elapsed < 3.0 + 10  # the deadline, plus a loaded machine's slack
    assert "best.fdl" in error and secret not in error


def test_fetch_checks_every_byte_and_names_the_url(s3, local, tmp_path):
    done = Done()
    up = _uploader(s3.url, local, done, backlog=len(FILES))
    up.start()
    done.take(len(FILES))
    up.close(30)
    with fetched(f"{s3.url}/step2.fdl") as path:
        assert open(path, "rb").read() == open(os.path.join(local, "step2.fdl"), "rb").read()
        assert os.path.exists(snapsvc.checkpoint_files(path)[1])  # the optimizer file too
    assert not os.path.exists(path)
    raw = bytearray(s3.read("step2.optim.fdl"))
    raw[len(raw) // 2] ^= 0x01
    s3.write("step2.optim.fdl", bytes(raw))
    with pytest.raises(snapsvc.FormatError, match="step2.optim.fdl.*crc32"):
        with fetched(f"{s3.url}/step2.fdl"):
            pass
    s3.write("step3.fdl", s3.read("step3.fdl")[:-1])
    with pytest.raises(snapsvc.FormatError, match=r"step3.fdl.*metadata says"):
        with fetched(f"{s3.url}/step3.fdl"):
            pass
    s3.client.delete_object(Bucket=s3.bucket, Key=f"{s3.prefix}/best.fdl.meta")
    with pytest.raises(snapsvc.FormatError, match="no metadata on the remote tier"):
        with fetched(f"{s3.url}/best.fdl"):
            pass


def test_mounted_directory_remote(local, tmp_path):
    remote = tmp_path / "mnt" / "ckpt"
    done = Done()
    up = _uploader(str(remote), local, done, keep_last=1, backlog=len(FILES))
    up.start()
    assert all(r[1] for r in done.take(len(FILES) - 2))  # not step1 nor step2: see above
    up.close(30)
    assert done.q.empty()
    names = sorted(os.listdir(remote))
    assert names == sorted(["best.fdl", "best.fdl.meta", "big.fdl", "big.fdl.meta", "step3.fdl",
                            "step3.fdl.meta", "step3.optim.fdl"])
    for n in names:
        assert (remote / n).read_bytes() == open(os.path.join(local, n), "rb").read()


def test_overwrite_uncommits_the_old_copy_first(s3, local):
    """Re-uploading a name deletes its remote .meta before any data: when the new
    upload fails (here the local file no longer matches its metadata), the old
    .meta is not left beside other bytes, and nothing is read from that name."""
    for name in FILES[:3] + FILES[4:]:
        for p in snapsvc.checkpoint_files(os.path.join(local, name)):
            os.unlink(p)
    done = Done()
    up = _uploader(s3.url, local, done)
    up.start()
    assert done.take(1)[0][1] == f"{s3.url}/best.fdl"
    with open(os.path.join(local, "best.fdl"), "r+b") as f:  # bytes its .meta does not describe
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0x01]))
    up.enqueue(2, os.path.join(local, "best.fdl"))
    (_, url, error, _), = done.take(1)
    up.close(10)
    assert url is None and "crc32" in error and "not uploaded" in error
    assert "best.fdl.meta" not in s3.keys()
    with pytest.raises(snapsvc.FormatError, match="no metadata on the remote tier"):
        with fetched(f"{s3.url}/best.fdl"):
            pass


# -- the start-up round never breaks a live upload; an aborted one starts again (issue items 21, 22)
def _big_as(local: str, key: str) -> str:
    """big.fdl (two multipart parts) and its .meta, copied to ``key`` under ``local``."""
    path = os.path.join(local, key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    for suffix in ("", ".meta"):
        shutil.copyfile(os.path.join(local, "big.fdl" + suffix), path + suffix)
    return path


@pytest.fixture
def mid_upload(monkeypatch):
    """``mid_upload(fn)``: ``fn()`` runs once, in the middle of the next multipart upload
    (its first part read, the rest not), as another writer would act meanwhile."""
    import snapsvc.remote.store as store_mod
    chunks = store_mod._chunks
    todo = []

    def hooked(*args):
        for i, chunk in enumerate(chunks(*args)):
            if i == 1 and todo:
                todo.pop()()
            yield chunk

    monkeypatch.setattr(store_mod, "_chunks", hooked)
    return todo.append


def _live_upload(s3, timeout: float = 30) -> dict:
    """The one multipart upload in progress, once the store shows it."""
    deadline = time.monotonic() + timeout
    while True:
        ups = s3.client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads", [])
        if ups or time.monotonic() > deadline:
            assert len(ups) == 1, ups
            return ups[0]
        time.sleep(0.05)


def _started(up: Uploader, timeout: float = 30) -> None:
    """Wait for the uploader's first start-up round to end."""
    deadline = time.monotonic() + timeout
    while up._starting and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not up._starting


def test_a_rank_starting_leaves_another_ranks_live_upload_alone(s3, local, mid_upload):
    """Rank 0's sidecar starts while rank 1's uploads a step: rank 1's multipart upload,
    begun before rank 0 started, is not rank 0's to abort."""
    _big_as(local, "step_1/rank0.fdl")  # rank 0's files of the step are there too
    rank1 = _big_as(local, "step_1/rank1.fdl")
    done0, done1 = Done(), Done()
    ranks = [_uploader(s3.url, local, d, scan=False, names=f"rank{r}.*")
             for r, d in enumerate((done0, done1))]

    def rank0_starts() -> None:
        _live_upload(s3)
        ranks[0].start()
        _started(ranks[0])

    mid_upload(rank0_starts)
    ranks[1].start()
    ranks[1].enqueue(1, rank1)
    assert done1.take(1) == [("rank1.fdl", f"{s3.url}/step_1/rank1.fdl", None, False)]
    for up in ranks:
        up.close(10)
    assert s3.read("step_1/rank1.fdl") == open(rank1, "rb").read()


def test_an_upload_aborted_under_it_starts_again(s3, local, mid_upload):
    """A multipart upload aborted by someone else (an older snapsvc's start-up, a
    lifecycle rule): the part gets NotFound, and the upload starts again."""
    mid_upload(lambda: s3.client.abort_multipart_upload(
        Bucket=s3.bucket, Key=(up := _live_upload(s3))["Key"], UploadId=up["UploadId"]))
    done = Done()
    up = _uploader(s3.url, local, done, scan=False)
    up.start()
    up.enqueue(1, os.path.join(local, "big.fdl"))
    assert done.take(1) == [("big.fdl", f"{s3.url}/big.fdl", None, False)]
    up.close(10)
    assert s3.read("big.fdl") == open(os.path.join(local, "big.fdl"), "rb").read()
    assert s3.multipart_uploads() == []


def test_at_a_bucket_root_only_this_writers_leftovers_are_aborted(s3, local):
    """remote="s3://bucket": another application's multipart upload in the bucket is
    kept; a dead writer's of this directory's checkpoint is aborted."""
    for key in ("data/other-app.parquet", "step2.fdl"):
        s3.client.create_multipart_upload(Bucket=s3.bucket, Key=key)
    time.sleep(0.01)  # the uploader starts after them
    done = Done()
    up = _uploader(f"s3://{s3.bucket}", local, done, scan=False)
    up.start()
    _started(up)
    up.close(10)
    assert s3.multipart_uploads() == ["data/other-app.parquet"]


def test_start_up_round_is_retried_through_resets(s3, local, fault_proxy):
    """Three reset connections at start (boto3's listing of multipart uploads tries
    twice): the round is retried as an upload is, and what is local-only goes up."""
    proxy = fault_proxy(["reset"] * 3)
    done = Done()
    up = _uploader(s3.url, local, done, backlog=len(FILES))
    up.start()
    assert sorted(r[0] for r in done.take(len(FILES), timeout=30) if r[1]) == sorted(FILES)
    up.close(10)
    assert proxy.met == ["reset"] * 3


def test_remote_options_reach_every_client(s3, local, monkeypatch):
    """An endpoint and keys given in remote_options, the environment pointing elsewhere:
    the listing and abort of leftover multipart uploads (boto3) use them too."""
    from remote_fixtures import free_port
    s3.client.create_multipart_upload(Bucket=s3.bucket, Key=f"{s3.prefix}/step1.fdl")
    keys = {"access_key_id": os.environ["AWS_ACCESS_KEY_ID"],
            "secret_access_key": os.environ["AWS_SECRET_ACCESS_KEY"]}
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nobody there
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    time.sleep(0.01)  # the uploader starts after the leftover upload began
    done = Done()
    up = _uploader(s3.url, local, done, backlog=len(FILES), remote_timeout=5.0,
                   options={"endpoint_url": s3.endpoint, **keys})
    up.start()
    assert sorted(r[0] for r in done.take(len(FILES), timeout=30) if r[1]) == sorted(FILES)
    up.close(10)
    assert s3.multipart_uploads() == []


def test_a_failed_upload_thread_fails_what_waits_and_starts_again(s3, local, monkeypatch):
    """The thread dies (a bug, an engine panic): every queued upload fails with the
    cause at once, and the next upload starts the thread again."""
    import snapsvc.remote.upload as upload_mod
    real = upload_mod.open_store
    calls = []

    def failing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("engine exploded")
        return real(*args, **kwargs)

    monkeypatch.setattr(upload_mod, "open_store", failing_once)
    done = Done()
    up = _uploader(s3.url, local, done, scan=False)
    up.enqueue(1, os.path.join(local, "best.fdl"))
    up.start()
    (name, url, error, _), = done.take(1)
    assert name == "best.fdl" and url is None and "engine exploded" in error
    up.enqueue(2, os.path.join(local, "step1.fdl"))
    assert done.take(1) == [("step1.fdl", f"{s3.url}/step1.fdl", None, False)]
    up.close(10)


def test_data_left_without_metadata_is_removed_at_the_next_start(local, tmp_path):
    """An upload that failed for good on a directory remote left a data file without
    its .meta (its local checkpoint rotated away since): the next start removes it,
    once older than remote_timeout; others' files and newer ones stay."""
    remote = tmp_path / "mnt"
    optim = os.path.join(local, "step1.optim.fdl")
    with open(optim, "r+b") as f:  # the optimizer file no longer matches its metadata
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    done = Done()
    up = _uploader(str(remote), local, done, scan=False)
    up.start()
    up.enqueue(1, os.path.join(local, "step1.fdl"))
    (_, url, error, _), = done.take(1)
    up.close(10)
    assert url is None and "crc32" in error
    deadline = time.monotonic() + 30
    while not (remote / "step1.fdl").exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # the model file went up beside the optimizer file that failed
    assert sorted(os.listdir(remote)) == ["step1.fdl"]
    (remote / "notes.txt").write_text("not a checkpoint of this writer")
    shutil.copyfile(os.path.join(local, "step2.fdl"), remote / "step2.fdl")  # a live upload's
    hour_ago = time.time() - 3600
    for name in ("step1.fdl", "notes.txt"):
        os.utime(remote / name, (hour_ago, hour_ago))
    for p in snapsvc.checkpoint_files(os.path.join(local, "step1.fdl")):
        os.unlink(p)  # rotated away locally
    up = _uploader(str(remote), local, Done(), scan=False)
    up.start()
    _started(up)
    up.close(10)
    assert sorted(os.listdir(remote)) == ["notes.txt", "step2.fdl"]


def test_ls_lists_a_name_whose_tiers_differ_once_per_tier(s3, local, capsys):
    """best.fdl rewritten locally after its upload (whose next upload failed): ls shows
    the remote holds another best.fdl, not the local one."""
    from snapsvc.cli.core import main
    done = Done()
    up = _uploader(s3.url, local, done, backlog=len(FILES))
    up.start()
    done.take(len(FILES))
    up.close(10)
    for suffix in ("", ".meta"):  # a newer best.fdl, not uploaded
        shutil.copyfile(os.path.join(local, "big.fdl" + suffix),
                        os.path.join(local, "best.fdl" + suffix))
    capsys.readouterr()
    assert main(["ls", local, "--remote", s3.url, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["checkpoints"]
    assert sorted((r["name"], tuple(r["tiers"])) for r in rows) == [
        ("best.fdl", ("local",)), ("best.fdl", ("remote",)), ("big.fdl", ("local", "remote")),
        ("step1.fdl", ("local", "remote")), ("step2.fdl", ("local", "remote")),
        ("step3.fdl", ("local", "remote"))]


def test_cli_draws_progress_of_remote_reads_on_a_terminal_only(s3, local, monkeypatch, capsys):
    """inspect URL, verify URL and ls of a remote: tqdm's bar on a terminal, nothing else."""
    from test_cli import FakeTTY
    from snapsvc.cli.core import main
    done = Done()
    up = _uploader(s3.url, local, done, backlog=len(FILES))
    up.start()
    done.take(len(FILES))
    up.close(10)
    url = f"{s3.url}/big.fdl"
    for args, phase in ((["inspect", url], "fetching"), (["verify", url], "fetching"),
                        (["ls", s3.url], "reading metadata")):
        for tty, shown in ((io.StringIO(), False), (FakeTTY(), True)):
            monkeypatch.setattr(sys, "stderr", tty)
            assert main(args) == 0, args
            assert (f"{phase}:" in tty.getvalue()) is shown, (args, tty.getvalue())
            assert phase not in capsys.readouterr().out


def test_upload_errors_are_one_line_without_credentials(s3, local, secret):
    """obstore's errors carry a multi-line dump of the request: an UploadError's
    message is its first line, with no credential in it."""
    done = Done()
    up = _uploader("s3://snapsvc-no-such-bucket/ckpt", local, done, scan=False,
                   remote_timeout=1.0, options={"secret_access_key": secret})
    up.start()
    up.enqueue(1, os.path.join(local, "best.fdl"))
    (_, url, error, _), = done.take(1)
    up.close(10)
    assert url is None and "best.fdl" in error
    assert "\n" not in error and secret not in error

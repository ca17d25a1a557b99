"""Where remote copies live: an object store (through obstore) or a mounted directory.

Both kinds answer the same few async calls, on keys relative to the remote
root (``step100.fdl``, ``run1/step100.fdl.meta``):

- :meth:`Store.put`: a local file's bytes from an open file, checked on the
  way out against the size and CRC-32 its metadata records (a file that is
  not what the metadata says is never stored under the final name);
- :meth:`Store.get`, :meth:`Store.get_range`, :meth:`Store.list`, :meth:`Store.delete`;
- :meth:`Store.abort_stale_uploads`: multipart uploads (object stores) or temp
  files (directories) a dead writer left behind, of the keys a writer owns.

Object stores. obstore is the engine: one wheel for S3, GCS and Azure, with
jittered retries built in; measured against s3fs and boto3 in issue 22
(about 3x s3fs's download rate, half its upload CPU). Its clients hang in a
forked child, so a store is created in the process that uses it (the spawned
sidecar, or the reader's own process), never inherited. Files over
:data:`PART` bytes go up as multipart uploads of :data:`PART`-byte parts,
several in flight; S3 makes such an object visible only when it completes,
and obstore aborts the upload when the source fails (our CRC check).

Directories (a Lustre or NFS mount): the local tier's rules, temp file,
fsync, rename, directory fsync (:mod:`snapsvc.durable`).

Credentials come only from the environment and the engine's own chain
(``AWS_*``, ``GOOGLE_*``, ``AZURE_*``) or ``remote_options``, checked at a
writer's construction (:func:`check_options`); the boto3 client that lists
multipart uploads is built from the same configuration; no message snapsvc
writes contains them (:func:`~snapsvc.remote.url.scrub`). URLs are read and
quoted in :mod:`snapsvc.remote.url`.
"""

from __future__ import annotations

import asyncio
import errno
import importlib.util
import os
import pickle
import re
import shutil
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, Iterator, Mapping, cast

from isal import isal_zlib

from ..files.durable import commit, fsync_dir, remove_stale_temps, staged_write, TMP_SUFFIX
from .url import SCHEMES, RemoteURL, check_key, describe, is_url, parse_url, scrub, split_url

if TYPE_CHECKING:
    from obstore.store import S3Store

__all__ = ["SCHEMES", "PART", "Store", "ObjectStore", "DirStore", "StoredObject", "is_url",
           "open_store", "check_remote", "check_options", "remote_key", "split_url", "scrub",
           "describe",
           "CorruptSource"]

# multipart part size and ranged-read size: 8 MiB, the size the local tier writes in
PART = 8 << 20
# obstore's HTTP client options: only under "client_options" (at the top level obstore panics)
_CLIENT_KEYS = ("allow_http", "allow_invalid_certificates", "connect_timeout",
                "default_content_type", "default_headers", "pool_idle_timeout",
                "pool_max_idle_per_host", "proxy_url", "proxy_ca_certificate", "proxy_excludes",
                "root_certificate", "randomize_addresses", "read_timeout", "timeout",
                "user_agent")


class CorruptSource(OSError):
    """The local file being uploaded is not what its metadata records."""


@dataclass(frozen=True)
class StoredObject:
    key: str
    size: int
    modified: float = 0.0  # seconds since the epoch, as the store records it


def _chunks(file: BinaryIO, key: str, size: int, crc32: int) -> Iterator[bytes]:
    """``file``'s bytes in :data:`PART` pieces; after the last, raise
    :class:`CorruptSource` if they are not ``size`` bytes of CRC-32 ``crc32``
    (raising inside the iterator makes the engine abort the upload)."""
    got, crc = 0, 0
    while True:
        chunk = file.read(PART)
        if not chunk:
            break
        got += len(chunk)
        crc = isal_zlib.crc32(chunk, crc)
        if got > size:
            break
        if got == size and crc != crc32:
            break
        yield chunk
    if got != size or crc != crc32:
        raise CorruptSource(errno.EIO, f"{key}: the local file has {got}+ bytes of crc32 "
                            f"{crc:08x}, its metadata says {size} bytes of crc32 {crc32:08x}; "
                            "not uploaded")


Owned = Callable[[str], bool]
# (phase, done, total or None): snapsvc.files.tensors.Progress, without its torch import
Progress = Callable[[str, int, "int | None"], None]


class Store:
    """The calls the remote tier makes; keys are relative to :attr:`url`."""

    url: str

    def key_url(self, key: str) -> str:
        return f"{self.url.rstrip('/')}/{key}"

    async def put(self, key: str, file: BinaryIO, *, size: int | None = None,
                  crc32: int | None = None) -> None:
        """Store ``file`` (read from its current position to its end) as ``key``, atomically.
        With ``size`` and ``crc32`` the bytes are checked on the way: a mismatch is
        :class:`CorruptSource` and ``key`` is left as it was."""
        raise NotImplementedError

    async def get(self, key: str) -> bytes | None:
        """The whole object (small ones: metadata), None if there is none."""
        raise NotImplementedError

    async def size(self, key: str) -> int | None:
        raise NotImplementedError

    async def get_range(self, key: str, start: int, end: int) -> memoryview:
        raise NotImplementedError

    async def list(self, prefix: str = "", *,
                   progress: Progress | None = None) -> list[StoredObject]:
        """Every object whose key starts with ``prefix``; ``progress("listing", n, None)``
        as they come."""
        raise NotImplementedError

    async def delete(self, key: str) -> None:
        """Remove ``key``; one that is gone already is no error."""
        raise NotImplementedError

    async def abort_stale_uploads(self, before: float, owned: Owned) -> int:
        """Remove the unfinished uploads (multipart uploads, temp files) of the keys
        ``owned`` says are this writer's, begun before the time ``before``; how many."""
        raise NotImplementedError


def _defaults(remote_timeout: float) -> dict[str, Any]:
    """obstore's retry and client settings under ``remote_timeout``: each
    request retried with jittered backoff for up to a third of it (so the
    uploader's whole-attempt retries, with the error to report, fit in it too),
    a stalled connection cut after at most 30 s (then retried)."""
    return {
        "retry_config": {"max_retries": 10,
                         "retry_timeout": timedelta(seconds=remote_timeout / 3),
                         "backoff": {"init_backoff": timedelta(milliseconds=100),
                                     "max_backoff": timedelta(seconds=5), "base": 2}},
        # allow_http: a loopback or in-cluster endpoint (AWS_ENDPOINT_URL=http://...)
        # works with no extra flag; the https default of real clouds is unaffected
        "client_options": {"allow_http": True,
                           "connect_timeout": timedelta(seconds=min(10.0, remote_timeout)),
                           "timeout": timedelta(seconds=min(30.0, remote_timeout))},
    }


_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def _seconds(value: Any) -> float:
    """A client option's duration (a timedelta, or obstore's text: ``2s``, ``500ms``)
    in seconds, for boto3; 10 s where it is not one of those."""
    if isinstance(value, timedelta):
        return value.total_seconds()
    found = _DURATION.fullmatch(value) if isinstance(value, str) else None
    return float(found.group(1)) * _UNIT_S[found.group(2)] if found else 10.0


class ObjectStore(Store):
    """An S3, GCS or Azure prefix through obstore."""

    def __init__(self, url: str | RemoteURL, *, remote_timeout: float = 300.0,
                 options: Mapping[str, Any] | None = None) -> None:
        from obstore.store import from_url  # imported here: obstore is an optional extra

        self.where = url if isinstance(url, RemoteURL) else parse_url(url)
        self.url = self.where.url
        self.remote_timeout = remote_timeout
        self.options = dict(options or {})
        kwargs = _defaults(remote_timeout)
        rest = dict(self.options)
        for name in ("retry_config", "client_options"):
            kwargs[name] = {**kwargs[name], **(rest.pop(name, None) or {})}
        self._client_options = kwargs["client_options"]
        self._store = from_url(self.where.engine_url, **kwargs, **rest)

    def key_url(self, key: str) -> str:
        return self.where.join(key)

    async def put(self, key: str, file: BinaryIO, *, size: int | None = None,
                  crc32: int | None = None) -> None:
        import obstore

        if size is None or crc32 is None:
            await obstore.put_async(self._store, key, file.read())
        elif size <= PART:  # one PUT
            data = file.read(size + 1)
            if len(data) != size or isal_zlib.crc32(data) != crc32:
                raise CorruptSource(errno.EIO, f"{key}: the local file has {len(data)}+ bytes "
                                    f"of crc32 {isal_zlib.crc32(data):08x}, its metadata says "
                                    f"{size} bytes of crc32 {crc32:08x}; not uploaded")
            await obstore.put_async(self._store, key, data)
        else:
            await obstore.put_async(self._store, key, _chunks(file, key, size, crc32),
                                    chunk_size=PART, max_concurrency=8)

    async def get(self, key: str) -> bytes | None:
        import obstore

        try:
            result = await obstore.get_async(self._store, key)
        except FileNotFoundError:
            return None
        return bytes(await result.bytes_async())

    async def size(self, key: str) -> int | None:
        import obstore

        try:
            return (await obstore.head_async(self._store, key))["size"]
        except FileNotFoundError:
            return None

    async def get_range(self, key: str, start: int, end: int) -> memoryview:
        import obstore

        return memoryview(await obstore.get_range_async(self._store, key, start=start, end=end))

    async def list(self, prefix: str = "", *,
                   progress: Progress | None = None) -> list[StoredObject]:
        import obstore

        out: list[StoredObject] = []
        async for batch in obstore.list(self._store, prefix or None):
            out.extend(StoredObject(o["path"], o["size"], o["last_modified"].timestamp())
                       for o in batch)
            if progress is not None:
                progress("listing", len(out), None)
        return out

    async def delete(self, key: str) -> None:
        import obstore

        try:
            await obstore.delete_async(self._store, key)
        except FileNotFoundError:
            pass

    async def abort_stale_uploads(self, before: float, owned: Owned) -> int:
        """S3 only, through boto3 (in ``snapsvc[remote]``; skipped where it is not
        installed): obstore has no call to list multipart uploads. Elsewhere a
        bucket lifecycle rule does this (S3's and GCS's
        ``AbortIncompleteMultipartUpload``; Azure drops uncommitted blocks after
        7 days on its own)."""
        if self.where.scheme not in ("s3", "s3a"):
            return 0
        try:
            import boto3
        except ImportError:
            return 0
        return await asyncio.to_thread(self._abort_s3_uploads, boto3, before, owned)

    def _boto3_client(self, boto3: Any) -> Any:
        """boto3's S3 client, configured as this store is: from the options as
        obstore read them (one configuration for both), the environment for the rest."""
        from botocore.config import Config

        cfg = cast("S3Store", self._store).config   # an s3:// URL's store (the caller checks)
        client = self._client_options  # each request's; the caller's deadline bounds all
        virtual = str(cfg.get("virtual_hosted_style_request", "")).lower() == "true"
        return boto3.client(
            "s3", endpoint_url=cfg.get("endpoint"), region_name=cfg.get("region"),
            aws_access_key_id=cfg.get("access_key_id"),
            aws_secret_access_key=cfg.get("secret_access_key"),
            aws_session_token=cfg.get("session_token"),
            config=Config(connect_timeout=_seconds(client.get("connect_timeout")),
                          read_timeout=_seconds(client.get("timeout")),
                          retries={"max_attempts": 2},
                          s3={"addressing_style": "virtual" if virtual else "path"}))

    def _abort_s3_uploads(self, boto3: Any, before: float, owned: Owned) -> int:
        client = self._boto3_client(boto3)
        bucket, prefix = self.where.bucket, self.where.prefix
        count = 0
        pages = client.get_paginator("list_multipart_uploads").paginate(
            Bucket=bucket, Prefix=f"{prefix}/" if prefix else "")
        for page in pages:
            for up in page.get("Uploads", []):
                key = up["Key"][len(prefix) + 1:] if prefix else up["Key"]
                if up["Initiated"].timestamp() >= before or not owned(key):
                    continue  # maybe live: another writer's, or begun since this one started
                client.abort_multipart_upload(Bucket=bucket, Key=up["Key"],
                                              UploadId=up["UploadId"])
                count += 1
        return count


class DirStore(Store):
    """A directory on a mounted filesystem, written as the local tier writes."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self.url = self.root

    def _path(self, key: str) -> str:
        path = os.path.normpath(os.path.join(self.root, key))
        if os.path.commonpath([path, self.root]) != self.root:
            raise ValueError(f"{key}: outside the remote directory {self.root}")
        return path

    def key_url(self, key: str) -> str:
        return self._path(key)

    async def put(self, key: str, file: BinaryIO, *, size: int | None = None,
                  crc32: int | None = None) -> None:
        await asyncio.to_thread(self._put, key, file, size, crc32)

    def _put(self, key: str, file: BinaryIO, size: int | None, crc32: int | None) -> None:
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with staged_write(path) as out:
            if size is None or crc32 is None:
                shutil.copyfileobj(file, out, PART)
            else:
                for chunk in _chunks(file, key, size, crc32):
                    out.write(chunk)
        commit(out)

    async def get(self, key: str) -> bytes | None:
        def read() -> bytes | None:
            try:
                with open(self._path(key), "rb") as f:
                    return f.read()
            except FileNotFoundError:
                return None
        return await asyncio.to_thread(read)

    async def size(self, key: str) -> int | None:
        try:
            return os.stat(self._path(key)).st_size
        except FileNotFoundError:
            return None

    async def get_range(self, key: str, start: int, end: int) -> memoryview:
        def read() -> memoryview:
            with open(self._path(key), "rb") as f:
                return memoryview(os.pread(f.fileno(), end - start, start))
        return await asyncio.to_thread(read)

    async def list(self, prefix: str = "", *,
                   progress: Progress | None = None) -> list[StoredObject]:
        def walk() -> list[StoredObject]:
            out = []
            for d, _, names in os.walk(self.root):
                for n in names:
                    if n.endswith(TMP_SUFFIX):
                        continue
                    p = os.path.join(d, n)
                    key = os.path.relpath(p, self.root).replace(os.sep, "/")
                    if key.startswith(prefix):
                        try:
                            st = os.stat(p)
                        except FileNotFoundError:
                            continue
                        out.append(StoredObject(key, st.st_size, st.st_mtime))
                if progress is not None:
                    progress("listing", len(out), None)
            return out
        return await asyncio.to_thread(walk)

    async def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        fsync_dir(os.path.dirname(path))

    async def abort_stale_uploads(self, before: float, owned: Owned) -> int:
        """Temp files of dead writers (by pid, on this host), last written before
        ``before`` (a writer on another host sharing the mount has another pid space)."""
        def sweep() -> int:
            count = 0
            for d, _, _ in os.walk(self.root):
                folder = os.path.relpath(d, self.root).replace(os.sep, "/")
                folder = "" if folder == "." else folder + "/"
                def stale(name: str, mtime: float, folder: str = folder) -> bool:
                    return mtime < before and owned(folder + name)
                count += len(remove_stale_temps(d, stale))
            return count
        return await asyncio.to_thread(sweep)


def open_store(location: str | os.PathLike[str], *, remote_timeout: float = 300.0,
               options: Mapping[str, Any] | None = None) -> Store:
    """The store for a URL (``s3://bucket/prefix``, ``gs://``, ``az://``) or a directory.

    Call it in the process that will use the store (obstore's clients do not
    survive ``fork()``).
    """
    if is_url(location):
        return ObjectStore(str(location), remote_timeout=remote_timeout, options=options)
    if isinstance(location, str) and "://" in location and not location.startswith("file://"):
        raise ValueError(f"{location}: unknown remote scheme; use one of "
                         f"{', '.join(s + '://' for s in SCHEMES)} or a directory")
    path = os.fspath(location)
    return DirStore(path[len("file://"):] if path.startswith("file://") else path)


def check_options(remote: str, options: Mapping[str, Any] | None,
                  remote_timeout: float) -> dict[str, Any]:
    """``remote_options`` checked at construction, where a bad one is a ValueError
    (in the sidecar it would stop every upload): by building the store from them,
    which reads them and touches no network."""
    opts = dict(options or {})
    if not is_url(remote):
        if opts:
            raise ValueError(f"remote_options {sorted(map(str, opts))} apply to object stores; "
                             f"the remote {remote} is a directory")
        return opts
    for key, value in opts.items():
        if key in _CLIENT_KEYS:
            raise ValueError(f"remote_options[{key!r}] is an HTTP client option: give it as "
                             f"remote_options={{'client_options': {{{key!r}: ...}}}}")
        if key in ("client_options", "retry_config") and not isinstance(value, Mapping):
            raise ValueError(f"remote_options[{key!r}] must be a dict, got "
                             f"{type(value).__name__}")
    try:
        pickle.dumps(opts)  # they travel to the sidecar
        ObjectStore(remote, remote_timeout=remote_timeout, options=opts)
    except Exception as e:
        raise ValueError(f"remote_options for {remote} refused: {describe(e, opts)}") from None
    except BaseException as e:  # pyo3's PanicException: obstore refused a value by panicking
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise ValueError(f"remote_options for {remote} refused: {describe(e, opts)}") from None
    return opts


def remote_key(remote: str, directory: str, path: str) -> str:
    """The remote key of the checkpoint ``path``: its path under ``directory``;
    ValueError for a path outside it, or a name the remote cannot hold."""
    if os.path.commonpath([path, directory]) != directory:
        raise ValueError(f"{path} is outside the writer's directory {directory}; with "
                         "remote=, a checkpoint's remote name is its path under directory, "
                         "so write it there")
    key = os.path.relpath(path, directory).replace(os.sep, "/")
    if is_url(remote):
        check_key(key, f"{path}: its name on the remote tier {remote}")
    return key


def check_remote(remote: str | os.PathLike[str] | None, directory: str | None,
                 keep_last: int | None, timeout: float,
                 options: Mapping[str, Any] | None = None) -> str | None:
    """A writer's remote settings checked at construction; the remote as a
    string (a URL, or a directory made absolute), None without one."""
    if remote is None:
        if keep_last is not None:
            raise ValueError("remote_keep_last needs remote=")
        if options:
            raise ValueError("remote_options needs remote=")
        return None
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"remote_keep_last must be >= 1 or None, got {keep_last}")
    if not os.fspath(remote).strip():
        # "" would be the current directory: uploads landing wherever the trainer runs
        raise ValueError("remote='' names no place: pass a URL (s3://bucket/prefix) or a "
                         "directory, or remote=None for no remote tier")
    if not timeout > 0:
        raise ValueError(f"remote_timeout must be > 0 seconds, got {timeout}")
    if directory is None:
        raise ValueError("remote= needs a directory: a checkpoint's remote name is its path "
                         "under it")
    if is_url(remote):
        if importlib.util.find_spec("obstore") is None:
            raise ImportError(f"remote={remote!r} needs obstore: pip install 'snapsvc[remote]'")
        url = parse_url(str(remote)).url  # credentials, and what cannot round-trip, refused
        check_options(url, options, timeout)
        return url
    store = open_store(remote)  # an unknown scheme is a ValueError here
    assert isinstance(store, DirStore)
    check_options(store.root, options, timeout)
    # real paths: a remote that reaches the local directory through a symlink is the same
    # directory, and its rotation would delete what keep_last keeps
    real, local = os.path.realpath(store.root), os.path.realpath(directory)
    if os.path.commonpath([real, local]) in (real, local):
        raise ValueError(f"remote directory {store.root} (really {real}) is the local directory "
                         f"{directory} (really {local}), inside it, or contains it; use a "
                         "directory apart from it")
    return store.root

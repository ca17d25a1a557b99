"""Where remote copies live: an object store (through obstore) or a mounted directory.

Both kinds answer the same few async calls, on keys relative to the remote
root (``step100.fdl``, ``run1/step100.fdl.meta``):

- :meth:`Store.put`: a local file's bytes from an open file, checked on the
  way out against the size and CRC-32 its metadata records (a file that is
  not what the metadata says is never stored under the final name);
- :meth:`Store.get`, :meth:`Store.download` (ranged, parallel reads into a
  local file), :meth:`Store.list`, :meth:`Store.delete`;
- :meth:`Store.abort_stale_uploads`: multipart uploads (object stores) or temp
  files (directories) a dead writer left behind.

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
(``AWS_*``, ``GOOGLE_*``, ``AZURE_*``) or ``remote_options``; no message
snapsvc writes contains them (:func:`scrub`).
"""

from __future__ import annotations

import asyncio
import errno
import importlib.util
import os
import shutil
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, BinaryIO, Iterator

from isal import isal_zlib

from ..files.durable import commit, fsync_dir, remove_stale_temps, staged_write, TMP_SUFFIX

__all__ = ["SCHEMES", "PART", "Store", "ObjectStore", "DirStore", "StoredObject", "is_url",
           "open_store", "check_remote", "split_url", "scrub", "CorruptSource"]

# URL schemes that name an object store (obstore's from_url); anything else is a directory
SCHEMES = ("s3", "s3a", "gs", "az", "abfs", "abfss", "azure")
# multipart part size and ranged-read size: 8 MiB, the size the local tier writes in
PART = 8 << 20
# ranged reads in flight for one file
_READS_IN_FLIGHT = 8
# environment variables whose values must never reach a message
_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID",
               "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_ACCESS_KEY", "AZURE_STORAGE_SAS_KEY",
               "AZURE_CLIENT_SECRET", "GOOGLE_SERVICE_ACCOUNT_KEY")
_SECRET_WORDS = ("secret", "key", "token", "password", "sas", "credential")


def is_url(location: str | os.PathLike[str]) -> bool:
    """Does ``location`` name an object store (``s3://``, ``gs://``, ``az://`` ...)?"""
    if not isinstance(location, str):
        return False
    scheme, sep, _ = location.partition("://")
    return bool(sep) and scheme.lower() in SCHEMES


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b.fdl`` -> (``s3://bucket/a``, ``b.fdl``)."""
    root, _, name = url.rstrip("/").rpartition("/")
    if "://" not in root:  # s3://bucket.fdl: no bucket left
        raise ValueError(f"{url}: not a checkpoint inside a bucket (expected s3://bucket/name)")
    return root, name


def scrub(message: str, options: dict[str, Any] | None = None) -> str:
    """``message`` with every credential snapsvc knows of replaced by ``***``:
    the values of the usual secret environment variables and of the options
    whose names say they are secret. Engines' errors can echo their input."""
    secrets = [os.environ.get(k) for k in _SECRET_ENV]
    for k, v in (options or {}).items():
        if isinstance(v, str) and any(w in k.lower() for w in _SECRET_WORDS):
            secrets.append(v)
    for s in secrets:
        if s and len(s) >= 4:
            message = message.replace(s, "***")
    return message


class CorruptSource(OSError):
    """The local file being uploaded is not what its metadata records."""


@dataclass(frozen=True)
class StoredObject:
    key: str
    size: int


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

    async def list(self, prefix: str = "") -> list[StoredObject]:
        """Every object whose key starts with ``prefix``."""
        raise NotImplementedError

    async def delete(self, key: str) -> None:
        """Remove ``key``; one that is gone already is no error."""
        raise NotImplementedError

    async def abort_stale_uploads(self) -> int:
        """Remove what dead writers left unfinished; how many."""
        raise NotImplementedError

    async def download(self, key: str, dest: str, size: int) -> None:
        """``key`` into the new file ``dest`` in :data:`PART` ranges,
        :data:`_READS_IN_FLIGHT` at a time, each written at its offset."""
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            gate = asyncio.Semaphore(_READS_IN_FLIGHT)

            async def part(start: int) -> None:
                async with gate:
                    data = await self.get_range(key, start, min(start + PART, size))
                    os.pwrite(fd, data, start)

            await asyncio.gather(*(part(s) for s in range(0, size, PART)))
        finally:
            os.close(fd)


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


class ObjectStore(Store):
    """An S3, GCS or Azure prefix through obstore."""

    def __init__(self, url: str, *, remote_timeout: float = 300.0,
                 options: dict[str, Any] | None = None) -> None:
        from obstore.store import from_url  # imported here: obstore is an optional extra

        self.url = url.rstrip("/")
        self.remote_timeout = remote_timeout
        self.options = dict(options or {})
        kwargs = _defaults(remote_timeout)
        for name in ("retry_config", "client_options"):
            kwargs[name] = {**kwargs[name], **self.options.pop(name, {})}
        self._store = from_url(self.url, **kwargs, **self.options)

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

    async def list(self, prefix: str = "") -> list[StoredObject]:
        import obstore

        out = []
        async for batch in obstore.list(self._store, prefix or None):
            out.extend(StoredObject(o["path"], o["size"]) for o in batch)
        return out

    async def delete(self, key: str) -> None:
        import obstore

        try:
            await obstore.delete_async(self._store, key)
        except FileNotFoundError:
            pass

    async def abort_stale_uploads(self) -> int:
        """S3 only, through boto3 (in ``snapsvc[remote]``; skipped where it is not
        installed): obstore has no call to list multipart uploads. Elsewhere a
        bucket lifecycle rule does this (S3's and GCS's
        ``AbortIncompleteMultipartUpload``; Azure drops uncommitted blocks after
        7 days on its own)."""
        if not self.url.startswith(("s3://", "s3a://")):
            return 0
        try:
            import boto3
        except ImportError:
            return 0
        return await asyncio.to_thread(_abort_s3_uploads, boto3, self.url, self.options,
                                       self.remote_timeout)


def _abort_s3_uploads(boto3: Any, url: str, options: dict[str, Any], timeout: float) -> int:
    """Abort every multipart upload under ``url``'s prefix (boto3 reads the
    same environment as obstore; an endpoint in ``options`` is passed on)."""
    from botocore.config import Config

    bucket, _, prefix = url.split("://", 1)[1].partition("/")
    endpoint = options.get("endpoint") or options.get("aws_endpoint") or None
    limit = min(10.0, timeout)  # each request; the caller's deadline bounds the whole
    client = boto3.client("s3", endpoint_url=endpoint, config=Config(
        connect_timeout=limit, read_timeout=limit, retries={"max_attempts": 2}))
    count = 0
    pages = client.get_paginator("list_multipart_uploads").paginate(
        Bucket=bucket, Prefix=f"{prefix}/" if prefix else "")
    for page in pages:
        for up in page.get("Uploads", []):
            client.abort_multipart_upload(Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
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

    async def list(self, prefix: str = "") -> list[StoredObject]:
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
                            out.append(StoredObject(key, os.stat(p).st_size))
                        except FileNotFoundError:
                            pass
            return out
        return await asyncio.to_thread(walk)

    async def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        fsync_dir(os.path.dirname(path))

    async def abort_stale_uploads(self) -> int:
        def sweep() -> int:
            return sum(len(remove_stale_temps(d)) for d, _, _ in os.walk(self.root))
        return await asyncio.to_thread(sweep)


def open_store(location: str | os.PathLike[str], *, remote_timeout: float = 300.0,
               options: dict[str, Any] | None = None) -> Store:
    """The store for a URL (``s3://bucket/prefix``, ``gs://``, ``az://``) or a directory.

    Call it in the process that will use the store (obstore's clients do not
    survive ``fork()``).
    """
    if is_url(location):
        return ObjectStore(location, remote_timeout=remote_timeout, options=options)
    if isinstance(location, str) and "://" in location and not location.startswith("file://"):
        raise ValueError(f"{location}: unknown remote scheme; use one of "
                         f"{', '.join(s + '://' for s in SCHEMES)} or a directory")
    path = os.fspath(location)
    return DirStore(path[len("file://"):] if path.startswith("file://") else path)


def check_remote(remote: str | os.PathLike[str] | None, directory: str | None,
                 keep_last: int | None, timeout: float) -> str | None:
    """A writer's remote settings checked at construction; the remote as a
    string (a URL, or a directory made absolute), None without one."""
    if remote is None:
        if keep_last is not None:
            raise ValueError("remote_keep_last needs remote=")
        return None
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"remote_keep_last must be >= 1 or None, got {keep_last}")
    if not timeout > 0:
        raise ValueError(f"remote_timeout must be > 0 seconds, got {timeout}")
    if directory is None:
        raise ValueError("remote= needs a directory: a checkpoint's remote name is its path "
                         "under it")
    if is_url(remote):
        if importlib.util.find_spec("obstore") is None:
            raise ImportError(f"remote={remote!r} needs obstore: pip install 'snapsvc[remote]'")
        return str(remote).rstrip("/")
    store = open_store(remote)  # an unknown scheme is a ValueError here
    assert isinstance(store, DirStore)
    if os.path.commonpath([store.root, directory]) == directory:
        raise ValueError(f"remote directory {store.root} is inside the local directory "
                         f"{directory}; use a directory outside it")
    return store.root

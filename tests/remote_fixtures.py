"""A real S3 server on loopback for the remote tier's tests: moto in server mode.

``s3`` gives each test a fresh bucket and points the standard environment
(``AWS_ENDPOINT_URL``, keys, region) at the server, so a spawned sidecar
inherits it as a training job inherits its cloud credentials. The server
starts once per session, on 127.0.0.1 and a free port, in about a second.
Test modules load it with ``pytest_plugins = ["remote_fixtures"]``; without obstore, moto or boto3 the
tests that use them are skipped.
"""

from __future__ import annotations

import itertools
import logging
import socket
from dataclasses import dataclass
from typing import Any, Iterator

import pytest

# a value no message, log or file may ever contain
SECRET = "sEcReT-snapsvc-test-key-9f3a"
_buckets = itertools.count()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    pytest.importorskip("obstore")
    pytest.importorskip("boto3")
    server = pytest.importorskip("moto.server")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    port = free_port()
    srv = server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    srv.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.stop()


@dataclass
class S3:
    """A bucket on the moto server; ``url`` is ``s3://<bucket>/ckpt``, ``client`` boto3's."""

    endpoint: str
    bucket: str
    prefix: str
    client: Any

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def keys(self) -> dict[str, int]:
        """Every object under the prefix: key relative to it -> size."""
        out = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.prefix + "/"):
            for o in page.get("Contents", []):
                out[o["Key"][len(self.prefix) + 1:]] = o["Size"]
        return out

    def read(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}")["Body"].read()

    def write(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}", Body=data)

    def multipart_uploads(self) -> list[str]:
        ups = self.client.list_multipart_uploads(Bucket=self.bucket).get("Uploads", [])
        return [u["Key"] for u in ups]


def _env(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    for var in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_CONFIG_FILE",
                "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def s3(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> S3:
    import boto3

    _env(monkeypatch, moto_endpoint)
    bucket = f"snapsvc-test-{next(_buckets)}"
    client = boto3.client("s3", endpoint_url=moto_endpoint)
    client.create_bucket(Bucket=bucket)
    return S3(moto_endpoint, bucket, "ckpt", client)


@pytest.fixture
def secret() -> str:
    """The AWS secret key the fixtures set: no message, log or file may contain it."""
    return SECRET


@pytest.fixture
def unreachable_s3(monkeypatch: pytest.MonkeyPatch) -> str:
    """An S3 URL whose endpoint refuses every connection (a closed loopback port)."""
    pytest.importorskip("obstore")
    _env(monkeypatch, f"http://127.0.0.1:{free_port()}")
    return "s3://nowhere-bucket/ckpt"


class FaultProxy:
    """A loopback TCP proxy in front of ``target``: the first connections meet the
    faults in ``faults`` ("reset": closed with RST on arrival; "stall": held open,
    never answered), every later one is forwarded. :meth:`outage` cuts every
    connection open and resets each new one until it ends."""

    def __init__(self, target_port: int, faults: list[str]) -> None:
        import threading

        self.faults = list(faults)
        self.met: list[str] = []
        self.target = ("127.0.0.1", target_port)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self._held: list[socket.socket] = []
        self._live: list[socket.socket] = []
        self._lock = threading.Lock()
        self._down = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import struct
        import threading

        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self._lock:
                fault = "reset" if self._down else self.faults.pop(0) if self.faults else None
                if fault:
                    self.met.append(fault)
            if fault == "reset":
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                conn.close()
            elif fault == "stall":
                self._held.append(conn)
            else:
                up = socket.create_connection(self.target)
                with self._lock:
                    self._live += [conn, up]
                for a, b in ((conn, up), (up, conn)):
                    threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def outage(self, down: bool) -> None:
        """Begin (cutting every open connection) or end an outage."""
        with self._lock:
            self._down = down
            live, self._live = (self._live, []) if down else ([], self._live)
        for c in live:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()
        for c in self._held:
            c.close()


@pytest.fixture
def fault_proxy(s3: S3, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``make(faults)``: a FaultProxy before the moto server, the environment's endpoint."""
    proxies = []

    def make(faults: list[str]) -> FaultProxy:
        p = FaultProxy(int(s3.endpoint.rsplit(":", 1)[1]), faults)
        proxies.append(p)
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{p.port}")
        return p

    yield make
    for p in proxies:
        p.close()

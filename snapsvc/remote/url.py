"""Remote URLs and keys, read and written in one place; credentials kept out of messages.

A remote URL names its objects literally, as the store lists them and as the
AWS and gcloud command lines take them: ``s3://bucket/run#1/step 7.fdl`` is
the key ``run#1/step 7.fdl`` of the bucket ``bucket``. obstore's
``from_url`` reads a URL as a web address instead (it percent-decodes the
path and cuts it at ``#`` and ``?``), so the one URL handed to it is quoted
here (:attr:`RemoteURL.engine_url`); keys go to it as they are. What a store
cannot hold is refused before anything is written (:func:`check_key`), so
every URL snapsvc returns reads back. Credentials in a URL are refused, never
echoed (:func:`parse_url`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

__all__ = ["SCHEMES", "RemoteURL", "is_url", "parse_url", "split_url", "check_key", "scrub",
           "describe", "as_oserror"]

# URL schemes that name an object store (obstore's from_url); anything else is a directory
SCHEMES = ("s3", "s3a", "gs", "az", "abfs", "abfss", "azure")
# where each kind of store takes its credentials, for the message that refuses them in a URL
_CREDENTIALS = {"s3": "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN)",
                "gs": "GOOGLE_SERVICE_ACCOUNT (a key file) or GOOGLE_APPLICATION_CREDENTIALS",
                "az": "AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY (or "
                      "AZURE_STORAGE_SAS_KEY)"}
# environment variables whose values must never reach a message
_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID",
               "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_ACCESS_KEY", "AZURE_STORAGE_SAS_KEY",
               "AZURE_CLIENT_SECRET", "GOOGLE_SERVICE_ACCOUNT_KEY")
_SECRET_WORDS = ("secret", "key", "token", "password", "sas", "credential")
# what obstore's paths refuse in a segment: ASCII control characters
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def is_url(location: Any) -> bool:
    """Does ``location`` name an object store (``s3://``, ``gs://``, ``az://`` ...)?"""
    if not isinstance(location, str):
        return False
    scheme, sep, _ = location.partition("://")
    return bool(sep) and scheme.lower() in SCHEMES


@dataclass(frozen=True)
class RemoteURL:
    """``scheme://bucket/prefix``: ``prefix`` is a key prefix, literal, without
    a leading or trailing ``/`` ("" at the bucket's root)."""

    scheme: str
    bucket: str
    prefix: str

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")

    @property
    def engine_url(self) -> str:
        """The URL for obstore's ``from_url``, which unquotes it back to :attr:`prefix`."""
        return f"{self.scheme}://{self.bucket}/" + quote(self.prefix, safe="/")

    def join(self, key: str) -> str:
        """The URL of ``key`` (relative to :attr:`prefix`)."""
        return f"{self.url}/{key}"

    def __str__(self) -> str:
        return self.url


def _credentials_message(url: str, scheme: str, host: str) -> str:
    env = _CREDENTIALS["s3" if scheme.startswith("s3") else "gs" if scheme == "gs" else "az"]
    return (f"{scheme}://***@{host}...: a remote URL must not carry credentials (they would "
            f"reach logs and the URLs snapsvc returns, and the store ignores them); set {env} "
            "in the environment, or pass them in remote_options")


def parse_url(url: str) -> RemoteURL:
    """``url`` (``s3://bucket/prefix``) read literally; ValueError for one that
    carries credentials, names no bucket, or has a key the store cannot hold."""
    scheme, sep, rest = str(url).partition("://")
    if not sep or scheme.lower() not in SCHEMES:
        raise ValueError(f"{url}: not an object store URL (one of "
                         f"{', '.join(s + '://' for s in SCHEMES)})")
    scheme = scheme.lower()
    bucket, _, prefix = rest.partition("/")
    if "@" in bucket:
        raise ValueError(_credentials_message(url, scheme, bucket.rpartition("@")[2]))
    if not bucket or _CONTROL.search(bucket):
        raise ValueError(f"{url!r}: no bucket name after {scheme}://")
    prefix = prefix.rstrip("/")
    if prefix:
        check_key(prefix, f"the prefix of {url!r}")
    return RemoteURL(scheme, bucket, prefix)


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b.fdl`` -> (``s3://bucket/a``, ``b.fdl``)."""
    where = parse_url(url)
    if not where.prefix:  # s3://bucket.fdl: no bucket left
        raise ValueError(f"{url}: not a checkpoint inside a bucket (expected s3://bucket/name)")
    root, _, name = where.prefix.rpartition("/")
    return RemoteURL(where.scheme, where.bucket, root).url, name


def check_key(key: str, what: str) -> None:
    """ValueError unless an object store can hold ``key`` under that very name:
    no ASCII control character, no empty, ``.`` or ``..`` segment."""
    bad = _CONTROL.search(key)
    if bad:
        raise ValueError(f"{what}: {key!r} holds the control character {bad.group()!r}, "
                         "which an object store key cannot hold; rename it")
    if any(part in ("", ".", "..") for part in key.split("/")):
        raise ValueError(f"{what}: {key!r} has an empty, '.' or '..' segment, which an object "
                         "store key cannot hold; rename it")


def scrub(message: str, options: dict[str, Any] | None = None) -> str:
    """``message`` with every credential snapsvc knows of replaced by ``***``:
    the values of the usual secret environment variables and of the options
    whose names say they are secret (nested ones too). Engines' errors can echo
    their input."""
    secrets = [os.environ.get(k) for k in _SECRET_ENV]
    todo = [options or {}]
    while todo:
        for k, v in todo.pop().items():
            if isinstance(v, dict):
                todo.append(v)
            elif isinstance(v, str) and any(w in str(k).lower() for w in _SECRET_WORDS):
                secrets.append(v)
    for s in secrets:
        if s and len(s) >= 4:
            message = message.replace(s, "***")
    return message


def describe(e: BaseException, options: dict[str, Any] | None = None) -> str:
    """An engine's error as one line without credentials: ``Type: first line``
    (obstore appends a multi-line debug dump of its request)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
    return scrub(text, options)


def as_oserror(e: BaseException, what: str, options: dict[str, Any] | None = None) -> OSError:
    """An engine's error as a one-line ``OSError`` saying ``what`` failed (its errno
    kept, so a NotFound stays a ``FileNotFoundError``)."""
    message = f"{what} failed: {describe(e, options)}"
    code = getattr(e, "errno", None)
    return OSError(code, message) if isinstance(code, int) else OSError(message)

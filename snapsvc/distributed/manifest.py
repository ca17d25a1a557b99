"""The step directory and its manifest: what makes a multi-rank checkpoint complete.

Layout on disk (``directory`` on a filesystem every rank shares)::

    directory/step_<N>/rank0.fdl[.gz]       rank 0's model (flodl's format)
    directory/step_<N>/rank0.fdl.meta       its metadata (snapsvc.files.meta)
    directory/step_<N>/rank0.optim.fdl      its optimizer state, when saved
    directory/step_<N>/rank0.fdl.data       its tensors of dtypes .fdl lacks, when any
    ...                                     the same for every rank
    directory/step_<N>/manifest.msgpack     written last, by rank 0

A ``step_<N>`` directory without a valid manifest is incomplete by
definition: the manifest is written (durably: temp file, fsync, rename,
fsync of the step directory and of ``directory``) only after every rank has
reported its files durable, and it records each rank's file name, size and
CRC-32 (and those of its optimizer file and data file). :func:`~snapsvc.distributed.tier.latest_checkpoint` returns only
complete checkpoints.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

from ..files.durable import atomic_write, fsync_dir
from ..format import fdl
from ..errors import CheckpointNotFoundError, FormatError
from ..files.meta import meta_path, read_msgpack_file, unpack_msgpack_map
from ..format.protocol import pack_value

__all__ = ["MANIFEST_NAME", "RAM_MANIFEST_NAME", "Manifest", "RankFile", "parse_manifest", "read_manifest", "step_dir",
           "step_number"]

log = logging.getLogger("snapsvc")


MANIFEST_NAME = "manifest.msgpack"
# a memory-only step's manifest: its rank files are in the RAM tier (own or replicas), so
# the disk tier (latest_checkpoint without RAM, ls, uploads) never takes it for complete
RAM_MANIFEST_NAME = "manifest.ram.msgpack"
MANIFEST_MAGIC = "snapsvc-dist-manifest"
MANIFEST_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d+)$")
_MAX_MANIFEST = 64 << 20
_MANIFEST_FORMAT: dict[str, Any] = {"magic": MANIFEST_MAGIC, "version_key": "manifest_version",
                    "version": MANIFEST_VERSION, "limit": _MAX_MANIFEST}


def step_dir(directory: str | os.PathLike[str], step: int) -> str:
    """``directory/step_<step>``."""
    return os.path.join(os.path.abspath(directory), f"step_{int(step)}")


def _rank_file(rank: int, compressed: bool) -> str:
    return f"rank{rank}.fdl" + (".gz" if compressed else "")


# -- manifest ---------------------------------------------------------------------
@dataclass
class RankFile:
    """One rank's files in a checkpoint, as the manifest records them."""

    rank: int
    file: str                      # name inside the step directory
    size: int                      # bytes on disk
    crc32: int                     # of those bytes
    optim: dict[str, Any] | None = None  # {"file", "size", "crc32"} of the optimizer file
    # sharded checkpoints: one record per entry of ``file`` or ``data`` (see docs/distributed.md)
    entries: list[dict[str, Any]] | None = None
    # {"file", "size", "crc32"} of the data file (tensors .fdl has no tag for), when written
    data: dict[str, Any] | None = None


@dataclass
class Manifest:
    """A complete multi-rank checkpoint. ``path`` is its step directory (not stored)."""

    step: int
    world_size: int
    ranks: list[RankFile]
    format: str = "fdl"
    format_version: int = fdl.VERSION
    created: float = field(default_factory=time.time)
    epoch: int | None = None       # rank 0's; each rank's own is in its .meta
    metrics: dict[str, float] = field(default_factory=dict)  # rank 0's
    # sharded checkpoints: {"params", "buffers": names in model order, "optimizer": its
    # class, param groups and non-tensor state (snapsvc.state.resume), or None}
    sharded: dict[str, Any] | None = None
    path: str = ""


def _committed(r: RankFile, meta: Any
               ) -> list[tuple[str, str, tuple[Any, Any], tuple[Any, Any]]]:
    """(role, file name, (size, CRC-32) in the rank's ``meta``, (size, CRC-32) in the
    manifest) of the rank file and each companion the manifest records: they differ
    when a file changed after the checkpoint was committed."""
    out: list[tuple[str, str, tuple[Any, Any], tuple[Any, Any]]] = [
        ("file", r.file, (meta.size, meta.crc32), (r.size, r.crc32))]
    for role, record, saved in (("optim", r.optim, meta.optimizer), ("data", r.data, meta.data)):
        if record is not None:
            saved = saved or {}
            out.append((role, record["file"], (saved.get("size"), saved.get("crc32")),
                        (record.get("size"), record.get("crc32"))))
    return out


def _write_manifest(directory: str, manifest: Manifest, name: str = MANIFEST_NAME) -> str:
    """Durably write ``directory/<name>``; fsync ``directory``'s parent too."""
    body = {"magic": MANIFEST_MAGIC, "manifest_version": MANIFEST_VERSION,
            **{k: v for k, v in asdict(manifest).items() if k != "path"}}
    path = os.path.join(directory, name)
    with atomic_write(path) as out:   # temp, fsync, rename, fsync step dir
        out.write(pack_value(body))
    fsync_dir(os.path.dirname(os.path.abspath(directory)))  # the step_<N> entry itself
    return path


def _plain_name(name: Any, where: str) -> str:
    if not isinstance(name, str) or not name or os.path.basename(name) != name \
            or name in (".", ".."):
        raise FormatError(f"{name!r} is not a file name inside the step directory", path=where)
    return name


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Decode the manifest of a step directory (or the manifest file itself).

    Raises :class:`FormatError` when it is missing (an incomplete checkpoint)
    or malformed, :class:`CheckpointNotFoundError` when ``path`` does not exist. Does not look at the rank files; :func:`latest_checkpoint`
    does.
    """
    path = os.path.abspath(os.fspath(path))
    if not os.path.lexists(path):
        raise CheckpointNotFoundError(errno.ENOENT, "no such step directory", path)
    if os.path.isdir(path):
        directory, mpath = path, os.path.join(path, MANIFEST_NAME)
    else:
        directory, mpath = os.path.dirname(path), path
    raw = read_msgpack_file(
        mpath, what="manifest", missing="no manifest: the checkpoint is incomplete (not every "
        "rank's file was reported durable, or the save is still running); latest_checkpoint() "
        "finds the newest complete one", **_MANIFEST_FORMAT)
    return _manifest_from(raw, mpath, directory)


def parse_manifest(data: bytes, mpath: str, directory: str) -> Manifest:
    """A manifest from its bytes (a remote object ``mpath``); ``directory`` becomes its path."""
    return _manifest_from(unpack_msgpack_map(data, mpath, what="manifest", **_MANIFEST_FORMAT),
                          mpath, directory)


def _manifest_from(raw: dict[str, Any], mpath: str, directory: str) -> Manifest:
    """The checked :class:`Manifest` of a decoded manifest map."""
    try:
        ranks = [RankFile(**r) for r in raw["ranks"]]
        fields = {k: raw[k] for k in Manifest.__dataclass_fields__ if k in raw and k != "ranks"}
        m = Manifest(ranks=ranks, **fields)
    except (KeyError, TypeError) as e:
        raise FormatError(f"manifest lacks or misnames a field ({e})", path=mpath) from None
    m.path = directory
    if not isinstance(m.step, int) or not isinstance(m.world_size, int) or m.world_size < 1:
        raise FormatError(f"manifest has step {m.step!r}, world size {m.world_size!r}",
                          path=mpath)
    if [r.rank for r in m.ranks] != list(range(m.world_size)):
        raise FormatError(f"manifest lists ranks {[r.rank for r in m.ranks]} for world size "
                          f"{m.world_size}", path=mpath)
    for r in m.ranks:
        _plain_name(r.file, mpath)
        for companion in (r.optim, r.data):
            if companion is not None:
                _plain_name(companion.get("file"), mpath)
    return m


def _missing(m: Manifest, size_of: Callable[[str], int | None] | None = None,
             where: str | None = None) -> list[str]:
    """What the manifest lists that is absent or not of the recorded size (cheap: no reads).
    ``size_of(name)``: the size of a file of the step, None if absent (default: stat
    in ``m.path``); ``where``: the step's name in the messages (default ``m.path``)."""
    if size_of is None:
        size_of = functools.partial(_stat_size, m.path)
    where = m.path if where is None else where
    problems = []

    def check(name: str, size: int | None) -> None:
        actual = size_of(name)
        if actual is None:
            problems.append(f"{where}/{name}: missing")
        elif size is not None and actual != size:
            problems.append(f"{where}/{name}: {actual} bytes, the manifest says {size}")

    for r in m.ranks:
        check(r.file, r.size)
        check(meta_path(r.file), None)
        for companion in (r.optim, r.data):
            if companion is not None:
                check(companion["file"], companion["size"])
    return problems


def _stat_size(directory: str, name: str) -> int | None:
    try:
        return os.stat(os.path.join(directory, name)).st_size
    except FileNotFoundError:
        return None


def step_number(name: str) -> int | None:
    """N for a directory named ``step_<N>``, else None."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def _complete_local(directory: str | os.PathLike[str]) -> Iterator[tuple[int, Manifest]]:
    """(step, manifest) of each complete ``step_<N>`` directory under ``directory``,
    newest first (lazily: the caller may stop at the first)."""
    directory = os.path.abspath(os.fspath(directory))
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    steps = sorted(((n, name) for name in names if (n := step_number(name)) is not None),
                   reverse=True)
    for step, name in steps:
        path = os.path.join(directory, name)
        try:
            m = read_manifest(path)
        except (FormatError, OSError):
            continue
        if m.step != step:
            log.warning("%s: manifest says step %d; skipped", path, m.step)
            continue
        problems = _missing(m)
        if problems:
            log.warning("%s has a manifest but is damaged; skipped: %s", path, "; ".join(problems))
            continue
        yield step, m


def _latest_local(directory: str | os.PathLike[str]) -> tuple[int, str] | None:
    """(step, path) of the newest complete ``step_<N>`` directory under ``directory``."""
    for step, m in _complete_local(directory):
        return step, m.path
    return None

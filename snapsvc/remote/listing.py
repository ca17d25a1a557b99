"""What ``snapsvc ls`` shows: the complete checkpoints of each tier, side by side.

A checkpoint is listed when its ``.meta`` exists beside its file (the commit
marker on both tiers); its step is ``extra["step"]`` when the submit gave one,
else the last number in its name. The tiers are merged by name and CRC-32: a
name whose copies differ is listed once per tier. Multi-rank checkpoints (a
directory of every rank's files and a manifest) are found by the caller's
``steps`` scanner (:func:`snapsvc.distributed.tier.listed_steps`; this layer
cannot read a manifest): each is one entry, and the files in their
directories are not checkpoints of their own.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping

from ..errors import FormatError
from ..files.metafile import META_SUFFIX, Meta, companions, parse_meta
from ..files.ramtier import complete, number, problem, ram_folder
from .fetch import Progress, run_sync
from .store import Store, open_store

__all__ = ["Listed", "StepScanner", "list_checkpoints", "latest"]

log = logging.getLogger("snapsvc")

_NUMBER = re.compile(r"\d+")
_READS_IN_FLIGHT = 16


@dataclass
class Listed:
    name: str                 # path under the tier's root, "/"-separated
    step: int | None
    bytes: int                # the checkpoint's files, metadata included
    metrics: dict[str, Any] = field(default_factory=dict)
    created: float | None = None
    tiers: list[str] = field(default_factory=list)
    crc32: str | None = None  # the main file's, as its .meta records (hex)


def _step(name: str, meta: Meta) -> int | None:
    extra = meta.extra
    if isinstance(extra, dict) and type(extra.get("step")) is int:
        return extra["step"]
    numbers = _NUMBER.findall(name.rpartition("/")[2])
    return int(numbers[-1]) if numbers else None


def _listed(name: str, meta: Meta, meta_bytes: int) -> Listed:
    size = meta.size + meta_bytes + sum(c.size for c in companions(name, meta))
    return Listed(name, _step(name, meta), size,
                  dict(meta.metrics) if isinstance(meta.metrics, dict) else {},
                  meta.created if isinstance(meta.created, (int, float)) else None,
                  crc32=f"{meta.crc32:08x}" if isinstance(meta.crc32, int) else None)


# (store, its objects' sizes by key) -> (the complete multi-rank checkpoints, and the
# directories, "/"-ended, of every multi-rank checkpoint, complete or not)
StepScanner = Callable[[Store, dict[str, int]], Awaitable[tuple[list[Listed], tuple[str, ...]]]]


async def _scan(store: Store, steps: StepScanner | None, progress: Progress | None
                ) -> list[Listed]:
    objects = {o.key: o.size for o in await store.list(progress=progress)}
    out, theirs = await steps(store, objects) if steps is not None else ([], ())
    names = [k[: -len(META_SUFFIX)] for k in objects
             if k.endswith(META_SUFFIX) and k[: -len(META_SUFFIX)] in objects
             and not k.startswith(theirs)]
    gate = asyncio.Semaphore(_READS_IN_FLIGHT)
    done = 0

    async def get(name: str) -> bytes | None:
        nonlocal done
        async with gate:
            data = await store.get(name + META_SUFFIX)
        done += 1
        if progress is not None:
            progress("reading metadata", done, len(names))
        return data

    metas = await asyncio.gather(*(get(n) for n in names))
    for name, data in zip(names, metas):
        if data is None:  # deleted meanwhile
            continue
        try:
            out.append(_listed(name, parse_meta(data, store.key_url(name + META_SUFFIX)),
                               len(data)))
        except FormatError as e:
            log.warning("%s: unreadable metadata, not listed: %s",
                        store.key_url(name + META_SUFFIX), e.reason)
    return out


def list_checkpoints(tiers: list[tuple[str, str]], steps: StepScanner | None = None, *,
                     progress: Progress | None = None) -> list[Listed]:
    """The complete checkpoints of each ``(tier name, URL or directory)``, newest
    step first; one entry for a name the tiers hold alike (the same size and
    CRC-32 of its file), one per tier where they differ (a local ``best.fdl``
    rewritten since its upload). ``steps`` finds the multi-rank ones;
    ``progress(phase, done, total)`` as it lists."""
    merged: dict[tuple[str, int, str | None], Listed] = {}
    for tier, location in tiers:
        for item in run_sync(_scan(open_store(location), steps, progress)):
            known = merged.setdefault((item.name, item.bytes, item.crc32), item)
            known.tiers.append(tier)
    return sorted(merged.values(), key=lambda r: (r.step is not None, r.step or 0,
                                                   r.created or 0.0, r.name), reverse=True)


def latest(directory: str | os.PathLike[str], *,
           remote: str | os.PathLike[str] | None = None,
           remote_options: Mapping[str, Any] | None = None) -> str | None:
    """The newest complete checkpoint of ``directory`` across the RAM tier, the
    disk and ``remote`` (``s3://``/``gs://``/``az://`` or a mounted directory), or None.

    Newest: the highest number in its name (``step1200.fdl``); at a tie the
    faster tier (RAM, disk, remote), then the newest metadata. Complete: its file
    and its ``.meta`` are there; a RAM copy is also checked whole (size and CRC-32
    of every part): a bad one is skipped with a ``RuntimeWarning``, so the disk
    copy, else the remote one, is the answer. The answer is a path under
    ``directory`` (:func:`snapsvc.load` reads its RAM copy when one is held), or a
    URL (or path) under ``remote`` when only that tier holds the newest; every
    reader accepts both. Only the directory's own files count, not its subfolders.
    ``remote_options``: as ``SnapshotWriter``'s, for obstore.
    """
    directory = os.path.abspath(os.fspath(directory))
    found: list[tuple[int, int, float, str, str | None]] = []  # step, -tier, when, path, RAM copy
    folder = ram_folder(directory)
    if folder is not None:
        found += [(step, 0, when, os.path.join(directory, name), os.path.join(folder, name))
                  for name, (step, when) in complete(folder).items()]
    found += [(step, -1, when, os.path.join(directory, name), None)
              for name, (step, when) in complete(directory).items()]
    if remote is not None:
        base = os.fspath(remote).rstrip("/")
        store = open_store(remote, options=remote_options)
        found += [(number(item.name), -2, item.created or 0.0, f"{base}/{item.name}", None)
                  for item in run_sync(_scan(store, None, None)) if "/" not in item.name]
    for _, _, _, path, copy in sorted(found, key=lambda f: f[:3], reverse=True):
        why = None if copy is None else problem(copy)
        if why is not None:
            warnings.warn(f"the RAM copy of {path} is bad ({why}); skipped for the next "
                          "newest copy", RuntimeWarning, stacklevel=2)
            continue
        return path
    return None

"""What the uploader does beside uploads: the start-up round, and ``remote_keep_last``.

Scope. A writer touches on the remote tier only what it, or a writer before
it on the same directory, uploads (:class:`Scope`): keys of the series its
local directory holds (names in one folder that differ only in digits), or
of a file it holds; a rank of a multi-rank writer, only its own files
(``rank3.*``). So at a bucket's root another application's objects and
uploads are never touched, nor another rank's.

Start-up round (:func:`start_up`), retried by the uploader as an upload is:

- unfinished uploads are aborted (multipart uploads, a directory's temp
  files) when provably abandoned: in scope, begun before this writer started,
  and not one of its own;
- data objects without their ``.meta`` (an upload that failed for good after
  uncommitting the old copy) are deleted when in scope and older than
  ``remote_timeout`` before this writer started (any writer's upload, retries
  included, ends within its ``remote_timeout``);
- checkpoints complete locally but not remotely (no remote ``.meta``, or one
  with other bytes) are returned, to be queued, oldest first; less those that
  ``remote_keep_last`` would remove as soon as they are up.

Retention (:func:`prune`): after each upload, the complete remote
checkpoints of the same series beyond the newest ``keep_last`` in write
order (the ``created`` time each ``.meta`` records; not the number in the
name, which a run resumed from an earlier step repeats) are deleted,
``.meta`` first, then the data. The one just committed is never deleted.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re
from typing import Callable

from ..errors import FormatError
from ..files.durable import TMP_SUFFIX
from ..files.metafile import META_SUFFIX, checkpoint_names, data_owner, parse_meta, read_meta
from .store import Store, StoredObject

__all__ = ["Scope", "series_of", "owner", "local_checkpoints", "start_up", "prune"]

log = logging.getLogger("snapsvc.remote")

_DIGITS = re.compile(r"\d+")


def series_of(key: str) -> tuple[str, str]:
    """(folder, name with each run of digits as ``#``): the rotation series of a key."""
    folder, _, name = key.rpartition("/")
    return folder, _DIGITS.sub("#", name)


def _number(key: str) -> tuple[int, ...]:
    return tuple(int(d) for d in _DIGITS.findall(key.rpartition("/")[2]))


def owner(key: str) -> str:
    """The checkpoint that the file ``key`` belongs to: the one whose data or
    optimizer file it is, else itself."""
    found = data_owner(key)
    if found is not None:
        return found
    for suffix in (".fdl.gz", ".fdl", ""):
        tail = ".optim" + suffix
        if key.endswith(tail) and len(key) > len(tail):
            return key[: -len(tail)] + suffix
    return key


def local_checkpoints(directory: str) -> list[str]:
    """Every checkpoint under ``directory`` whose file and ``.meta`` both exist."""
    out = []
    for d, _, names in os.walk(directory):
        present = set(names)
        for n in names:
            if n.endswith(META_SUFFIX) and not n.endswith(TMP_SUFFIX) \
                    and n[: -len(META_SUFFIX)] in present:
                out.append(os.path.join(d, n[: -len(META_SUFFIX)]))
    return out


class Scope:
    """The remote keys a writer may remove (see the module docstring): ``names``,
    a file-name pattern (a rank's ``rank3.*``), or else the series and files of
    ``directory``; never a key in ``busy()`` (this writer's uploads under way)."""

    def __init__(self, directory: str, names: str | None,
                 busy: Callable[[], set[str]]) -> None:
        self.directory = directory
        self.names = names
        self.busy = busy
        self.series = set() if names is not None else {
            series_of(os.path.relpath(p, directory).replace(os.sep, "/"))
            for p in local_checkpoints(directory)}

    def __call__(self, key: str) -> bool:
        if key in self.busy():
            return False
        if self.names is not None:
            return fnmatch.fnmatchcase(key.rpartition("/")[2], self.names)
        return series_of(owner(key)) in self.series \
            or os.path.isfile(os.path.join(self.directory, key))


async def start_up(store: Store, scope: Scope, *, started: float, remote_timeout: float,
                   keep: tuple[str, ...], scan: bool, key_of: Callable[[str], str],
                   queued: Callable[[str], bool], keep_last: int | None,
                   created: dict[str, tuple[float, float]]) -> list[str]:
    """One start-up round (see the module docstring); the local checkpoints to
    upload, oldest first. ``keep``: names no ``.meta`` vouches for that are
    kept all the same (a step's manifest); ``key_of``: a local path's key;
    ``queued``: is this local path queued, or uploaded, already; ``keep_last`` and ``created``
    as for :func:`prune`, whose rotation would remove some at once: those are not
    uploaded."""
    aborted = await store.abort_stale_uploads(started, scope)
    if aborted:
        log.info("aborted %d unfinished upload(s) under %s", aborted, store.url)
    objects = {o.key: o for o in await store.list()}
    await _remove_orphans(store, objects, scope, started - remote_timeout, keep)
    if not scan:
        return []
    todo = []
    for path in local_checkpoints(scope.directory):
        try:
            written = os.stat(path + META_SUFFIX).st_mtime
        except FileNotFoundError:  # rotated away meanwhile
            continue
        if written >= started or queued(path):
            continue  # written by this writer: queued by it
        key = key_of(path)
        if key + META_SUFFIX in objects:
            with open(path + META_SUFFIX, "rb") as f:
                local_meta = f.read()
            if await store.get(key + META_SUFFIX) == local_meta:
                continue
        todo.append((written, path))
    paths = [path for _, path in sorted(todo)]
    if keep_last is not None:
        paths = await _not_rotated_at_once(store, objects, paths, keep_last, created, key_of)
    return paths


async def _not_rotated_at_once(store: Store, objects: dict[str, StoredObject],
                               paths: list[str], keep_last: int,
                               created: dict[str, tuple[float, float]],
                               key_of: Callable[[str], str]) -> list[str]:
    """``paths`` less those that :func:`prune` would remove once uploaded: in
    write order, ``keep_last`` newer ones of their series are, or will be, remote."""
    when: dict[str, float] = {}
    for path in paths:
        try:
            meta = read_meta(path)
        except (OSError, FormatError):
            continue  # the upload says why
        if isinstance(meta.created, (int, float)):
            when[key_of(path)] = meta.created
    complete = [k[: -len(META_SUFFIX)] for k in objects
                if k.endswith(META_SUFFIX) and k[: -len(META_SUFFIX)] in objects]
    series = {series_of(k) for k in when}
    for name in complete:
        if series_of(name) in series and name not in when:
            modified = objects[name + META_SUFFIX].modified
            if created.get(name, (None,))[0] != modified:
                created[name] = (modified, await _created(store, name, modified))
            when[name] = created[name][1]
    out = []
    for path in paths:
        key = key_of(path)
        newer = [k for k in when if series_of(k) == series_of(key)
                 and (when[k], _number(k)) > (when.get(key, float("inf")), _number(key))]
        if len(newer) >= keep_last:
            log.info("not uploading %s: remote_keep_last=%d would remove it at once (%d newer "
                     "checkpoints of its series are, or will be, on the remote tier)", path,
                     keep_last, len(newer))
            continue
        out.append(path)
    return out


async def _remove_orphans(store: Store, objects: dict[str, StoredObject], scope: Scope,
                          before: float, keep: tuple[str, ...]) -> None:
    """Delete the data objects in ``scope`` that no ``.meta`` vouches for, last
    written before ``before``."""
    committed = {k[: -len(META_SUFFIX)] for k in objects if k.endswith(META_SUFFIX)}
    for key, o in sorted(objects.items()):
        if key.endswith(META_SUFFIX) or key.rpartition("/")[2] in keep \
                or key in committed or owner(key) in committed:
            continue
        if o.modified < before and scope(key):
            await store.delete(key)
            log.info("removed %s: no metadata vouches for it (an upload that failed for good)",
                     store.key_url(key))


async def prune(store: Store, key: str, keep_last: int,
                created: dict[str, tuple[float, float]]) -> None:
    """``remote_keep_last`` after ``key`` was committed (see the module docstring).
    ``created``: key -> (its ``.meta``'s modified time, the ``created`` it records),
    kept across calls so each ``.meta`` is read once."""
    assert keep_last >= 1
    folder, pattern = series_of(key)
    objects = {o.key: o for o in await store.list(f"{folder}/" if folder else "")}
    complete = [k[: -len(META_SUFFIX)] for k in objects
                if k.endswith(META_SUFFIX) and k[: -len(META_SUFFIX)] in objects
                and series_of(k[: -len(META_SUFFIX)]) == (folder, pattern)]
    for name in complete:
        modified = objects[name + META_SUFFIX].modified
        if created.get(name, (None,))[0] != modified:
            created[name] = (modified, await _created(store, name, modified))
    ranked = sorted(complete, key=lambda n: (created[n][1], _number(n)))
    kept = set(ranked[-keep_last:]) | {key}  # never what was just committed
    for old in ranked:
        if old in kept:
            continue
        for k in checkpoint_names(old):  # metadata first: it vouches for the rest
            await store.delete(k)  # the writer's names; absent is fine
        created.pop(old, None)
        log.info("remote rotation: removed %s", store.key_url(old))


async def _created(store: Store, name: str, modified: float) -> float:
    """When ``name`` was written, as its ``.meta`` records; its upload time if unreadable."""
    data = await store.get(name + META_SUFFIX)
    try:
        meta = parse_meta(data or b"", store.key_url(name + META_SUFFIX))
    except FormatError:
        return modified
    return meta.created if isinstance(meta.created, (int, float)) else modified

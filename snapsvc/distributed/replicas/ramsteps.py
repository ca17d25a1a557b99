"""Steps complete in RAM: found by :func:`latest_checkpoint`, read by :func:`restore_distributed`.

A step is complete in RAM when its manifest (``manifest.msgpack``, or
``manifest.ram.msgpack`` for a memory-only step) is in its directory and every
rank's file of it is held by some live copy: the rank's own RAM copy, a
replica in a peer's RAM (:mod:`.replicas`), or the disk. No rank sees the
others' RAM, so deciding is a collective: each rank checks the copies it
holds (their CRC-32s, against their metadata: a bad copy is logged with the
rank and the source, and never offered), then every rank gathers every
rank's list and takes the same answer.

Reading such a step: per rank file needed (this rank's own; every rank's for
a sharded checkpoint), the first good source in the order own RAM, a peer's
replica (sent over a gloo group), the disk, the remote tier (when given).
Each copy is checked (its CRC-32s, and that its metadata is the one the
manifest committed) before it is used; a bad one is logged with the rank and
the source and skipped for the next. The files land in a private folder laid
out as the step directory, which the usual readers then read and check as
they check a step on disk.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
from typing import Any, Iterator

import torch.distributed as dist

from ...errors import SnapsvcError
from ...files.meta import read_meta
from ...files.metafile import checkpoint_names
from ...files.ramtier import held
from ...remote.fetch import fetched
from ...remote.store import is_url
from ..coord import _all_gather_msg, _new_group
from ..manifest import MANIFEST_NAME, RAM_MANIFEST_NAME, Manifest, _committed, _missing, \
    read_manifest, step_dir, step_number
from .send import held_by, recv_header, recv_to_folder, send_files, verified

__all__ = ["ram_latest", "ram_step", "RAM_TIMEOUT", "shard_places"]

log = logging.getLogger("snapsvc")

RAM_TIMEOUT = 300.0   # seconds a rank waits for the others in these collectives

OWN, REPLICA, DISK, REMOTE = "own RAM", "replica RAM", "disk", "the remote tier"


def _manifest(path: str) -> Manifest | None:
    """The step's manifest, disk or memory-only; None when it has none or it is bad."""
    for name in (MANIFEST_NAME, RAM_MANIFEST_NAME):
        if os.path.exists(os.path.join(path, name)):
            try:
                return read_manifest(os.path.join(path, name))
            except SnapsvcError as e:
                log.warning("%s: unreadable manifest; skipped: %s", path, e)
                return None
    return None


def _on_disk(m: Manifest) -> bool:
    return not _missing(m)


def _rank_on_disk(m: Manifest, rank: int) -> bool:
    """Rank ``rank``'s files of ``m`` are all on disk at their committed sizes."""
    return not _missing(dataclasses.replace(m, ranks=[m.ranks[rank]]))


def _copies(m: Manifest, rank: int, check: bool) -> dict[int, tuple[str, str]]:
    """The copies of ``m``'s rank files this rank holds: origin -> (source, path),
    each checked (``check``) against its metadata's CRC-32s."""
    out: dict[int, tuple[str, str]] = {}
    if rank < m.world_size:
        own = held(os.path.join(m.path, m.ranks[rank].file))
        if own is not None and (not check or verified(own, f"rank {rank}'s own RAM copy "
                                                          f"of step {m.step}")):
            out[rank] = (OWN, own)
    for origin, ram in sorted(held_by(os.path.dirname(m.path), m.step, rank,
                                      m.world_size).items()):
        if origin in out or os.path.basename(ram) != m.ranks[origin].file:
            continue
        if not check or verified(ram, f"rank {rank}'s replica of rank {origin}'s file of "
                                      f"step {m.step}"):
            out[origin] = (REPLICA, ram)
    return out


def _rank_world(process_group: Any) -> tuple[int, int] | None:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.get_rank(process_group), dist.get_world_size(process_group)


@contextlib.contextmanager
def _group(process_group: Any) -> Iterator[Any]:
    group = _new_group(process_group, RAM_TIMEOUT)
    try:
        yield group
    finally:
        dist.destroy_process_group(group)


def ram_latest(directory: str | os.PathLike[str], above: int | None,
               process_group: Any = None, far: tuple[int, str] | None = None,
               remote: bool = False, failed: OSError | None = None
               ) -> tuple[int, str] | None:
    """The newest step above ``above`` (the disk's newest) complete in RAM (see the
    module docstring), or the remote tier's newest step when newer: ``far`` is this
    rank's listing's, and the newest any rank listed is taken, so that a step
    committed remotely between two ranks' listings gives them one answer; a tie goes
    to RAM. ``failed``: this rank's listing's error, raised on every rank after the
    gather (naming the rank), so that none waits for a rank that left. The same on
    every rank; None when there is neither. A collective over the world (every rank
    must call it) when a remote tier was listed (``remote``) in a world of more than
    one, or when the directory holds a step newer than ``above`` that the disk alone
    does not complete (the same on every rank: the directory is shared); else None
    (or ``failed`` raised) without one (the caller takes ``far`` itself)."""
    directory = os.path.abspath(os.fspath(directory))
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        names = []
    candidates = []
    for n in sorted((s for s in map(step_number, names) if s is not None), reverse=True):
        if above is not None and n <= above:
            break
        m = _manifest(step_dir(directory, n))
        if m is not None and m.step == n and not _on_disk(m):
            candidates.append(m)
    where = _rank_world(process_group)
    if where is None or not (candidates or (remote and where[1] > 1)):
        if failed is not None:
            raise failed
        return None
    rank, world = where
    # only the steps the walk can take are CRC-checked: none below this rank's listing of
    # the remote tier (a tie goes to RAM); whether to gather went by the whole list above,
    # the same on every rank
    mine = {"held": {m.step: sorted(_copies(m, rank, check=True)) for m in candidates
                     if far is None or m.step >= far[0]},
            "far": None if far is None else list(far),
            "failed": None if failed is None else [type(failed).__name__, str(failed)]}
    with _group(process_group) as group:
        tables = _all_gather_msg(mine, world, group)
    _raise_listing_error(tables, failed)
    fars = [(int(t["far"][0]), str(t["far"][1])) for t in tables if t["far"] is not None]
    newest_far = max(fars) if fars else None
    for m in candidates:   # newest first: the same walk on every rank
        if newest_far is not None and m.step < newest_far[0]:
            break   # a tie goes to RAM: the fastest tier
        have = {o for t in tables for o in t["held"].get(m.step, ())}
        have |= {r for r in range(m.world_size) if _rank_on_disk(m, r)}
        if have >= set(range(m.world_size)):
            return m.step, m.path
        log.info("step %d is not complete in RAM: no live copy of rank(s) %s", m.step,
                 sorted(set(range(m.world_size)) - have))
    return newest_far


def _raise_listing_error(tables: list[dict[str, Any]], failed: OSError | None) -> None:
    """The first rank's remote listing error, if any rank's failed: the same type and
    message on every rank (this rank's own, if any, chained)."""
    for r, t in enumerate(tables):
        if t["failed"] is not None:
            kind, text = t["failed"]
            cls = getattr(builtins, kind, OSError)
            if not (isinstance(cls, type) and issubclass(cls, OSError)):
                cls = OSError
            raise cls(f"rank {r}: {text}") from failed


@contextlib.contextmanager
def ram_step(path: str, process_group: Any, every_rank: bool, remote: Any = None,
             timeout: float | None = None) -> Iterator[Manifest | None]:
    """The step ``path`` as a manifest whose ``path`` is a private folder holding the
    rank files this rank needs (its own; every rank's with ``every_rank``), each from
    its first good source, ``remote`` (a URL or a mounted directory: the writer's
    remote tier, read within ``timeout``) last; None (no collective) when the disk
    holds the whole step or torch.distributed is not initialized (the disk readers
    then say what is wrong). A collective over the world otherwise."""
    m = _manifest(path)
    if m is None:
        yield None   # the readers say what is missing
        return
    if _on_disk(m):
        yield None
        return
    where = _rank_world(process_group)
    if where is None:   # one process: no peer to ask; the disk readers say what is wrong
        yield None
        return
    rank, world = where
    copies = _copies(m, rank, check=True)
    needs = list(range(m.world_size)) if every_rank else [rank] if rank < m.world_size else [0]
    view = tempfile.mkdtemp(prefix=f"snapsvc-step{m.step}-rank{rank}-")
    try:
        with contextlib.ExitStack() as fetches:   # remote copies live until the read is done
            with _group(process_group) as group:
                tables = _all_gather_msg({"have": sorted(copies), "needs": needs}, world, group)
                # the walk only: a slow disk or remote fetch inside it would time the peers out
                elsewhere = [origin for origin in range(m.world_size)
                             if _serve(m, origin, tables, copies, rank, group, view)]
            failed: list[SnapsvcError] = []
            for origin in elsewhere:
                try:
                    _from_disk_or_remote(m, origin, view, remote, timeout, fetches)
                except SnapsvcError as e:
                    failed.append(e)
            for other in failed[1:]:   # the first is raised; a resharded walk may have more
                log.error("snapsvc: rank %d, step %d: %s", rank, m.step, other)
            if failed:
                raise failed[0]
            yield dataclasses.replace(m, path=view)
    finally:
        shutil.rmtree(view, ignore_errors=True)


def _serve(m: Manifest, origin: int, tables: list[dict[str, Any]],
           copies: dict[int, tuple[str, str]], rank: int, group: Any, view: str) -> bool:
    """Bring ``origin``'s rank file to every rank that needs it from a RAM copy (the
    same walk on every rank). True: this rank needs it and no rank holds one, or
    receiving it failed (logged): it is to come from the next source."""
    needers = [r for r, t in enumerate(tables) if origin in t["needs"]]
    if not needers:
        return False
    holders = [r for r, t in enumerate(tables) if origin in t["have"]]
    holders.sort(key=lambda r: (r != origin, r))   # its own RAM first, then replicas
    if not holders:
        return rank in needers
    h = holders[0]
    if rank == h:
        source, ram = copies[origin]
        for n in needers:
            if n != rank:
                send_files(checkpoint_names(ram), n, group)
        if rank in needers:
            _link(ram, view)
        log.info("step %d: rank %d's file from rank %d's %s", m.step, origin, h, source)
    elif rank in needers:
        header = recv_header(h, group)
        try:
            if header["error"] is not None:
                raise SnapsvcError(header["error"])
            recv_to_folder(h, group, header, view)   # an OSError: the exchange kept in step
        except (SnapsvcError, OSError) as e:
            if isinstance(e, TimeoutError):
                raise   # the link is lost: the walk cannot go on
            log.warning("snapsvc: step %d: rank %d's file from rank %d's RAM could not be "
                        "received, the next source tried: %s", m.step, origin, h, e)
            return True   # fetched after the walk, from the disk or the remote tier
        log.info("step %d: rank %d's file from rank %d's RAM, over the gloo group",
                 m.step, origin, h)
    return False


def _from_disk_or_remote(m: Manifest, origin: int, view: str, remote: Any,
                         timeout: float | None, fetches: contextlib.ExitStack) -> None:
    """``origin``'s rank file, held in no RAM copy, into ``view`` from the disk, else
    from ``remote``'s copy of the step: the first one whole and committed. Without a
    remote the disk copy is not read whole first: the readers check the pieces they
    read, and a bad one is their error, naming the file."""
    name = m.ranks[origin].file
    disk = os.path.join(m.path, name)
    if os.path.exists(disk) and (remote is None or _good(m, origin, disk, DISK)):
        _link(disk, view)
        log.info("step %d: rank %d's file from %s", m.step, origin, DISK)
        return
    if remote is not None:
        where = f"{os.fspath(remote).rstrip('/')}/{os.path.basename(m.path)}/{name}"
        copy = _fetch(where, m, origin, timeout, fetches)
        if copy is not None and _good(m, origin, copy, f"{REMOTE} ({where})"):
            _link(copy, view)
            log.info("step %d: rank %d's file from %s (%s)", m.step, origin, REMOTE, where)
            return
    raise SnapsvcError(f"{m.path}: no good copy of rank {origin}'s file (not in its own RAM, "
                       "no replica in a peer's RAM, not whole on disk"
                       f"{'' if remote is None else ', not whole on the remote tier'}): restore "
                       "an older step (latest_checkpoint finds one)")


def _fetch(where: str, m: Manifest, origin: int, timeout: float | None,
           fetches: contextlib.ExitStack) -> str | None:
    """A local path of the remote copy ``where`` (an object store's, fetched and held by
    ``fetches``; a mounted directory's as it is); None when it is missing or bad."""
    if not is_url(where):
        return where if os.path.exists(where) else None
    try:
        return fetches.enter_context(fetched(where, timeout=timeout))
    except (SnapsvcError, OSError) as e:   # logged; there is no next source
        why = "is bad" if isinstance(e, SnapsvcError) else "could not be read"
        log.warning("snapsvc: rank %d's file of step %d on %s %s, skipped: %s", origin,
                    m.step, REMOTE, why, e)
        return None


def _good(m: Manifest, origin: int, path: str, source: str) -> bool:
    """The copy at ``path`` of ``origin``'s files passes its CRC-32 checks and is the one
    the manifest committed; else logged with the rank and ``source``."""
    what = f"rank {origin}'s file of step {m.step} on {source}"
    if not verified(path, what):
        return False
    for role, _, in_meta, in_manifest in _committed(m.ranks[origin], read_meta(path)):
        if in_meta != in_manifest:
            log.warning("snapsvc: %s is bad, skipped: its %s records size %s and CRC-32 %s, "
                        "the manifest %s and %s (not the committed copy)", what, role,
                        *in_meta, *in_manifest)
            return False
    return True


def _link(path: str, view: str) -> None:
    """``path``'s files (metadata and companions) into ``view``, as symlinks."""
    for p in checkpoint_names(path):
        if os.path.exists(p):
            os.symlink(p, os.path.join(view, os.path.basename(p)))



def shard_places(directory: str | os.PathLike[str]) -> list[tuple[str, list[list[str]]]]:
    """Where each rank's file of each step is held, for ``snapsvc ls``: per step
    folder with a manifest (on disk or memory-only), newest first, its name and per
    rank the places: ``own RAM``, ``replica RAM (rank H)``, ``disk``. A RAM copy is
    listed when complete (its metadata there), not checked; no torch.distributed."""
    directory = os.path.abspath(os.fspath(directory))
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    out = []
    for n in sorted((s for s in map(step_number, names) if s is not None), reverse=True):
        m = _manifest(step_dir(directory, n))
        if m is None or m.step != n:
            continue
        places: list[list[str]] = [[] for _ in range(m.world_size)]
        for r in range(m.world_size):
            if held(os.path.join(m.path, m.ranks[r].file)) is not None:
                places[r].append(OWN)
        for holder in range(m.world_size):
            for origin in sorted(held_by(directory, n, holder, m.world_size)):
                places[origin].append(f"{REPLICA} (rank {holder})")
        for r in range(m.world_size):
            if _rank_on_disk(m, r):
                places[r].append(DISK)
        out.append((os.path.basename(m.path), places))
    return out

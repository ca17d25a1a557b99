"""Both tiers of multi-rank checkpoints: ``latest_checkpoint`` and a step read from either.

The remote tier (``DistributedSnapshotWriter(remote=...)``) holds the local
layout under its root: ``step_<N>/rank<r>.fdl``, ``.meta``, ``.optim.fdl``
(each rank's sidecar uploads its own, ``.meta`` last), and
``step_<N>/manifest.msgpack``, written by rank 0 only after every rank's
upload committed. A remote step is complete exactly as a local one is: its
manifest decodes and names step N, and every file it lists, each rank's
``.meta`` included, exists with the recorded size (one listing; no data read).

A directory remote (a Lustre or NFS mount) is read as a local directory;
an object store (``s3://``, ``gs://``, ``az://``) through
:mod:`snapsvc.remote.store`, each rank fetching only the byte ranges it needs
(:class:`RemotePieces`), or its own files (:meth:`RemoteStep.rank_file`), each
checked against its recorded size and CRC-32.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import re
import warnings
from collections import defaultdict
from typing import Any, Iterator

from ..errors import FormatError
from ..files.meta import META_SUFFIX, Meta, parse_meta, read_meta
from ..files.ramtier import held, problem
from ..remote.fetch import TIMEOUT, fetched, run_sync
from ..remote.listing import Listed
from ..remote.store import Store, StoredObject, is_url, open_store, split_url
from ..remote.url import as_oserror
from .manifest import MANIFEST_NAME, Manifest, RankFile, _committed, _latest_local, _missing, \
    parse_manifest, read_manifest, step_number
from .pieces import _Global, _Piece, _PieceReader, _sizes
from .replicas.ramsteps import ram_latest

__all__ = ["latest_checkpoint", "open_step", "LocalStep", "RemoteStep", "RemotePieces",
           "remote_complete_steps", "listed_steps"]

log = logging.getLogger("snapsvc")

_READS_IN_FLIGHT = 8
_RANK_FILE = re.compile(r"rank\d+\.")   # rank<r>.fdl, its .meta, rank<r>.optim.fdl ...


def latest_checkpoint(directory: str | os.PathLike[str],
                      remote: str | os.PathLike[str] | None = None, *,
                      timeout: float | None = None) -> str | None:
    """The newest step complete on either tier, or None.

    ``directory``'s newest complete ``step_<N>`` (its path) unless ``remote``
    (a URL or a mounted directory, as given to ``DistributedSnapshotWriter``)
    holds a newer complete one: then that step's URL (or path). Complete: its
    manifest decodes, names this step, and every file it lists exists with the
    recorded size (sizes only; :func:`restore_distributed` checks CRC-32s of
    what it loads). Steps without a manifest are incomplete and skipped,
    whatever they hold. With torch.distributed initialized, a newer step complete
    in RAM counts too (its manifest in its directory, every rank's file held by
    a live copy: the rank's own RAM, a peer's replica, or the disk; see
    docs/distributed.md "Peer replicas"): deciding that is a collective, so every
    rank must call this when such a step may exist, and every rank gets the same
    answer. With ``remote``, the ranks also gather their listings of it (a collective
    in a world of more than one: every rank must call this): a step committed there
    between two ranks' listings gives them one answer. An unreachable remote is an
    ``OSError`` (``TimeoutError`` past ``timeout``,
    :data:`snapsvc.remote.fetch.TIMEOUT` by default), raised on every rank, naming
    the rank whose listing failed.
    """
    best = _latest_local(directory)
    far = None
    failed = None
    if remote is not None:
        try:   # raised after the ranks gather (ram_latest): none waits for this one
            if is_url(remote):
                far = _newest_remote(str(remote), None if best is None else best[0], timeout)
            else:
                far = _latest_local(remote)
        except OSError as e:
            failed = e
        if far is not None and best is not None and far[0] <= best[0]:
            far = None   # the local tier has it
    # a newer step complete in RAM (own copies, peers' replicas) or remotely: every rank
    # agrees (the remote's newest as any rank listed it, when they gather)
    agreed = ram_latest(directory, None if best is None else best[0], far=far,
                        remote=remote is not None, failed=failed)
    if agreed is not None:
        return agreed[1]
    best = far or best
    return None if best is None else best[1]


async def listed_steps(store: Store, objects: dict[str, int]
                       ) -> tuple[list[Listed], tuple[str, ...]]:
    """For ``snapsvc ls`` (a :data:`~snapsvc.remote.listing.StepScanner`): the complete
    multi-rank checkpoints among ``objects`` (sizes by key), each one entry named by its
    directory, with the manifest's step, metrics and time and the bytes of every file in
    it; and the directories of all, "/"-ended. A multi-rank checkpoint is a directory
    holding a manifest (``step_<N>``, or SnapsvcTrainer's ``checkpoint-<N>``), or a
    ``step_<N>`` one holding rank files and no manifest: incomplete, so not listed, as a
    file without its ``.meta`` is not. Complete is what :func:`latest_checkpoint` takes."""
    dirs: dict[str, dict[str, int]] = defaultdict(dict)
    for key, size in objects.items():
        head, _, name = key.rpartition("/")
        dirs[head][name] = size
    theirs = [d for d, files in dirs.items() if MANIFEST_NAME in files or (
        step_number(d.rpartition("/")[2]) is not None and any(map(_RANK_FILE.match, files)))]
    done = [d for d in theirs if MANIFEST_NAME in dirs[d]]
    manifests = await asyncio.gather(*(store.get(f"{d}/{MANIFEST_NAME}".lstrip("/"))
                                       for d in done))
    out = []
    for d, data in zip(done, manifests):
        m = _complete(data, store.key_url(d) if d else store.url, dirs[d],
                      step_number(d.rpartition("/")[2]))
        if m is not None:
            out.append(Listed(d or ".", m.step, sum(dirs[d].values()),
                              dict(m.metrics) if isinstance(m.metrics, dict) else {},
                              m.created if isinstance(m.created, (int, float)) else None))
    return out, tuple(f"{d}/" if d else "" for d in theirs)


def _complete(data: bytes | None, url: str, files: dict[str, int], step: int | None
              ) -> Manifest | None:
    """The manifest ``data`` of the step at ``url``, whose directory holds ``files``
    (sizes by name), when the step is complete: it decodes, names ``step`` (unless None)
    and every file it lists is there at its size. Else None, with a warning."""
    if data is None:  # deleted since the listing
        return None
    try:
        m = parse_manifest(data, f"{url}/{MANIFEST_NAME}", url)
    except FormatError as e:
        log.warning("%s: unreadable manifest; skipped: %s", url, e.reason)
        return None
    if step is not None and m.step != step:
        log.warning("%s: manifest says step %d; skipped", url, m.step)
        return None
    problems = _missing(m, files.get, url)
    if problems:
        log.warning("%s has a manifest but is damaged; skipped: %s", url, "; ".join(problems))
        return None
    return m


async def remote_complete_steps(store: Store, *, objects: list[StoredObject] | None = None,
                                above: int | None = None, enough: int | None = None
                                ) -> list[tuple[int, Manifest]]:
    """The complete steps under ``store``'s root, newest first, with their manifests:
    those above step ``above`` only, and no more than ``enough``. ``objects``: the
    root's listing, when the caller has it."""
    steps: dict[int, dict[str, int]] = defaultdict(dict)
    for o in await store.list() if objects is None else objects:
        head, _, name = o.key.partition("/")
        n = step_number(head)
        if n is not None and name and "/" not in name:
            steps[n][name] = o.size
    out: list[tuple[int, Manifest]] = []
    for n in sorted(steps, reverse=True):
        if (above is not None and n <= above) or (enough is not None and len(out) >= enough):
            break
        files = steps[n]
        if MANIFEST_NAME not in files:
            continue
        data = await store.get(f"step_{n}/{MANIFEST_NAME}")
        m = _complete(data, store.key_url(f"step_{n}"), files, n)
        if m is not None:
            out.append((n, m))
    return out


def _newest_remote(url: str, above: int | None,
                   timeout: float | None) -> tuple[int, str] | None:
    limit = TIMEOUT if timeout is None else timeout
    found = _run(remote_complete_steps(open_store(url, remote_timeout=limit), above=above,
                                       enough=1), f"listing {url}", limit)
    return (found[0][0], found[0][1].path) if found else None


def _run(coro: Any, what: str, limit: float) -> Any:
    """``coro`` within ``limit`` seconds; the engine's errors as one-line OSErrors."""
    try:
        return run_sync(asyncio.wait_for(coro, limit))
    except asyncio.TimeoutError:  # first: it is an OSError too
        raise TimeoutError(errno.ETIMEDOUT, f"{what}: not done within timeout={limit:g} s"
                           ) from None
    except FormatError:
        raise
    except Exception as e:  # the engine's errors (some OSErrors): where, one line, no secret
        raise as_oserror(e, what) from None


# -- one step, from either tier --------------------------------------------------------
class LocalStep:
    """A complete step directory: its manifest, metadata, rank files and pieces.

    A rank's files are read from the RAM tier (:mod:`snapsvc.files.ramtier`) when the
    sidecar holds a copy of them that is whole (size and CRC-32 of every part) and is
    the one the manifest committed; a bad copy is reported with a ``RuntimeWarning``
    and the step directory is read instead."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self._ram: dict[str, str] | None = None   # a file's path -> its good RAM copy

    def _source(self, path: str) -> str:
        if self._ram is None:
            self._ram = {}
            for r in self.manifest.ranks:
                self._ram.update(_ram_copies(self.manifest.path, r))
        return self._ram.get(path, path)

    def meta(self, name: str) -> Meta:
        return read_meta(self._source(os.path.join(self.manifest.path, name)))

    def pieces(self, verify: bool) -> _PieceReader:
        sizes = _sizes(self.manifest)
        return _PieceReader(sizes, verify, {p: self._source(p) for p in sizes})

    @contextlib.contextmanager
    def rank_file(self, name: str) -> Iterator[str]:
        """The path of the rank file ``name`` (with its ``.meta`` and optimizer file)."""
        yield self._source(os.path.join(self.manifest.path, name))


def _ram_copies(folder: str, r: RankFile) -> dict[str, str]:
    """Rank ``r``'s files in the step ``folder`` -> their RAM copies, when the sidecar
    holds a good copy of the ones committed; else nothing."""
    disk = os.path.join(folder, r.file)
    ram = held(disk)
    if ram is None:
        return {}
    bad = problem(ram)
    why = f"is bad ({bad})" if bad is not None else next(
        (f"is not the committed one (its {role} has size {a[0]} and CRC-32 {a[1]}, the "
         f"manifest says {b[0]} and {b[1]})"
         for role, _, a, b in _committed(r, read_meta(ram)) if a != b), None)
    if why is not None:
        warnings.warn(f"the RAM copy of {disk} {why}; reading the step directory instead",
                      RuntimeWarning, stacklevel=2)
        return {}
    names = [r.file, r.file + META_SUFFIX] + [
        rec["file"] for rec in (r.optim, r.data) if rec is not None]
    return {os.path.join(folder, n): os.path.join(os.path.dirname(ram), n) for n in names}


class RemoteStep(LocalStep):
    """A committed step on an object store (``url`` is its ``step_<N>``)."""

    def __init__(self, url: str, timeout: float | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout = TIMEOUT if timeout is None else timeout  # each read's deadline
        self.store = open_store(self.url, remote_timeout=self.timeout)
        mpath = f"{self.url}/{MANIFEST_NAME}"
        data = self._run(self.store.get(MANIFEST_NAME), self.url)
        if data is None:
            raise FormatError("no manifest on the remote tier: the checkpoint is incomplete "
                              "(not every rank's upload committed); latest_checkpoint(directory, "
                              "remote=...) finds the newest complete one", path=mpath)
        super().__init__(parse_manifest(data, mpath, self.url))

    def _run(self, coro: Any, url: str) -> Any:
        return _run(coro, f"reading {url}", self.timeout)

    def meta(self, name: str) -> Meta:
        url = f"{self.url}/{name}{META_SUFFIX}"
        data = self._run(self.store.get(name + META_SUFFIX), url)
        if data is None:
            raise FormatError("no metadata on the remote tier although the manifest lists "
                              "its file: the step was deleted in part", path=url)
        return parse_meta(data, url)

    def pieces(self, verify: bool) -> _PieceReader:
        return RemotePieces(_sizes(self.manifest), verify, self)

    @contextlib.contextmanager
    def rank_file(self, name: str) -> Iterator[str]:
        """A checked local copy of the rank file ``name`` and its optimizer file,
        for the ``with``; a reader's FormatError about it names the URL."""
        with fetched(f"{self.url}/{name}", timeout=self.timeout) as local:
            yield local


class RemotePieces(_PieceReader):
    """Pieces of a remote step's rank files, fetched by ranged reads, in parallel."""

    def __init__(self, sizes: dict[str, int], verify: bool, step: RemoteStep) -> None:
        super().__init__(sizes, verify)
        self._step = step
        self._cache: dict[tuple[str, int], memoryview] = {}
        self._sized: set[str] = set()

    def _key(self, file: str) -> str:
        return split_url(file)[1]

    def prefetch(self, wanted: list[tuple[_Global, list[int], list[int]]]) -> None:
        pieces = {(p.file, p.offset): p for g, o, n in wanted
                  for p, _, _ in self.overlapping(g, o, n)
                  if all(p.lengths) and (p.file, p.offset) not in self._cache}
        if pieces:
            self._step._run(self._fetch(list(pieces.values())), self._step.url)

    async def _fetch(self, pieces: list[_Piece]) -> None:
        store = self._step.store
        files = sorted({p.file for p in pieces} - self._sized)
        sizes = await asyncio.gather(*(store.size(self._key(f)) for f in files))
        for f, actual in zip(files, sizes):
            if actual is None:
                raise FormatError("missing on the remote tier although the manifest lists it; "
                                  "the step was deleted in part", path=f)
            if actual != self._sizes[f]:
                raise FormatError(f"{actual} bytes, the manifest says {self._sizes[f]}: "
                                  "truncated, or not the file the manifest committed", path=f)
            self._sized.add(f)
        gate = asyncio.Semaphore(_READS_IN_FLIGHT)

        async def one(p: _Piece) -> None:
            async with gate:
                self._cache[(p.file, p.offset)] = await store.get_range(
                    self._key(p.file), p.offset, p.end)

        await asyncio.gather(*(one(p) for p in pieces))

    def _bytes(self, g: _Global, p: _Piece) -> memoryview:
        if (p.file, p.offset) not in self._cache:  # not announced: fetched alone
            self.prefetch([(g, p.offsets, p.lengths)])
        return self._cache.pop((p.file, p.offset))


def open_step(path: str | os.PathLike[str], timeout: float | None = None) -> LocalStep:
    """The step ``path``: a local ``step_<N>`` directory, or a step's URL on an object
    store (read within ``timeout`` each)."""
    if is_url(path):
        return RemoteStep(str(path), timeout)
    return LocalStep(read_manifest(path))

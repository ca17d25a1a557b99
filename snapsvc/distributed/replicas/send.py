"""Peer replicas: each rank's snapshot also held in the RAM of ranks on other nodes.

Placement (:func:`place_replicas`) is a deterministic ring over the nodes:
the j-th copy of a rank's snapshot goes to the node j places after its own,
to the rank with the same position inside that node. A node is
``SNAPSVC_NODE``, else torchrun's ``GROUP_RANK``, else the hostname
(:func:`node_id`).

Transport (:class:`Replicator`): a gloo group of the writer's own, used by
one thread per rank, after a step is committed (the local copy is complete
and every rank agreed). Every rank walks the same list of (origin, holder)
pairs in the same order; only the two ranks of a pair act on it, so the
exchanges never cross. Per pair: a msgpack header (file names and sizes),
the files' bytes, then the holder's one-word answer. The holder writes the
files, metadata last, under the RAM tier's mirror of
``step_<N>/.replicas/held-by-<holder>/`` (:func:`replica_file`): the origin's
own bytes and metadata, so a read checks a replica's CRC-32s as the origin's.

Lifetime: a replica is a file in tmpfs that outlives a killed trainer (what a
lost node's peers serve); the next writer of that rank on the directory
adopts it, and a clean ``close()`` drops the replicas the rank holds. What
stays in RAM follows the steps complete in RAM (:mod:`.keep`).

Agreement without a collective of its own: each rank's next commit exchange
(:mod:`..commit`, which needs every rank anyway) carries its report of the
rounds it finished (its replicas placed or not), the holders that refused,
and the peers whose transfer failed. Every rank applies the same reports in
the same order before its next round, so placement and completeness agree.

Loss of a holder: a holder that cannot hold a replica answers why; a transfer
that fails (the peer's process or its replication died: closed connection, or
no answer within the group's timeout) loses that link. Either way the origin's
``replicated()`` raises naming the peer, the other pairs of the round go on,
and from the next agreed step the placement passes the peer over (the copy
goes to the next node of the ring), with one warning per origin. A rank whose
link was lost takes no more part (as origin or holder): its peers never wait
on it again, so nothing waits longer than one group timeout.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import re
import socket
import threading
import time
from typing import Any, Collection, Sequence


from ...errors import SnapsvcError
from ...files.metafile import checkpoint_names, meta_path
from ...files.ramtier import claim, drop, held, ram_path, tidy
from ...files.verify import verify
from ...format.protocol import pack_value, unpack_value
from ..coord import _reason
from ..manifest import step_dir
from .transport import Pipe, _recv_bytes, _send_bytes, recv_files, recv_header, \
    recv_to_folder, send_files

__all__ = ["node_id", "place_replicas", "replica_file", "Replicator", "NODE_ENV"]

log = logging.getLogger("snapsvc")

NODE_ENV = "SNAPSVC_NODE"
REPLICA_DIR = ".replicas"
_RANK_NAME = re.compile(r"rank(\d+)\.fdl(\.gz)?$")


def node_id() -> str:
    """This process's node: ``SNAPSVC_NODE``, else ``GROUP_RANK`` (torchrun), else the hostname."""
    for key in (NODE_ENV, "GROUP_RANK"):
        value = os.environ.get(key)
        if value:
            return value
    return socket.gethostname()


def place_replicas(nodes: Sequence[str], origin: int, k: int,
                   gone: Collection[int] = ()) -> list[int]:
    """The ranks that hold ``origin``'s ``k`` replicas, given each rank's node.

    A ring over the distinct nodes (in order of their first rank): copy j
    (1-based) goes to the node j after ``origin``'s, to the rank at the same
    position inside it (modulo its size). When there are fewer other nodes
    than ``k``, the rest go to other ranks of any node, nearest rank first;
    never to ``origin`` itself, never twice to one rank. The ranks in ``gone``
    (holders that could not hold) are passed over: a node left without any
    drops out of the ring, and the copy goes to the next node.
    """
    if k <= 0 or len(nodes) <= 1:
        return []
    order: list[str] = list(dict.fromkeys(nodes))
    members = {n: [r for r, m in enumerate(nodes) if m == n] for n in order}
    home = order.index(nodes[origin])
    position = members[nodes[origin]].index(origin)
    ring = [order[(home + j) % len(order)] for j in range(1, len(order))]
    ring = [n for n in ring if any(r not in gone for r in members[n])]
    out: list[int] = []
    for node in ring[:k]:
        ranks = [r for r in members[node] if r not in gone]
        out.append(ranks[position % len(ranks)])
    for step in range(1, len(nodes)):   # not enough nodes: other ranks, by distance
        if len(out) >= k:
            break
        r = (origin + step) % len(nodes)
        if r not in out and r not in gone:
            out.append(r)
    return out


def replica_file(directory: str, step: int, holder: int, name: str) -> str:
    """Where ``holder``'s replica of the rank file ``name`` of ``step`` is named
    (its RAM copy lives under the RAM tier's mirror of this path)."""
    return os.path.join(step_dir(directory, step), REPLICA_DIR, f"held-by-{holder}", name)


def verified(ram: str, what: str) -> bool:
    """``ram`` (a RAM copy, its metadata beside it) passes its CRC-32 checks;
    else logged, naming ``what`` (the rank and the source)."""
    report = verify(ram)
    if report.problems:
        log.warning("snapsvc: %s is bad, skipped: %s", what, report.problems[0])
        return False
    return True


def held_by(directory: str, step: int, holder: int, world: int) -> dict[int, str]:
    """The replicas ``holder`` keeps of ``step``: origin rank -> RAM copy (complete, unchecked)."""
    folder = os.path.dirname(replica_file(directory, step, holder, "x"))
    ram = ram_path(os.path.join(folder, "x"))
    if ram is None or not os.path.isdir(os.path.dirname(ram)):
        return {}
    out = {}
    for name in os.listdir(os.path.dirname(ram)):
        m = _RANK_NAME.match(name)
        if m and int(m.group(1)) < world:
            copy = held(os.path.join(folder, name))
            if copy is not None:
                out[int(m.group(1))] = copy
    return out


class Replicator:
    """This rank's replication thread (see the module docstring)."""

    def __init__(self, directory: str, group: Any, rank: int, world_size: int, replicas: int,
                 node: str, timeout: float, keeper: Any) -> None:
        from ..coord import _all_gather_msg
        self.directory = directory
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.replicas = replicas
        self.timeout = timeout
        self.keeper = keeper   # a .keep.Keeper: what stays in RAM
        self.nodes: list[str] = _all_gather_msg(node, world_size, group)   # a collective
        self.gone: set[int] = set()   # holders passed over, agreed (refused, or out)
        self.out: set[int] = set()   # ranks a peer lost the link with, agreed: no part at all
        self.lost: dict[int, str] = {}   # peers whose transfer failed here: never used again
        self.placement = [place_replicas(self.nodes, r, replicas) for r in range(world_size)]
        if replicas and len(set(self.nodes)) <= min(replicas, world_size - 1):
            log.warning("snapsvc: replicas=%d but only %d node(s): some replicas share a node "
                        "with their origin", replicas, len(set(self.nodes)))
        self.queue: "queue.Queue[tuple[Any, list[Any]] | None]" = queue.Queue()
        # for the next commit exchange: the rounds finished here (step, every replica of
        # this rank placed), and the peers lost here since the last exchange
        self._lock = threading.Lock()
        self._done: list[list[Any]] = []
        self._refused: set[int] = set()
        self._reported: set[int] = set()
        self._tally: dict[int, set[int] | None] = {}   # step -> ranks whose round placed all
        self.counts = {"replicated": 0, "replica_bytes": 0, "replica_s": 0.0}
        self.pipe = Pipe()   # the replication thread's transfer buffers
        self._sizes: list[int] = []   # the file sizes received this round
        self._spare_thread: threading.Thread | None = None
        self.thread: threading.Thread | None = None

    @property
    def holders(self) -> list[int]:
        """The ranks holding this rank's replicas."""
        return self.placement[self.rank]

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="snapsvc-replicas", daemon=True)
        self.thread.start()

    def add(self, handle: Any, tables: list[Any]) -> None:
        """After a commit exchange (the coordinator thread): every rank's :meth:`report`
        of it, and the committed step of ``handle`` to replicate (None: not committed)."""
        self.queue.put((handle, tables))

    def report(self) -> dict[str, Any]:
        """What this rank tells the others in the next commit exchange (the coordinator
        thread): the rounds it finished, and the peers it lost, since the last one."""
        with self._lock:
            done, self._done = self._done, []
            refused, self._refused = sorted(self._refused), set()
            lost = sorted(set(self.lost) - self._reported)
            self._reported.update(lost)
        return {"done": done, "lost": lost, "refused": refused}

    def stop(self, timeout: float | None) -> bool:
        """Let the queued steps replicate (bounded); True when the thread ended."""
        self.queue.put(None)
        if self.thread is not None:
            self.thread.join(timeout)
            if self.thread.is_alive():
                return False
        if self._spare_thread is not None:   # before a close drops the spares
            self._spare_thread.join(timeout)
            if self._spare_thread.is_alive():
                return False
        self.pipe.close()
        return True

    def close(self, timeout: float | None, ended: bool) -> list[Any]:
        """The writer's close: queued steps replicate (bounded); on a clean close
        (``ended``: every exchange done) the replicas held here go. The group to
        destroy, if it may be."""
        if self.stop(timeout) and ended:
            self.drop_all()
            return [self.group]
        return []

    def drop_all(self) -> None:
        """A clean close: every replica this rank holds goes (those an earlier
        trainer of this rank left included)."""
        for n in self.keeper._steps():
            for ram in held_by(self.directory, n, self.rank, self.world_size).values():
                drop(ram)
            folder = ram_path(replica_file(self.directory, n, self.rank, "x"))
            if folder is not None and os.path.isdir(os.path.dirname(folder)):
                tidy(os.path.dirname(folder))   # a step whose replica never landed
        self.keeper.clear_spares()

    def _run(self) -> None:
        while (job := self.queue.get()) is not None:
            handle, tables = job
            if self._spare_thread is not None:
                # a fallocate, bounded by the replicator's timeout: one still running
                # past it is kept (stop() joins it) and this round goes without spares
                self._spare_thread.join(self.timeout)
                if not self._spare_thread.is_alive():
                    self._spare_thread = None
            try:
                self._agree(tables)
                if handle is not None:
                    self._one(handle)
                    self._spare_later()
            except Exception as e:   # a bug: a peer's failure is caught per pair
                log.exception("snapsvc: replicating on rank %d failed", self.rank)
                if handle is not None:
                    _fail(handle, SnapsvcError(f"step {handle.step}: replicas of rank "
                                               f"{self.rank} not placed: {_reason(e)}"))

    def _agree(self, tables: list[Any]) -> None:
        """Every rank's report of one commit exchange (the same on every rank, applied
        in the same order). Holders that refused are passed over; ranks a peer lost
        the link with take no more part, as holders or origins (from the next step
        on). A step is complete in RAM once every rank still taking part finished
        its round with its replicas placed: the keeper then drops older steps."""
        failed: set[int] = set()
        for table in filter(None, tables):
            self.out.update(table["lost"])
            failed.update(table["lost"], table["refused"])
        for r, table in enumerate(tables):
            for step, ok in (table or {}).get("done", ()):
                ranks = self._tally.setdefault(step, set())
                if ranks is not None:
                    self._tally[step] = ranks | {r} if ok else None
        for step, ranks in sorted(self._tally.items()):
            if ranks is not None and len(ranks | self.out) >= self.world_size:
                self.keeper.completed(step)
        done = set(self.keeper.complete)
        self._tally = {s: v for s, v in self._tally.items()
                       if s not in done and (not done or s > min(done))}
        self._pass_over(failed)

    def _one(self, handle: Any) -> None:
        """One step's round: every (origin, holder) pair in the same order on every
        rank, only the two ranks of a pair acting on it. A pair whose transfer fails
        (a peer died, hung past the group's timeout, or its replication is gone) is
        lost to this rank: reported at the next exchange, never used again."""
        step = handle.step
        source = held(handle.file) or handle.file   # its RAM copy (persist=False), else the disk
        problems: dict[int, str] = {}
        t0, sent = time.monotonic(), 0
        holders = [] if self.rank in self.out else list(self.holders)
        for origin, placed in enumerate(self.placement):
            if origin in self.out:
                continue
            for h in placed:
                if origin == self.rank:
                    if h in self.lost:
                        problems[h] = f"an earlier transfer with it failed ({self.lost[h]})"
                        continue
                    try:   # whole files, each one tensor over the file's pages
                        sent += send_files(checkpoint_names(source), h, self.group,
                                           timeout=self.timeout, pipe=self.pipe)
                        answer = unpack_value(_recv_bytes(h, self.group, self.timeout))
                    except Exception as e:
                        answer = f"the transfer failed: {self._lose(h, step, e)}"
                    if answer is not None:
                        problems[h] = answer
                        with self._lock:
                            self._refused.add(h)
                elif h == self.rank and origin not in self.lost:
                    try:
                        why = self._receive(origin, step)
                        _send_bytes(pack_value(why), origin, self.group, self.timeout)
                    except Exception as e:
                        self._lose(origin, step, e)
        short = self.rank not in self.out and len(holders) < min(self.replicas,
                                                                  self.world_size - 1)
        if self.rank in self.out:
            problems = {h: f"the replication link failed: {why}" for h, why in self.lost.items()}
            problems = problems or {self.rank: "a peer lost its replication link with this rank"}
        self.counts["replica_s"] += time.monotonic() - t0
        self.counts["replica_bytes"] += sent
        with self._lock:
            # a rank out of replication has only its own copy: as complete as it gets
            self._done.append([step, not problems or self.rank in self.out])
        if problems or short:
            why = "; ".join(f"rank {h} (node {self.nodes[h]}): {problems[h]}"
                            for h in sorted(problems))
            if short:
                why = "; ".join(filter(None, [why, f"only {len(holders)} of {self.replicas} "
                                              "replica(s) placed: no other live node can "
                                              "hold one"]))
            _fail(handle, SnapsvcError(
                f"step {step}: the replica of rank {self.rank} could not be placed on {why}"))
            return
        self.counts["replicated"] += 1
        _resolve(handle, holders)

    def _lose(self, peer: int, step: int, e: BaseException) -> str:
        """The link with ``peer`` failed: never used again by this rank; the reason."""
        why = _reason(e)
        with self._lock:
            self.lost[peer] = why
        log.warning("snapsvc: rank %d lost its replication link with rank %d (node %s) at step "
                    "%d: %s; no replica goes between them from now on", self.rank, peer,
                    self.nodes[peer], step, why)
        return why

    def _pass_over(self, failed: set[int], step: int | None = None) -> None:
        """The ranks in ``failed`` (every rank's same set) take no more part: each
        origin they served re-replicates to another live node from the next step on,
        and says so once."""
        new = failed - self.gone
        if not new:
            return
        self.gone |= new
        before = self.holders
        self.placement = [place_replicas(self.nodes, r, self.replicas, self.gone)
                          for r in range(self.world_size)]
        if before != self.holders and self.rank not in self.gone:
            log.warning("snapsvc: rank(s) %s could not hold rank %d's replica%s; from the next "
                        "step on it goes to rank(s) %s (node(s) %s)",
                        sorted(new & set(before)), self.rank,
                        "" if step is None else f" of step {step}", self.holders,
                        [self.nodes[h] for h in self.holders])

    def _receive(self, origin: int, step: int) -> str | None:
        """Hold ``origin``'s replica of ``step``; None, or why not (a refused replica's
        bytes are still received, so that the exchange stays in step)."""
        header = recv_header(origin, self.group, self.timeout)
        if header["error"] is not None:
            return str(header["error"])
        self.keeper.seen.add(step)
        folder, why = self._place(header, step)
        if folder is None:
            recv_files(origin, self.group, header, self.timeout)   # drained
            return why
        try:
            spare = self.keeper.take_spare if self._spare_thread is None else None
            recv_to_folder(origin, self.group, header, folder, spare, self.timeout, self.pipe)
        except BaseException as e:
            tidy(folder)   # no copy landed: its folder and our mark go
            if isinstance(e, TimeoutError) or not isinstance(e, (OSError, SnapsvcError)):
                raise   # the link is lost, or a bug
            return _reason(e)
        self._sizes += header["sizes"]
        return None

    def _spare_later(self) -> None:
        """``keeper.reserve`` for this round's files, on a thread of low
        priority (on Linux, a thread's own nice value), so that reserving pages takes
        no CPU from training; the next round (at most the timeout) and a close wait
        for it. None while the last one still runs."""
        sizes, self._sizes = self._sizes, []
        if self._spare_thread is not None:   # the last one still reserving
            return

        def run() -> None:
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
            except (AttributeError, OSError):   # not Linux, or not allowed: as it is
                pass
            try:
                self.keeper.reserve(sizes)
            except Exception as e:   # a spare is an optimisation: never a failure
                log.debug("snapsvc: reserving spare pages failed: %s", _reason(e))

        self._spare_thread = threading.Thread(target=run, name="snapsvc-spares", daemon=True)
        self._spare_thread.start()

    def _place(self, header: dict[str, Any], step: int) -> tuple[str | None, str | None]:
        """The RAM folder for the replica ``header`` announces, or (None, why not)."""
        metas = [n for n in header["names"] if n.endswith(".meta")]
        if len(metas) != 1:
            return None, f"expected one metadata file, got {sorted(header['names'])}"
        try:
            full = self.keeper.room(sum(header["sizes"]))
            if full is not None:
                return None, full
            path = replica_file(self.directory, step, self.rank, metas[0][:-len(".meta")])
            ram = ram_path(path, create=True)
            if ram is None:
                return None, "no RAM tier (/dev/shm)"
            # ours before its first temp file: a holder killed mid-receive leaves a dead
            # process's folder, whose temp files the next start sweeps
            claim(ram, path)
        except (OSError, SnapsvcError) as e:
            return None, _reason(e)
        if meta_path(ram) != os.path.join(os.path.dirname(ram), metas[0]):
            tidy(os.path.dirname(ram))
            return None, f"unexpected metadata name {metas[0]}"
        return os.path.dirname(ram), None


def _resolve(handle: Any, holders: list[int]) -> None:
    try:
        handle._replicas.set_result(holders)
    except concurrent.futures.InvalidStateError:
        pass


def _fail(handle: Any, exc: BaseException) -> None:
    try:
        handle._replicas.set_exception(exc)
    except concurrent.futures.InvalidStateError:
        pass

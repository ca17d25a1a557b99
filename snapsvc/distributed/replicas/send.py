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
stays in RAM follows the steps complete in RAM (:mod:`.keep`): each round ends
with an exchange saying whether every replica of the step was placed.

Loss of a holder: a holder that cannot hold a replica answers why; the
origin's ``replicated()`` raises naming it, the closing exchange tells every
rank, and from the next step on the placement passes it over (the copy goes to
the next node of the ring), with one warning per origin. A transfer that fails
(a peer process died: the group's state is unknown) stops replication for this
writer; its coordinator fails the same way.
"""

from __future__ import annotations

import concurrent.futures
import logging
import mmap
import os
import queue
import re
import socket
import threading
import time
from typing import Any, Callable, Collection, Sequence

import torch
import torch.distributed as dist

from ...errors import SnapsvcError
from ...files.metafile import checkpoint_names, meta_path
from ...files.ramtier import drop, held, ram_path
from ...files.verify import verify
from ...format.protocol import pack_value, unpack_value
from ..coord import _reason
from ..manifest import step_dir

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


def _send_bytes(data: bytes | torch.Tensor, peer: int, group: Any) -> None:
    t = data if isinstance(data, torch.Tensor) else torch.frombuffer(bytearray(data) or
                                                                     bytearray(1), dtype=torch.uint8)
    dist.send(torch.tensor([t.numel()], dtype=torch.int64), peer, group=group)
    dist.send(t, peer, group=group)


def _recv_bytes(peer: int, group: Any) -> torch.Tensor:
    n = torch.zeros(1, dtype=torch.int64)
    dist.recv(n, peer, group=group)
    t = torch.empty(int(n), dtype=torch.uint8)
    dist.recv(t, peer, group=group)
    return t


def send_files(paths: list[str], peer: int, group: Any, error: str | None = None) -> int:
    """The files ``paths`` (any may be missing) to ``peer``: a header (names, sizes,
    ``error``), then each non-empty file's bytes as one message; the bytes sent."""
    present = [p for p in paths if os.path.exists(p)] if error is None else []
    sizes = [os.path.getsize(p) for p in present]
    _send_bytes(pack_value({"names": [os.path.basename(p) for p in present], "sizes": sizes,
                            "error": error}), peer, group)
    for p, n in zip(present, sizes):
        if n:   # read by torch straight into the tensor sent: one copy
            dist.send(torch.from_file(p, shared=False, size=n, dtype=torch.uint8), peer,
                      group=group)
    return sum(sizes)


def recv_header(peer: int, group: Any) -> dict[str, Any]:
    """The header :func:`send_files` sends first: ``names``, ``sizes``, ``error``."""
    header: dict[str, Any] = unpack_value(bytes(_recv_bytes(peer, group).tolist()))
    return header


def recv_files(peer: int, group: Any, header: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The files of ``header`` into memory: name -> bytes (also to drain a refused one)."""
    files = {}
    for name, n in zip(header["names"], header["sizes"]):
        files[name] = torch.empty(n, dtype=torch.uint8)
        if n:
            dist.recv(files[name], peer, group=group)
    return files


def recv_to_folder(peer: int, group: Any, header: dict[str, Any], folder: str,
                   spare: Callable[[int], str | None] | None = None) -> None:
    """The files of ``header`` straight into ``folder`` (private, 0600): each received
    into the mapping of its temp file (no buffer in between), then renamed, the
    metadata (``.meta``) last: it vouches for the rest. ``spare(n)``: a file whose
    pages to reuse for ``n`` bytes (renamed to the temp name), or None."""
    temps: list[tuple[str, str]] = []
    sizes = header["sizes"]
    received = 0   # the files whose bytes came
    try:
        for i, (name, n) in enumerate(zip(header["names"], sizes)):
            received = i if n else i + 1
            final = os.path.join(folder, name)
            temp = f"{final}.{os.getpid()}.tmp"
            reuse = spare(n) if spare is not None and n else None
            if reuse is not None:
                os.replace(reuse, temp)
            fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW |
                         (0 if reuse else os.O_TRUNC), 0o600)
            temps.append((temp, final))
            try:
                if n:
                    os.ftruncate(fd, n)
                    # the pages reserved first: a full tmpfs is ENOSPC here, not a SIGBUS
                    # when recv() touches a page of the mapping
                    os.posix_fallocate(fd, 0, n)
                    # pages already there (a spare): their page tables filled at once
                    populate = getattr(mmap, "MAP_POPULATE", 0) if reuse else 0
                    with mmap.mmap(fd, n, flags=mmap.MAP_SHARED | populate) as mapped:
                        target = torch.frombuffer(mapped, dtype=torch.uint8)
                        dist.recv(target, peer, group=group)
                        received = i + 1
                        del target   # the mapping closes only once no tensor uses it
            finally:
                os.close(fd)
        for temp, final in sorted(temps, key=lambda tf: tf[1].endswith(".meta")):
            os.replace(temp, final)
    except BaseException as e:
        for temp, _ in temps:
            try:
                os.unlink(temp)
            except FileNotFoundError:
                pass
        if isinstance(e, OSError):   # the origin still sends the rest: taken, in step
            for n in sizes[received:]:
                if n:
                    dist.recv(torch.empty(n, dtype=torch.uint8), peer, group=group)
        raise


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
        self.gone: set[int] = set()   # holders that could not hold, agreed: passed over
        self.placement = [place_replicas(self.nodes, r, replicas) for r in range(world_size)]
        if replicas and len(set(self.nodes)) <= min(replicas, world_size - 1):
            log.warning("snapsvc: replicas=%d but only %d node(s): some replicas share a node "
                        "with their origin", replicas, len(set(self.nodes)))
        self.queue: "queue.Queue[tuple[Any, str] | None]" = queue.Queue()
        self.broken: str | None = None
        self.counts = {"replicated": 0, "replica_bytes": 0, "replica_s": 0.0}
        self.thread: threading.Thread | None = None

    @property
    def holders(self) -> list[int]:
        """The ranks holding this rank's replicas."""
        return self.placement[self.rank]

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="snapsvc-replicas", daemon=True)
        self.thread.start()

    def add(self, handle: Any, file: str) -> None:
        """Replicate the committed step of ``handle`` (this rank's file ``file``)."""
        self.queue.put((handle, file))

    def stop(self, timeout: float | None) -> bool:
        """Let the queued steps replicate (bounded); True when the thread ended."""
        self.queue.put(None)
        if self.thread is not None:
            self.thread.join(timeout)
            return not self.thread.is_alive()
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
        self.keeper.clear_spares()

    def _run(self) -> None:
        while (job := self.queue.get()) is not None:
            handle, file = job
            if self.broken is not None:
                # committed, its own copies held: complete in RAM without replicas, so
                # older steps still leave RAM (each rank on its own: no exchange now)
                self.keeper.completed(handle.step)
                _fail(handle, SnapsvcError(f"step {handle.step}: not replicated: replication "
                                           f"stopped after {self.broken}"))
                continue
            try:
                self._one(handle, file)
            except Exception as e:   # a peer died or hung: the group's state is unknown
                self.broken = f"step {handle.step}: {_reason(e)}"
                log.error("snapsvc: replicating step %d failed on rank %d: %s; no further "
                          "replicas from this writer", handle.step, self.rank, _reason(e))
                _fail(handle, SnapsvcError(
                    f"step {handle.step}: replicas of rank {self.rank} not placed on rank(s) "
                    f"{self.holders}: {_reason(e)}"))

    def _one(self, handle: Any, file: str) -> None:
        """One step's round: every (origin, holder) pair in the same order on every
        rank, then a closing exchange: which holders could not hold (passed over
        from the next step on), and whether the step is complete in RAM."""
        from ..coord import _all_gather_msg
        step, group = handle.step, self.group
        source = held(file) or file   # its RAM copy (persist=False), else the disk
        problems: dict[int, str] = {}
        t0, sent = time.monotonic(), 0
        holders = list(self.holders)
        for origin, placed in enumerate(self.placement):
            for h in placed:
                if origin == self.rank:
                    paths = checkpoint_names(source)
                    # whole files, each one tensor over the file's pages (no copy in Python)
                    sent += send_files(paths, h, group)
                    answer = unpack_value(bytes(_recv_bytes(h, group).tolist()))
                    if answer is not None:
                        problems[h] = answer
                elif h == self.rank:
                    _send_bytes(pack_value(self._receive(origin, step)), origin, group)
        short = len(holders) < min(self.replicas, self.world_size - 1)
        tables = _all_gather_msg({"failed": sorted(problems), "short": short},
                                 self.world_size, group)
        self.counts["replica_s"] += time.monotonic() - t0   # the closing exchange included
        self.counts["replica_bytes"] += sent
        if not any(t["failed"] or t["short"] for t in tables):
            self.keeper.completed(step)
        self._pass_over({h for t in tables for h in t["failed"]}, step)
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

    def _pass_over(self, failed: set[int], step: int) -> None:
        """The holders in ``failed`` (every rank's same set) hold no more replicas:
        each origin they served re-replicates to another live node from the next
        step on, and says so once."""
        new = failed - self.gone
        if not new:
            return
        self.gone |= new
        before = self.holders
        self.placement = [place_replicas(self.nodes, r, self.replicas, self.gone)
                          for r in range(self.world_size)]
        if before != self.holders:
            log.warning("snapsvc: rank(s) %s could not hold rank %d's replica of step %d; "
                        "from the next step on it goes to rank(s) %s (node(s) %s)",
                        sorted(new & set(before)), self.rank, step, self.holders,
                        [self.nodes[h] for h in self.holders])

    def _receive(self, origin: int, step: int) -> str | None:
        """Hold ``origin``'s replica of ``step``; None, or why not (a refused replica's
        bytes are still received, so that the exchange stays in step)."""
        header = recv_header(origin, self.group)
        if header["error"] is not None:
            return str(header["error"])
        self.keeper.seen.add(step)
        folder, why = self._place(header, step)
        if folder is None:
            recv_files(origin, self.group, header)   # drained
            return why
        try:
            recv_to_folder(origin, self.group, header, folder, self.keeper.take_spare)
        except (OSError, SnapsvcError) as e:
            return _reason(e)
        return None

    def _place(self, header: dict[str, Any], step: int) -> tuple[str | None, str | None]:
        """The RAM folder for the replica ``header`` announces, or (None, why not)."""
        metas = [n for n in header["names"] if n.endswith(".meta")]
        if len(metas) != 1:
            return None, f"expected one metadata file, got {sorted(header['names'])}"
        try:
            full = self.keeper.room(sum(header["sizes"]))
            if full is not None:
                return None, full
            ram = ram_path(replica_file(self.directory, step, self.rank,
                                        metas[0][:-len(".meta")]), create=True)
        except (OSError, SnapsvcError) as e:
            return None, _reason(e)
        if ram is None:
            return None, "no RAM tier (/dev/shm)"
        if meta_path(ram) != os.path.join(os.path.dirname(ram), metas[0]):
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

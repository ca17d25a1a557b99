"""The sidecar's writing half: a slot's encoders and one snapshot's durable write.

No torch, here or in anything it imports: a slot's tensors are spans of its
shared-memory mapping (:meth:`~snapsvc.format.layout.Layout.spans`), encoded
by :class:`snapsvc.format.framing.Encoder`, the encoder behind
:class:`snapsvc.format.fdl.Encoder`, so the files are the bytes the trainer's
own encoder would write. :mod:`snapsvc.sidecar.worker` imports this module on
a thread after READY; the first write waits for it.
"""

from __future__ import annotations

import errno as errno_mod
import logging
import mmap
import os
import threading
from typing import Any, Callable

from ..files.durable import set_aside, unlink_quietly
from ..files.metafile import Meta, checkpoint_names, meta_path, optim_path, write_with_meta
from ..files.ramtier import claim, drop, ram_path, ram_series, release_marks, \
    series as _series, size_of
from ..format import kinds, protocol
from ..format.framing import DATA, Encoder
from ..format.layout import BUFFER, Layout, OPTIM
from ..remote.upload import UploadJob, Uploader

__all__ = ["Encoders", "Files"]

log = logging.getLogger("snapsvc.writer")



class Encoders:
    """A slot's spans as encoders, built once: a write only moves data."""

    def __init__(self, layout: Layout, memory: mmap.mmap) -> None:
        self.layout = layout
        # Headers packed and entries checked once, here.
        hash_ = bytes.fromhex(layout.structural_hash) if layout.structural_hash else None
        pairs = list(zip(layout.specs, layout.spans(memory)))
        self.model = Encoder([span for s, span in pairs if s.kind != OPTIM and not s.in_data_file],
                             structural_hash=hash_)
        self.optim = Encoder([span for s, span in pairs if s.kind == OPTIM])
        # the tensors .fdl has no tag for, in a file of their own; None when there are none
        rest = [span for s, span in pairs if s.in_data_file]
        self.data = Encoder(rest, framing=DATA) if rest else None
        self.buffers = [s.name for s in layout.specs if s.kind == BUFFER]


class Files:
    """Writes snapshots durably, rotates what ``keep_last`` drops and, with a
    remote tier, hands each durable checkpoint to the uploader thread."""

    def __init__(self, keep_last: int | None, compress_level: int | None,
                 written: Any = (), remote: dict[str, Any] | None = None,
                 report: Callable[..., None] | None = None, keep_in_memory: int = 1,
                 held: Any = (), memory_limit: int | None = None) -> None:
        self.keep_last = keep_last
        # the RAM tier: series -> RAM copies this sidecar holds, oldest first; their paths;
        # their bytes, oldest first across series (memory_limit evicts in that order)
        self.keep_in_memory = keep_in_memory
        self.memory_limit = memory_limit
        self.in_ram: dict[tuple[str, str, str], list[str]] = {}
        self.origin: dict[str, str] = {}
        self.sizes: dict[str, int] = {}
        for path, ram in held:  # what a lingering sidecar handed over, or a dead one left
            if ram in self.origin or not os.path.exists(ram):  # adopted twice, or found bad
                continue
            claim(ram, path)
            self.in_ram.setdefault(ram_series(path), []).append(ram)
            self.origin[ram] = path
            self.sizes[ram] = size_of(ram)
        self.compress_level = compress_level
        self.written: dict[tuple[str, str], list[str]] = {}  # series -> our files, oldest first
        for old in written:  # what an earlier sidecar of this writer kept
            self.written.setdefault(_series(old), []).append(old)
        # Held around each write and rotation, so the uploader never opens a
        # checkpoint's files between their renames.
        self.lock = threading.Lock()
        self._report = report
        self.uploader: Uploader | None = None
        if remote is not None:
            self.remote_timeout: float = remote["remote_timeout"]
            self.uploader = Uploader(
                remote["remote"], remote["directory"], remote_timeout=self.remote_timeout,
                options=remote["remote_options"], keep_last=remote["remote_keep_last"],
                on_done=self._uploaded, files_lock=self.lock, scan=remote["remote_scan"],
                uncommit=remote["remote_uncommit"], names=remote["remote_names"])

    def _uploaded(self, job: UploadJob, url: str | None, error: str | None,
                  skipped: bool) -> None:
        """The uploader's outcome for one checkpoint (on its thread)."""
        assert self._report is not None
        self._report(protocol.UPLOADED, seq=job.seq, path=job.path, url=url, error=error,
                     skipped=skipped)

    def upload(self, done: dict[str, Any]) -> None:
        """Queue a written checkpoint for upload, after its DONE report."""
        if self.uploader is None or not done["ok"] or done.get("superseded") or done.get("ram"):
            return
        try:
            self.uploader.enqueue(done["seq"], done["path"])
        except ValueError as e:  # outside the directory (refused at submit)
            self._uploaded(UploadJob(done["seq"], done["path"], ""), None, str(e), False)

    def rotate_released(self) -> None:
        """Rotate the series whose files were kept for an upload that has now begun."""
        if self.uploader is None or self.keep_last is None:
            return
        released = self.uploader.released()
        if not released:
            return
        trash: list[str] = []
        with self.lock:
            for mine in self.written.values():
                if any(p in mine for p in released):
                    self.rotate(mine, trash)
        unlink_quietly(trash)

    def close_uploads(self) -> None:
        """Give queued uploads up to ``remote_timeout``; those not done are reported failed."""
        if self.uploader is not None:
            self.uploader.close(self.remote_timeout)
            self.rotate_released()

    def encoders(self, layout: dict[str, Any], memory: mmap.mmap) -> Encoders | str:
        """A slot's encoders, or why it cannot be written (a trainer bug: its
        writes fail, the sidecar keeps serving)."""
        try:
            return Encoders(Layout.from_msg(layout), memory)
        except Exception as e:
            log.exception("a slot cannot be written")
            return f"its layout cannot be written: {type(e).__name__}: {e}"

    def prune(self, path: str, trash: list[str]) -> list[str]:
        """keep_last: drop our oldest files of ``path``'s series once it is durable.

        A series is the names in one directory that differ only in their
        digits (``step100.fdl`` and ``step200.fdl``, not ``best.fdl``), so a
        ``best.fdl`` saved through the same writer is never rotated away.
        Each file loses its name now; its data is freed after the report
        (see :func:`~snapsvc.files.durable.set_aside`), through ``trash``.
        """
        mine = self.written.setdefault(_series(path), [])
        if path in mine:
            mine.remove(path)
        mine.append(path)
        return self.rotate(mine, trash)

    def hold(self, path: str, ram: str) -> list[str]:
        """A memory-only snapshot of ``path`` is now held at ``ram``: drop the
        RAM copies of its series beyond the newest ``keep_in_memory``."""
        mine = self.in_ram.setdefault(ram_series(path), [])
        if ram in mine:
            mine.remove(ram)
        mine.append(ram)
        self.origin[ram] = path
        self.sizes.pop(ram, None)
        self.sizes[ram] = size_of(ram)  # the newest, last
        # the copies its trainer dropped (a distributed writer with replicas drops steps
        # once newer ones are complete in RAM) are no longer held
        gone = [old for old in mine[:-1] if not os.path.exists(meta_path(old))]
        for old in dict.fromkeys(gone + mine[:-self.keep_in_memory]):   # each once
            self._forget(old)
        return []

    def _forget(self, ram: str) -> None:
        """Stop holding the RAM copy ``ram`` and free it."""
        self.in_ram[ram_series(self.origin.pop(ram))].remove(ram)
        self.sizes.pop(ram, None)
        drop(ram)

    def make_room(self, slot_bytes: int, incoming: int, keep: str | None = None) -> None:
        """``memory_limit``: evict RAM copies, oldest first (never ``keep``), until they
        and ``incoming`` bytes fit beside ``slot_bytes`` of slots. Slots are never
        evicted: a snapshot in flight to disk is not dropped for one in RAM only."""
        if self.memory_limit is None:
            return
        for ram in list(self.sizes):
            if sum(self.sizes.values()) + incoming + slot_bytes <= self.memory_limit:
                return
            if ram != keep:
                log.warning("memory_limit=%d: evicting the RAM copy of %s (the oldest held)",
                            self.memory_limit, self.origin[ram])
                self._forget(ram)

    def held(self) -> list[list[str]]:
        """[path, RAM copy] of every memory-only snapshot held, oldest first per series."""
        return [[self.origin[ram], ram] for mine in self.in_ram.values() for ram in mine]

    def written_files(self) -> list[str]:
        """The files keep_last still rotates, oldest first per series."""
        return [p for mine in self.written.values() for p in mine]

    def forget_ram(self, path: str) -> None:
        """``path`` was written to disk: a RAM copy of it, now older, goes."""
        ram = ram_path(path)
        if ram is not None and ram in self.in_ram.get(ram_series(path), []):
            self._forget(ram)

    def drop_ram(self) -> None:
        """At exit: every RAM copy this sidecar holds goes, its memory freed."""
        for mine in self.in_ram.values():
            for ram in mine:
                drop(ram)
        self.in_ram.clear()
        self.origin.clear()
        self.sizes.clear()
        release_marks()

    def rotate(self, mine: list[str], trash: list[str]) -> list[str]:
        """Remove the files of a series beyond the newest ``keep_last``, except
        those still waiting for their upload (rotated once it has begun)."""
        removed: list[str] = []
        if self.keep_last is None:
            return removed
        up = self.uploader
        for old in [p for p in mine[:-self.keep_last] if up is None or not up.pending(p)]:
            mine.remove(old)
            for p in checkpoint_names(old):  # metadata first: it vouches for the rest
                if self.discard(p, trash):
                    removed.append(p)
        return removed

    @staticmethod
    def discard(path: str, trash: list[str]) -> bool:
        """Remove ``path`` if it exists, its data freed later through ``trash``."""
        aside = set_aside(path)
        if aside is not None:
            trash.append(aside)
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False

    def write(self, enc: Encoders, msg: dict[str, Any], base: dict[str, Any],
              trash: list[str], slot_bytes: int = 0) -> dict[str, Any]:
        """Write one claimed snapshot; its report. Files replaced or rotated
        away go to ``trash``, to be freed once the report is out. ``slot_bytes``:
        the slots mapped now (``memory_limit`` counts them)."""
        path = msg["path"]
        body = protocol.unpack_value(msg["body"])  # packed and checked at submit
        body.update(kinds.join({r: body.get(r) for r in ("state", "extra")}, body["kinds"]))
        meta = Meta(buffers=enc.buffers, epoch=body["epoch"], metrics=body["metrics"],
                    structural_hash=enc.layout.structural_hash or None,
                    extra=body.get("extra"), optimizer=body.get("optim"),
                    state=body.get("state"), extra_state=body.get("extra_state"))
        ram = msg.get("ram", False)
        if "umask" in msg:  # the trainer's at submit: files get the mode open() would give them then
            os.umask(msg["umask"] | (0o077 if ram else 0))  # RAM copies: 0600, as shared memory
        try:
            with self.lock:
                # room first (an eviction may remove the folder): its copy, about its
                # tensors, metadata and headers (64 KiB)
                self.make_room(slot_bytes,
                               enc.layout.nbytes + len(msg["body"]) + (64 << 10) if ram else 0)
                # memory-only: the same files, under the RAM tier's mirror of the path
                dest = ram_path(path, create=True) if ram else path
                assert dest is not None
                if ram:
                    claim(dest, path)  # before its first file there: see snapsvc.files.ramtier
                optim = (optim_path(dest), enc.optim) if meta.optimizer is not None else None
                stats = write_with_meta(dest, enc.model, meta,
                                        compress_level=self.compress_level, optim=optim,
                                        data=enc.data, trash=trash)
                removed = self.hold(path, dest) if ram else self.prune(path, trash)
                if ram:  # its measured size may exceed the estimate
                    self.make_room(slot_bytes, 0, keep=dest)
                if not ram and self.in_ram:
                    self.forget_ram(path)
        except OSError as e:
            log.error("writing %s failed: %s", path, e)
            detail = e.strerror or str(e)
            if e.filename and e.filename != path:  # e.g. the temp file beside it
                detail += f" (at {e.filename})"
            return {**base, "ok": False, "errno": e.errno or errno_mod.EIO, "error": detail,
                    "filename": path}
        except Exception as e:  # reported to the trainer, never lost
            log.exception("writing %s failed", path)
            return {**base, "ok": False, "errno": None, "error": f"{type(e).__name__}: {e}",
                    "filename": path}
        return {**base, "ok": True, "superseded": False, "ram": ram,
                "bytes": 0 if ram else stats.bytes,
                "entries": enc.model.count, "encode_s": stats.encode_s,
                "write_s": stats.write_s, "fsync_s": stats.fsync_s, "removed": removed}

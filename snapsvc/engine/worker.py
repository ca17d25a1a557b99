"""The writer sidecar's loop: a module-level function run in its own process.

It reads control messages from the trainer's pipe, encodes each snapshot
straight out of its shared-memory slot into a durable ``.fdl`` file plus
metadata, and reports back in submit order. See :mod:`snapsvc.engine.writer` for
the whole data flow.

Claim words. The "latest" policy lets the trainer re-stage a snapshot that is
queued but not yet started. Each slot's header holds an int64 claim word,
read and written only under a lock shared by both processes
(:class:`snapsvc.engine.staging.ClaimLock`, which the kernel releases if its holder dies):

- the trainer sets it to the seq of the WRITE it is about to send;
- the writer, on that WRITE, sets it to ``STARTED`` if it still holds that
  seq, else the snapshot was superseded and is skipped;
- the trainer may revoke a queued seq (set ``REVOKED``) only while the
  word still holds it, i.e. before the writer started.

The writer ignores SIGINT (a Ctrl-C in the terminal reaches the whole process
group; the trainer decides when to stop) and outlives its parent just long
enough to finish every snapshot already handed to it.
"""

from __future__ import annotations

import errno as errno_mod
import logging
import os
import re
import signal
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from ..files.durable import set_aside, set_fault_hook, unlink_quietly
from ..files.meta import Meta, meta_path, optim_path, write_with_meta
from ..format import fdl, protocol
from ..format.layout import BUFFER, Layout, OPTIM
from . import staging

__all__ = ["STARTED", "REVOKED", "writer_main"]

log = logging.getLogger("snapsvc.writer")

STARTED = -1
REVOKED = -2
_PARENT_POLL_S = 0.5
_DIGITS = re.compile(r"\d+")


class _Layout:
    """One layout of a slot's arena: its encoders, headers packed and entries
    checked once, so a write only moves data."""

    def __init__(self, layout: Layout, flat: torch.Tensor) -> None:
        if layout.nbytes > flat.numel():
            raise ValueError(f"a layout of {layout.nbytes} bytes does not fit in an arena "
                             f"of {flat.numel()}")
        self.layout = layout
        views = staging.views(flat, layout)
        hash_ = bytes.fromhex(layout.structural_hash) if layout.structural_hash else None
        self.encoder = fdl.Encoder([(s.name, t) for s, t in zip(layout.specs, views)
                                    if s.kind != OPTIM], structural_hash=hash_)
        self.optim = fdl.Encoder([(s.name, t) for s, t in zip(layout.specs, views)
                                  if s.kind == OPTIM])
        self.buffers = [s.name for s in layout.specs if s.kind == BUFFER]


class _Slot:
    """A slot's arena and the layout it holds now. A WRITE whose layout differs
    from the last one carries it (names change, the tensor bytes stay where
    they are): its encoders are built once and kept for the last few layouts."""

    KEEP = 4  # layouts whose encoders are kept per slot (a few alternate: best, last, ...)

    def __init__(self, flat: torch.Tensor, layout: Layout) -> None:
        self.flat = flat
        self.claim = staging.claim_word(flat)
        self.encoders: dict[Layout, _Layout] = {}
        self.now: _Layout | str = "has no layout"  # a str: why it cannot be written
        self.use(layout)

    def use(self, layout: Layout) -> None:
        """Lay the arena out as ``layout`` from now on."""
        enc = self.encoders.pop(layout, None)
        if enc is None:
            enc = _Layout(layout, self.flat)
            if len(self.encoders) >= self.KEEP:
                del self.encoders[next(iter(self.encoders))]  # the least recently used
        self.encoders[layout] = enc
        self.now = enc


class _Sidecar:
    def __init__(self, req: Connection, rep: Connection, lock: staging.ClaimLock,
                 options: dict[str, Any]) -> None:
        self.req = req
        self.rep = rep
        self.lock = lock
        self.keep_last: int | None = options.get("keep_last")
        self.compress_level: int | None = options.get("compress_level")
        self.slots: dict[int, _Slot | str] = {}  # a str: why that slot cannot be written
        self.written: dict[tuple[str, str], list[str]] = {}  # series -> our files, oldest first
        self.parent = os.getppid()
        self.reports_lost = False

    def report(self, op: str, **fields: Any) -> None:
        if self.reports_lost:
            return
        try:
            self.rep.send_bytes(protocol.pack(op, **fields))
        except (BrokenPipeError, ConnectionResetError, OSError):
            # The trainer is gone; keep writing what it handed over.
            self.reports_lost = True

    def claim(self, slot: _Slot, seq: int) -> bool:
        with self.lock:
            if int(slot.claim.item()) != seq:
                return False
            slot.claim.fill_(STARTED)
            return True

    def prune(self, path: str, trash: list[str]) -> list[str]:
        """keep_last: drop our oldest files of ``path``'s series once it is durable.

        A series is the names in one directory that differ only in their
        digits (``step100.fdl`` and ``step200.fdl``, not ``best.fdl``), so a
        ``best.fdl`` saved through the same writer is never rotated away.
        Each file loses its name now; its data is freed after the report
        (see :func:`~snapsvc.files.durable.set_aside`), through ``trash``.
        """
        series = (os.path.dirname(path), _DIGITS.sub("#", os.path.basename(path)))
        mine = self.written.setdefault(series, [])
        if path in mine:
            mine.remove(path)
        mine.append(path)
        removed = []
        while self.keep_last is not None and len(mine) > self.keep_last:
            old = mine.pop(0)
            for p in (meta_path(old), optim_path(old), old):  # metadata first: it vouches for the rest
                aside = set_aside(p)
                try:
                    os.unlink(p)
                    removed.append(p)
                except FileNotFoundError:
                    pass
                if aside is not None:
                    trash.append(aside)
        return removed

    def write(self, msg: dict[str, Any], trash: list[str]) -> dict[str, Any]:
        """Write one snapshot; its report. Files replaced or rotated away go
        to ``trash``, to be freed once the report is out."""
        started = time.monotonic()
        seq, path = msg["seq"], msg["path"]
        base = {"seq": seq, "path": path, "queue_s": started - msg["sent_at"]}
        slot = self.slots.get(msg["slot"])
        if isinstance(slot, _Slot) and "layout" in msg:  # before the claim: even a superseded
            try:                                        # write tells what the slot holds now
                slot.use(Layout.from_msg(msg["layout"]))
            except Exception as e:  # a trainer bug: fail the writes of this layout
                log.exception("slot %s cannot be written", msg["slot"])
                slot.now = f"has a layout that cannot be written: {type(e).__name__}: {e}"
        lay = slot.now if isinstance(slot, _Slot) else None
        if not isinstance(lay, _Layout):  # a trainer bug, reported rather than fatal to every later write
            why = lay or slot or "was never registered with this writer"
            return {**base, "ok": False, "errno": None, "filename": path,
                    "error": f"slot {msg['slot']} {why}"}
        if not self.claim(slot, seq):
            return {**base, "ok": True, "superseded": True}
        body = protocol.unpack_value(msg["body"])  # packed and checked at submit
        meta = Meta(buffers=lay.buffers, epoch=body["epoch"], metrics=body["metrics"],
                    structural_hash=lay.layout.structural_hash or None,
                    extra=body.get("extra"), optimizer=body.get("optim"),
                    state=body.get("state"))
        optim = (optim_path(path), lay.optim) if meta.optimizer is not None else None
        try:
            stats = write_with_meta(path, lay.encoder, meta, compress_level=self.compress_level,
                                    optim=optim, trash=trash)
            removed = self.prune(path, trash)
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
        return {**base, "ok": True, "superseded": False, "bytes": stats.bytes,
                "entries": lay.encoder.count, "encode_s": stats.encode_s,
                "write_s": stats.write_s, "fsync_s": stats.fsync_s, "removed": removed}

    def handle(self, msg: dict[str, Any]) -> bool:
        """Act on one message; False means stop."""
        op = msg["op"]
        if op == protocol.WRITE:
            trash: list[str] = []
            self.report(protocol.DONE, **self.write(msg, trash))
            try:
                unlink_quietly(trash)  # freeing old data is not on the durable clock
            except OSError as e:  # a leftover temp name; the next start removes it
                log.warning("could not remove an old checkpoint's data: %s", e)
        elif op == protocol.SLOT:
            flat = self.req.recv()  # the pickled shared-memory tensor follows its SLOT message
            try:
                self.slots[msg["slot"]] = _Slot(flat, Layout.from_msg(msg["layout"]))
            except Exception as e:  # a trainer bug: fail this slot's writes, keep serving
                log.exception("slot %s cannot be written", msg["slot"])
                self.slots[msg["slot"]] = f"its layout cannot be written: {type(e).__name__}: {e}"
            self.report(protocol.SLOT_OK, slot=msg["slot"])
        elif op == protocol.FREE:
            for sid in msg["slots"]:
                self.slots.pop(sid, None)  # the last reference: the mapping and its fd go
        elif op == protocol.STOP:
            return False
        else:
            log.error("unknown control message %r", op)
        return True

    def run(self) -> None:
        self.report(protocol.READY, pid=os.getpid())
        while True:
            if not self.req.poll(_PARENT_POLL_S):
                if os.getppid() != self.parent:
                    log.warning("trainer %d is gone; finishing what it handed over", self.parent)
                    self.drain()
                    return
                continue
            try:
                data = self.req.recv_bytes()
            except EOFError:  # the trainer closed its end: every message sent was read
                return
            if not self.handle(protocol.unpack(data)):
                return

    def drain(self) -> None:
        """After the parent died: handle every message already in the pipe."""
        while self.req.poll(0):
            try:
                if not self.handle(protocol.unpack(self.req.recv_bytes())):
                    return
            except EOFError:
                return


def writer_main(req: Connection, rep: Connection, lock: staging.ClaimLock,
                options: dict[str, Any]) -> None:
    """Entry point of the writer process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Past RLIMIT_FSIZE a write should fail with EFBIG, not kill the sidecar.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    # Training must not wait on the sidecar: on a busy box it yields the CPU.
    os.nice(options.get("nice", 0))
    hook = options.get("fault_hook")
    set_fault_hook(hook)
    if hook is not None:
        hook("start", "")
    torch.set_num_threads(1)  # leave the cores to training; encoding is memory-bound
    _Sidecar(req, rep, lock, options).run()

"""The engine: the trainer's side of the checkpoint sidecar.

Data flow of one ``submit()``, across the two processes (the sidecar's side
is :mod:`snapsvc.sidecar`; what crosses between them is the protocol in
:mod:`snapsvc.format`)::

    trainer process (this folder)                      sidecar process (snapsvc/sidecar/)
    -----------------------------                      ----------------------------------
    submit(model or state, path)          [writer.py]
      | plan.request: check values, path, metadata body; the pool's key
      | plan.find_pool: the layout's pool (when names change: slots large
      |   enough, idle or busy, laid out anew) and, for a model, its copy plan
      | slots.SlotBroker: register the pool with the sidecar; reserve slot k
      |   (policy block/skip/latest)
      | copier: copy tensors ---> slot k ========= one shared-memory mapping per slot ======
      |   (a model's cached plan: one torch.cat    (sent once: {SLOT k, layout} + its fd;
      |    per dtype group of the slot)             the sidecar maps it, and builds its
      |                                             encoders at the first write)
      | book.add: seq, pending handle; claim[k] = seq
      | dispatch: req socket {WRITE seq, k, path, body, --> claim k (or skip), encode
      |   layout if k's changed}                          .fdl(.gz) from slot k, write it
      v return WriteHandle                                durably, then .meta; remote=:
                                                          upload it on a thread
    reader thread (link.py)   <--- rep pipe: {DONE seq, ok | error, bytes, timings}
      book.resolve: the handle; slot k free again
      sidecar sentinel fires -> book.lose: BrokenWriterError on every pending handle

Who owns what::

    writer.py    SnapshotWriter: the public calls
    life.py      Life: start / restart / stop of the sidecar; SIGTERM and atexit   lock
    plan.py      a submit's checked request, its pool lookup, the metadata body
    book.py      Book: pending writes, flags, counters, reports               cond
    slots.py     SlotBroker: pool registration, slot reservation by policy
    dispatch.py  Dispatcher: copy into the slot, book it, send WRITE; a copy held
                 in its slot and sent later (hold/send_held: snapsvc.dcp's stager)
    pools.py     SlotPools: slots by layout, copy plans, memory budget
    copier.py    Copier: blocking copy, overlap thread, CUDA stream           its own lock
    staging.py   shared-memory slots: allocation, views, the grouped copy
    snapshot.py  ModelSnapshot and snapshot_cpu (flodl's API)
    handles.py   WriteHandle and WriteReport
    link.py      Sidecar: the trainer's link to its sidecar process: start,
                 handshake, reports, death, the sender thread                 _send_lock

Locking. ``Book.cond`` (one lock) guards every piece of shared state:
pending writes, slots, pools and plans, the broken/closing flags and the
counters. ``Life.lock`` serializes starting, restarting and stopping the
sidecar; it may be taken before ``cond``, never after. No lock is held while
tensors are copied, while waiting for the sidecar to start, or while a
handle's callbacks run. Every wait ends on close, on the sidecar's death, or
at a timeout. All public methods are safe to call from any thread.

Messages are msgpack written with ``send_bytes`` by the link's sender
thread, and a submit returns only once its message is sent: a submit that
returned has its message in the kernel's socket buffer, a SIGKILL of the
trainer cannot lose it, and the sidecar drains the socket before it exits.
A signal handled on the main thread (Ctrl-C, SIGTERM) interrupts only the
wait, never a message half-way (see ``link.py``).
Reports come back in submit order because the sidecar works in order.

Imports: ``sidecar`` (nothing but the boot line's module name), ``remote``,
``state``, ``files``, ``format`` and ``errors``; nothing above it.
"""

"""The sidecar: the writer process beside training, which never imports torch.

::

    trainer (snapsvc.engine)            sidecar process (this folder)
    ------------------------            -----------------------------
    Sidecar.start()   -- spawn -------> worker.boot(): options, READY
    SLOT k + fd       -- req socket --> worker: map slot k's shared memory
    WRITE seq, k      -- req socket --> worker: claim k (format.claims), then
                                        writes.Files: encode slot k's spans
                                        as .fdl (+ .optim.fdl, .fdl.data),
                                        temp -> fsync -> rename, then .meta;
                                        keep_last rotation
                      <-- rep pipe ---- DONE seq (ok | error, timings)
                                        remote=: remote.upload's thread copies
                      <-- rep pipe ---- UPLOADED seq (url | error)
    STOP, or EOF      -- req socket --> finish what was handed over, exit

What each module holds::

    worker.py   the process's loop: READY, slots, claims, messages in order
    writes.py   its writing half: a slot's encoders, the durable write, keep_last,
                the RAM tier's copies (persist=False, keep_in_memory)
    linger.py   after the trainer died (linger > 0): wait for the next one to take over
    serve.py    ``snapsvc serve``: the loop as a service of its own, one trainer at a time
                on a Unix socket, its RAM copies and keep_last kept across trainers

Imports: ``remote``, ``files``, ``format`` and ``errors``, none of which
imports torch; nothing above it. The trainer's side never imports this
folder's modules: it starts the interpreter with the boot line that names
:func:`snapsvc.sidecar.worker.boot`.
"""

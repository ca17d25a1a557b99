"""Checkpoint files on a local disk: durable writes, reads that check size and CRC-32.

What each module holds::

    durable.py     temp file -> fsync -> rename -> directory fsync; stale temps; fault hooks
    checkpoint.py  one .fdl file: save, read, read_verified, load into a model, migrate
    meta.py        the .meta file beside a checkpoint; every file name of a checkpoint
    verify.py      check a checkpoint and its companions without loading them
    convert.py     .fdl <-> .safetensors <-> .pt

Imports: ``format`` and ``errors``.
"""

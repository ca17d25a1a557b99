"""Checkpoint files on a local disk: durable writes, reads that check size and CRC-32.

What each module holds::

    durable.py     temp file -> fsync -> rename -> directory fsync; stale temps; fault hooks
    checkpoint.py  one .fdl file: save, read, read_verified, load into a model
    fused.py       a mapped file's pieces copied into fresh tensors as they are checksummed;
                   whether a mapping is in the page cache
    metafile.py    the .meta file beside a checkpoint; every file name of a checkpoint; the
                   durable write of a checkpoint from encoders (no torch: the sidecar's)
    meta.py        metafile, plus writing (name, tensor) pairs and reading with the data file
    verify.py      check a checkpoint and its companions without loading them
    convert.py     .fdl <-> .safetensors <-> .pt

Imports: ``format`` and ``errors``. durable, metafile and verify import no torch.
"""

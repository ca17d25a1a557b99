"""Multi-rank checkpoints on ``torch.distributed``: one sidecar per rank, one manifest.

What each module holds::

    manifest.py     the step directory, its manifest, the local tier's newest complete step
    tier.py         latest_checkpoint over both tiers; a step read locally or from the remote tier
    uploads.py      Uploads: this rank's thread that commits each step on the remote tier
    coord.py        rank/world lookup and small msgpack messages over a gloo group
    shards.py       DTensor pieces: what each rank stages (FSDP2, tensor parallel)
    pieces.py       reading pieces back: global tensors, ranged CRC-checked reads
    handles.py      DistributedWriteHandle and its report
    commit.py       Coordinator: this rank's thread, one exchange and commit per checkpoint
    writer.py       DistributedSnapshotWriter: submit, start, close
    restore.py      restore_distributed: per rank, or resharded at any world size
    consolidate.py  a sharded checkpoint's whole model as one .fdl (.safetensors, .pt)
    verify.py       a step directory checked as a whole: manifest and every rank's files

Imports: the engine (the per-rank ``SnapshotWriter``), ``remote``, ``state``,
``files``, ``format`` and ``errors``; nothing above (integrations, cli).
"""

from .consolidate import consolidate
from .manifest import MANIFEST_NAME, Manifest, RankFile, read_manifest, step_dir
from .restore import restore_distributed
from .shards import SHARDS_KEY
from .tier import latest_checkpoint
from .writer import DistributedSnapshotWriter, DistributedWriteHandle, DistributedWriteReport

__all__ = ["DistributedSnapshotWriter", "DistributedWriteHandle", "DistributedWriteReport",
           "Manifest", "RankFile", "MANIFEST_NAME", "SHARDS_KEY", "consolidate",
           "latest_checkpoint", "read_manifest", "restore_distributed", "step_dir"]

"""Peer replicas (issue 32): each rank's snapshot also held in the RAM of ranks on other nodes.

    send.py       node ids, placement, the replication thread and its gloo transfers
    keep.py       which steps stay in RAM (complete in RAM, memory_limit)
    ramsteps.py   steps complete in RAM: latest_checkpoint's and restore_distributed's side

See docs/distributed.md, "Peer replicas".
"""

from .keep import Keeper
from .ramsteps import ram_latest, ram_step, shard_places
from .send import NODE_ENV, Replicator, held_by, node_id, place_replicas, replica_file

__all__ = ["Keeper", "NODE_ENV", "Replicator", "held_by", "node_id", "place_replicas", "ram_latest",
           "ram_step", "replica_file", "shard_places"]

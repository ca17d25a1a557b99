"""How a DCP checkpoint maps onto snapsvc's: paths, DCP's ``Metadata``, and ``.metadata``.

A step written through :class:`~snapsvc.dcp.SnapsvcStorageWriter` is the
same on disk as one ``DistributedSnapshotWriter.submit(state, step)`` writes
for a state mapping: per rank ``rank<r>.fdl`` holding its pieces of every
tensor (a DTensor's local shard; a plain tensor on rank 0), ``.meta`` with
the state tree, and ``manifest.msgpack`` with every piece's byte range and
CRC-32. DCP's keys are the state's key paths joined with ``"."``, exactly as
DCP's planner flattens a state (:func:`dcp_items`), so DCP's ``Metadata`` is
rebuilt from rank 0's tree and the manifest, never from a pickle.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch
from isal import isal_zlib
from torch.distributed.checkpoint._traverse import traverse_state_dict
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                   Metadata, TensorProperties,
                                                   TensorStorageMetadata)

from ..distributed.pieces import _Global
from ..errors import FormatError
from ..format.protocol import InlineTensor, ObjectNode, TensorRef
from ..remote.url import is_url

READER_HINT = ("this is a snapsvc checkpoint: load it with "
               "dcp.load(..., storage_reader=snapsvc.dcp.SnapsvcStorageReader(path))")


def step_of(path: str | os.PathLike[str]) -> tuple[str, int]:
    """(root, step) of a ``.../step_<N>`` checkpoint path or URL."""
    raw = os.fspath(path)
    p = raw.rstrip("/") if is_url(raw) else os.path.abspath(raw)
    m = re.fullmatch(r"step_(0|[1-9]\d*)", p.rsplit("/", 1)[-1])
    if m is None:
        raise ValueError(f"{p}: a snapsvc DCP checkpoint path is a step directory named "
                         "step_<N> (e.g. ckpt/step_100, or s3://bucket/run/step_100); pass "
                         "checkpoint_id=root/step_<N>")
    return p.rsplit("/", 1)[0], int(m.group(1))


def is_step_path(checkpoint_id: Any) -> bool:
    """Whether ``checkpoint_id`` is a ``step_<N>`` directory path or a remote tier's
    step URL (DCP's ``validate_checkpoint_id`` of the writer and the reader)."""
    try:
        step_of(checkpoint_id)
    except (ValueError, TypeError):
        return False
    return True


def dcp_items(tree: Any, where: str) -> dict[str, Any]:
    """DCP's flat keys of a saved state tree: each a :class:`TensorRef` (a tensor
    item) or the value itself (a bytes item), as DCP's planner flattens the state."""
    if type(tree) is not dict:
        raise FormatError(f"rank 0's state tree is a {type(tree).__name__}, not a mapping; "
                          "DCP reads mappings", path=where)
    out: dict[str, Any] = {}

    def visit(path: tuple, value: Any) -> None:
        fqn = ".".join(map(str, path))
        if fqn in out:
            raise FormatError(f"two keys of the state flatten to DCP's {fqn!r}", path=where)
        if _holds(value, (ObjectNode, InlineTensor)) or (
                type(value) is not TensorRef and _holds(value, (TensorRef,))):
            raise FormatError(
                f"{fqn!r} holds a live module, optimizer or stateful object, or tensors inside "
                "a value DCP stores whole: it was saved by DistributedSnapshotWriter with "
                "objects DCP's flattened keys cannot name; read it with "
                "snapsvc.restore_distributed(path, state)", path=where)
        out[fqn] = value

    traverse_state_dict(tree, visit, lambda v: type(v) is TensorRef)
    return out


def _holds(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, types):
        return True
    if isinstance(value, dict):
        return any(_holds(v, types) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds(v, types) for v in value)
    return False


def dcp_metadata(items: dict[str, Any], saved: dict[str, _Global], where: str) -> Metadata:
    """DCP's ``Metadata``: a tensor item's chunks are its saved pieces."""
    md: dict[str, Any] = {}
    for fqn, value in items.items():
        if type(value) is not TensorRef:
            md[fqn] = BytesStorageMetadata()
            continue
        g = saved.get(value.name)
        if g is None:
            raise FormatError(f"{fqn!r}: the manifest lists no pieces of entry {value.name!r}; "
                              "it was not saved as a state mapping by snapsvc.dcp or "
                              "DistributedSnapshotWriter (read it with snapsvc.restore_distributed)",
                              path=where)
        chunks = [ChunkStorageMetadata(offsets=torch.Size(p.offsets),
                                       sizes=torch.Size(p.lengths)) for p in g.pieces]
        md[fqn] = TensorStorageMetadata(properties=TensorProperties(dtype=g.dtype),
                                        size=torch.Size(g.shape), chunks=chunks)
    return Metadata(state_dict_metadata=md)


def metadata_token(step_path: str, step: int) -> str:
    """What a step's ``.metadata`` carries to name its step: the step and its manifest's CRC-32."""
    from ..distributed.manifest import MANIFEST_NAME
    with open(os.path.join(step_path, MANIFEST_NAME), "rb") as f:
        crc = isal_zlib.crc32(f.read())
    return f"snapsvc-dcp step {step} manifest {crc:08x}"


def _refuse(token: str) -> None:
    """What DCP's default reader meets when it unpickles a snapsvc ``.metadata``."""
    raise FormatError(f"{READER_HINT} ({token})")


class _Refusal:
    """Pickled as ``.metadata``: unpickling it raises :data:`READER_HINT`."""

    def __init__(self, token: str) -> None:
        self.token = token

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (_refuse, (self.token,))

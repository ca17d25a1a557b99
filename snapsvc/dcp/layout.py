"""How DCP's items map onto snapsvc's files: entry keys and the metadata kept as msgpack.

Each rank's ``rank<r>.fdl`` holds a flat mapping: a tensor item under
``"<fqn>@<offsets>"`` (its chunk's offsets in the global tensor), a bytes item
under its fqn. DCP's ``Metadata`` is kept in plain values (no pickle) in rank
0's file, as the entry :data:`META_KEY`.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                   Metadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from ..errors import FormatError

META_KEY = "snapsvc.dcp"
VERSION = 1
READER_HINT = ("this is a snapsvc checkpoint: load it with "
               "dcp.load(..., storage_reader=snapsvc.dcp.SnapsvcStorageReader(path))")


def entry_key(index: MetadataIndex, is_tensor: bool) -> str:
    """The file entry that holds one DCP item."""
    if not is_tensor:
        return index.fqn
    return f"{index.fqn}@{','.join(str(int(o)) for o in index.offset or ())}"


def step_of(path: str | os.PathLike[str]) -> tuple[str, int]:
    """(root directory, step) of a ``.../step_<N>`` checkpoint path."""
    p = os.path.abspath(os.fspath(path))
    m = re.fullmatch(r"step_(\d+)", os.path.basename(p))
    if m is None:
        raise ValueError(f"{p}: a snapsvc DCP checkpoint path is a step directory named "
                         "step_<N> (e.g. ckpt/step_100); pass checkpoint_id=root/step_<N>")
    return os.path.dirname(p), int(m.group(1))


def is_step_path(checkpoint_id: Any) -> bool:
    """Whether ``checkpoint_id`` is a local ``step_<N>`` directory path (DCP's
    ``validate_checkpoint_id`` of the writer and the reader)."""
    try:
        step_of(checkpoint_id)
    except (ValueError, TypeError):
        return False
    return True


def plans_meta(plans: list[SavePlan]) -> dict[str, Any]:
    """DCP's metadata of a global save plan, as msgpack-able values."""
    items: dict[str, Any] = {}
    for rank, plan in enumerate(plans):
        for it in plan.items:
            fqn = it.index.fqn
            if it.type == WriteItemType.BYTE_IO:
                items[fqn] = {"kind": "bytes", "rank": rank}
                continue
            td = it.tensor_data
            assert td is not None
            entry = items.setdefault(fqn, {
                "kind": "tensor", "size": list(td.size),
                "dtype": str(td.properties.dtype).removeprefix("torch."), "chunks": []})
            entry["chunks"].append({"offsets": list(td.chunk.offsets),
                                    "sizes": list(td.chunk.sizes), "rank": rank})
    return {"version": VERSION, "items": items}


def meta_from(raw: Any, where: str) -> tuple[Metadata, dict[tuple[str, tuple[int, ...]], int]]:
    """DCP ``Metadata`` and each chunk's rank, from :func:`plans_meta`'s values."""
    try:
        if raw["version"] != VERSION:
            raise FormatError(f"{where}: snapsvc DCP metadata version {raw['version']}, "
                              f"expected {VERSION}; upgrade snapsvc")
        md: dict[str, Any] = {}
        ranks: dict[tuple[str, tuple[int, ...]], int] = {}
        for fqn, e in raw["items"].items():
            if e["kind"] == "bytes":
                md[fqn] = BytesStorageMetadata()
                ranks[(fqn, ())] = int(e["rank"])
                continue
            dtype = getattr(torch, e["dtype"])
            if not isinstance(dtype, torch.dtype):
                raise FormatError(f"{where}: item {fqn!r} has unknown dtype {e['dtype']!r}")
            chunks = []
            for c in e["chunks"]:
                chunks.append(ChunkStorageMetadata(offsets=torch.Size(c["offsets"]),
                                                   sizes=torch.Size(c["sizes"])))
                ranks[(fqn, tuple(c["offsets"]))] = int(c["rank"])
            md[fqn] = TensorStorageMetadata(properties=TensorProperties(dtype=dtype),
                                            size=torch.Size(e["size"]), chunks=chunks)
    except FormatError:
        raise
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise FormatError(f"{where}: malformed snapsvc DCP metadata ({e!r}); expected what "
                          "SnapsvcStorageWriter writes; the checkpoint is damaged") from e
    return Metadata(state_dict_metadata=md), ranks


def _refuse() -> None:
    """What DCP's default reader meets when it unpickles a snapsvc ``.metadata``."""
    raise FormatError(READER_HINT)


class _Refusal:
    """Pickled as ``.metadata``: unpickling it raises :data:`READER_HINT`."""

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (_refuse, ())

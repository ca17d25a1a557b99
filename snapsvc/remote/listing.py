"""What ``snapsvc ls`` shows: the complete checkpoints of each tier, side by side.

A checkpoint is listed when its ``.meta`` exists beside its file (the commit
marker on both tiers); its step is ``extra["step"]`` when the submit gave one,
else the last number in its name.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import tempfile
from dataclasses import dataclass, field
from typing import Any

from ..errors import FormatError
from ..files.metafile import META_SUFFIX, Meta, companions, read_meta
from .fetch import run_sync
from .store import Store, open_store

__all__ = ["Listed", "list_checkpoints"]

log = logging.getLogger("snapsvc")

_NUMBER = re.compile(r"\d+")


@dataclass
class Listed:
    name: str                 # path under the tier's root, "/"-separated
    step: int | None
    bytes: int                # the checkpoint's files, metadata included
    metrics: dict[str, Any] = field(default_factory=dict)
    created: float | None = None
    tiers: list[str] = field(default_factory=list)


def _step(name: str, meta: Meta) -> int | None:
    extra = meta.extra
    if isinstance(extra, dict) and type(extra.get("step")) is int:
        return extra["step"]
    numbers = _NUMBER.findall(name.rpartition("/")[2])
    return int(numbers[-1]) if numbers else None


def _listed(name: str, meta: Meta, meta_bytes: int) -> Listed:
    size = meta.size + meta_bytes + sum(c.size for c in companions(name, meta))
    return Listed(name, _step(name, meta), size,
                  dict(meta.metrics) if isinstance(meta.metrics, dict) else {},
                  meta.created if isinstance(meta.created, (int, float)) else None)


async def _scan(store: Store) -> list[Listed]:
    objects = {o.key: o.size for o in await store.list()}
    names = [k[: -len(META_SUFFIX)] for k in objects
             if k.endswith(META_SUFFIX) and k[: -len(META_SUFFIX)] in objects]
    metas = await asyncio.gather(*(store.get(n + META_SUFFIX) for n in names))
    out = []
    with tempfile.TemporaryDirectory(prefix="snapsvc-ls-") as tmp:
        for i, (name, data) in enumerate(zip(names, metas)):
            if data is None:  # deleted meanwhile
                continue
            local = os.path.join(tmp, str(i))
            with open(local + META_SUFFIX, "wb") as f:
                f.write(data)
            try:
                out.append(_listed(name, read_meta(local), len(data)))
            except FormatError as e:
                log.warning("%s: unreadable metadata, not listed: %s",
                            store.key_url(name + META_SUFFIX), e.reason)
    return out


def list_checkpoints(tiers: list[tuple[str, str]]) -> list[Listed]:
    """The complete checkpoints of each ``(tier name, URL or directory)``,
    merged by name, newest step first."""
    merged: dict[str, Listed] = {}
    for tier, location in tiers:
        for item in run_sync(_scan(open_store(location))):
            known = merged.setdefault(item.name, item)
            known.tiers.append(tier)
    return sorted(merged.values(), key=lambda r: (r.step is not None, r.step or 0,
                                                   r.created or 0.0, r.name), reverse=True)

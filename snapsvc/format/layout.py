"""The slot layout: where each tensor of a snapshot lives inside a slot.

Pure description, shared by both processes (the trainer builds it, the
sidecar rebuilds it from a message): names, shapes, dtypes, offsets and
kinds. Tensors of one dtype and one copy phase (see :data:`EARLY`) are
packed back to back in a *group* that starts 64-byte aligned::

    slot: | header 64 B (claim word) | group 0 ... | pad | group 1 ... | pad |
            ^ int64 claim word          ^ tensors of one (phase, dtype), packed

The file order of the entries is independent of where they sit in the slot.

No torch here: a spec names its dtype (``"float32"``, torch's name without
``torch.``), so the writer sidecar rebuilds a layout from its message and
reads each tensor's bytes as a span of the slot's mapping (:meth:`Layout.spans`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple, Sequence

from .framing import DATA, FDL, Framing, Span

__all__ = ["ALIGN", "HEADER", "PARAM", "BUFFER", "OPTIM", "STATE", "STATE_STEP", "EARLY",
           "TensorSpec", "Group", "Layout", "dtype_name"]

ALIGN = 64
# Each slot starts with a 64-byte header; its first int64 is the claim word:
# the seq the writer may start on, or a negative value (see snapsvc.format.claims).
HEADER = 64


PARAM, BUFFER, OPTIM = "param", "buffer", "optim"
# Tensors of a nested state beyond its model (snapsvc.state): STATE_STEP ones
# (parameters, optimizer state) change only in an optimizer step, which
# guard() can hold back; STATE ones (buffers, plain tensors) may change any time.
STATE, STATE_STEP = "state", "state_step"
# Kinds overlap mode copies at submit (what forward() may change); the others
# wait for the copier thread. Never in one group with the others.
EARLY = frozenset((BUFFER, STATE))


class TensorSpec(NamedTuple):
    """One tensor of a layout. A named tuple: a submit whose names change lays out
    hundreds of them, and a frozen dataclass costs several times more to make."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch's name, without "torch.": "float32"
    offset: int
    nbytes: int
    kind: str  # PARAM, BUFFER, STATE, STATE_STEP (the model file) or OPTIM (the optimizer file)

    @property
    def in_data_file(self) -> bool:
        """Written to the data file (a dtype ``.fdl`` has no tag for), not the ``.fdl``."""
        return self.dtype not in FDL.tag_of

    @property
    def framing(self) -> Framing:
        """The file format its dtype goes to: ``.fdl``, else the data file."""
        return DATA if self.in_data_file else FDL


@dataclass(frozen=True)
class Group:
    """Specs (indices, in file order) packed back to back from ``offset``: one dtype."""

    indices: tuple[int, ...]
    offset: int
    nbytes: int
    dtype: str


def _group_key(kind: str, dtype: str) -> tuple[bool, str]:
    return kind in EARLY, dtype


@functools.cache
def dtype_name(dtype: Any) -> str:
    """A torch dtype's name as a spec holds it: ``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


# Bytes per element of every dtype either file stores, by name.
_ITEMSIZE = {name: size for f in (FDL, DATA) for name, size in f.tags.values()}


@dataclass(frozen=True)
class Layout:
    """Where each tensor of a snapshot lives inside a slot: its entries' names, in
    file order, and their places (a :class:`TensorSpec` less the name). A layout
    of other names over one placement shares its ``places``: a checkpoint whose
    names change at every save (Lightning's ``best_k_models``) is placed once,
    and the sidecar hears only the new names."""

    names: tuple[str, ...]
    places: tuple[tuple, ...]   # per entry: (shape, dtype, offset, nbytes, kind)
    nbytes: int
    structural_hash: str

    @classmethod
    def from_specs(cls, specs: Iterable[TensorSpec], nbytes: int, structural_hash: str
                   ) -> "Layout":
        specs = tuple(specs)
        return cls(tuple(s.name for s in specs), tuple(s[1:] for s in specs), nbytes,
                   structural_hash)

    @functools.cached_property
    def specs(self) -> tuple[TensorSpec, ...]:
        """Each entry in file order, made when first asked: a submit that only renames
        a slot's entries does not ask (its copy plan, incremental mode and the
        sidecar's encoders do)."""
        return tuple(TensorSpec(name, *place) for name, place in zip(self.names, self.places))

    @classmethod
    def of(cls, params: Iterable[tuple[str, Any]], buffers: Iterable[tuple[str, Any]],
           structural_hash: str, optim: Iterable[tuple[str, Any]] = (),
           state: Iterable[tuple[str, str, Any]] = ()) -> "Layout":
        """Specs in file order: ``params``, ``buffers``, then ``state`` as
        (kind, name, tensor) triples, then ``optim`` (a file of its own).
        The caller has checked every tensor already, where a refusal can name
        what to change (:func:`snapsvc.format.datafile.check_entries`, or a
        submit's plan, naming key paths): this module knows no torch."""
        triples = [*((PARAM, n, t) for n, t in params), *((BUFFER, n, t) for n, t in buffers),
                   *state, *((OPTIM, n, t) for n, t in optim)]
        return cls.placed([n for _, n, _ in triples],
                          tuple((kind, t.shape, t.dtype) for kind, _, t in triples),
                          structural_hash)

    @classmethod
    def placed(cls, names: Sequence[str], geometry: tuple[tuple[str, Any, Any], ...],
               structural_hash: str) -> "Layout":
        """The layout of entries ``names`` (file order) whose (kind, shape, dtype, a
        torch dtype or its name) are ``geometry``. Offsets: group by group (see
        :attr:`groups`), packed inside each; computed once per geometry, so a
        checkpoint whose names change at every save (Lightning's ``best_k_models``)
        is placed once."""
        places, nbytes = _place(geometry)
        return cls(tuple(names), places, nbytes, structural_hash)

    def placed_like(self, other: "Layout") -> bool:
        """Whether ``other`` puts every tensor where this one does, names aside."""
        # the usual case: one geometry, placed once
        return self.places is other.places or self.places == other.places

    @functools.cached_property
    def groups(self) -> tuple[Group, ...]:
        """The packed groups, in slot order."""
        out = []
        for indices in _grouped((s.kind, s.dtype) for s in self.specs).values():
            first = self.specs[indices[0]]
            out.append(Group(tuple(indices), first.offset,
                             sum(self.specs[i].nbytes for i in indices), first.dtype))
        return tuple(out)

    def to_msg(self) -> dict[str, Any]:
        return {"hash": self.structural_hash, "nbytes": self.nbytes, "names": list(self.names),
                "places": [[list(shape), dtype, offset, n, kind]
                           for shape, dtype, offset, n, kind in self.places]}

    def renamed_msg(self) -> dict[str, Any]:
        """What a sidecar that holds a layout placed like this one needs: names, hash."""
        return {"hash": self.structural_hash, "names": list(self.names)}

    @classmethod
    def from_msg(cls, msg: dict[str, Any]) -> "Layout":
        """A layout from :meth:`to_msg`; ``ValueError`` for a dtype neither file stores,
        or names that do not match the places."""
        names, places = tuple(msg["names"]), msg["places"]
        if len(names) != len(places):
            raise ValueError(f"a layout of {len(names)} names for {len(places)} entries")
        for name, (_, dtype, _, _, _) in zip(names, places):
            if dtype not in _ITEMSIZE:
                raise ValueError(f"entry {name!r}: dtype {dtype!r} is stored by neither "
                                 f"file ({FDL.dtype_names}; {DATA.dtype_names})")
        return cls(names, tuple((tuple(shape), dtype, offset, n, kind)
                                for shape, dtype, offset, n, kind in places),
                   msg["nbytes"], msg["hash"])

    def spans(self, memory: Any) -> list[Span]:
        """Each spec, in layout order, as the framing's encoder takes it:
        ``(name, tag, shape, bytes of memory)``, where ``memory`` is the slot's
        bytes (its mapping, in the sidecar). The views follow the memory."""
        view = memoryview(memory)
        if self.nbytes > len(view):
            raise ValueError(f"a layout of {self.nbytes} bytes does not fit in an arena "
                             f"of {len(view)}")
        return [(s.name, s.framing.tag_of[s.dtype], s.shape, view[s.offset:s.offset + s.nbytes])
                for s in self.specs]


@functools.lru_cache(maxsize=16)
def _place(kinds: tuple[tuple[str, tuple[int, ...], str], ...]
           ) -> tuple[tuple[tuple, ...], int]:
    """Each entry's (shape, dtype name, offset, nbytes, kind), given (kind, shape, dtype)
    in file order, and the layout's size."""
    kinds = tuple((kind, shape, d if type(d) is str else dtype_name(d)) for kind, shape, d in kinds)
    sizes = [math.prod(shape) * _ITEMSIZE[dtype] for _, shape, dtype in kinds]
    offsets = [0] * len(kinds)
    offset = HEADER
    for indices in _grouped((kind, dtype) for kind, _, dtype in kinds).values():
        for i in indices:
            offsets[i] = offset
            offset += sizes[i]
        offset = -(-offset // ALIGN) * ALIGN
    return tuple((tuple(shape), dtype, off, n, kind)
                 for (kind, shape, dtype), off, n in zip(kinds, offsets, sizes)), offset


def _grouped(kinds: Iterable[tuple[str, str]]) -> dict[tuple[bool, str], list[int]]:
    """Entry indices by group, given each entry's (kind, dtype name), in slot order."""
    groups: dict[tuple[bool, str], list[int]] = {}
    for i, (kind, dtype) in enumerate(kinds):
        groups.setdefault(_group_key(kind, dtype), []).append(i)
    return groups

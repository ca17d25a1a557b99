"""Container kinds that msgpack cannot tell from a dict: ``Counter``, ``OrderedDict``, ``defaultdict``.

Schedulers and optimizers hold them (``MultiStepLR.milestones`` is a
``Counter``, and ``SequentialLR`` calls ``.elements()`` on it), so a value
tree keeps them in memory and they must come back as themselves. On disk
and in the sidecar's messages the tree stays plain (every mapping a msgpack
map, as before) and a separate table, :func:`split`'s ``records``, says
which maps were which kind::

    [[root, path, kind, factory], ...]
      root     the field of the metadata the path starts in ("state", "extra")
      path     the keys (str or int) and list or tuple indices from there; an
               ObjectNode (module, optimizer, stateful) is passed through
               without a key, as its state is where the tree goes on
      kind     "Counter", "OrderedDict" or "defaultdict"
      factory  a defaultdict's default_factory: one of :data:`FACTORIES`' names,
               or None; None for the other kinds

A reader that does not know the table (an older snapsvc) ignores it and reads
plain dicts, as it always did; a file without the table reads as plain dicts.
Only the kinds and factories named here are ever built, and every record
must name a map of the tree (:func:`join` raises ``ValueError`` otherwise),
so the table is bounded by the metadata's own size limit and can build
nothing else.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, defaultdict
from typing import Any

from .protocol import ObjectNode

__all__ = ["KINDS", "FACTORIES", "kind_of", "like", "split", "join"]

KINDS: dict[str, type] = {"Counter": Counter, "OrderedDict": OrderedDict,
                          "defaultdict": defaultdict}
_NAMES = {t: n for n, t in KINDS.items()}
# default_factory values a defaultdict may have: types whose values snapsvc stores
FACTORIES: dict[str, type] = {t.__name__: t for t in (dict, list, tuple, int, float, str,
                                                     bytes, bool, Counter, OrderedDict)}
_FACTORY_NAMES = {t: n for n, t in FACTORIES.items()}


def kind_of(value: Any) -> tuple[str, str | None] | None:
    """(kind, factory name) of a mapping of one of :data:`KINDS` (exactly, not a
    subclass), None for any other. ``ValueError`` for a defaultdict whose
    ``default_factory`` is not None nor in :data:`FACTORIES`."""
    name = _NAMES.get(type(value))
    if name is None:
        return None
    if name != "defaultdict" or value.default_factory is None:
        return name, None
    factory = _FACTORY_NAMES.get(value.default_factory)
    if factory is None:
        raise ValueError(f"a defaultdict whose default_factory is "
                         f"{getattr(value.default_factory, '__name__', value.default_factory)!r}"
                         f" (stored: None or one of {', '.join(FACTORIES)}; pass dict(d) to "
                         "store it as a dict)")
    return name, factory


def like(template: Any, items: dict[Any, Any]) -> dict[Any, Any]:
    """``items`` as a mapping of ``template``'s kind (a plain dict for any other)."""
    return _build(kind_of(template), items)


def _build(kind: tuple[str, str | None] | None, items: dict[Any, Any]) -> dict[Any, Any]:
    if kind is None:
        return items
    name, factory = kind
    if name == "defaultdict":
        return defaultdict(None if factory is None else FACTORIES[factory], items)
    return KINDS[name](items)


def split(roots: dict[str, Any]) -> tuple[dict[str, Any], list[list[Any]]]:
    """``roots`` ({field: tree}) with every mapping a plain dict, and the records of
    the ones that were not (see the module docstring)."""
    records: list[list[Any]] = []

    def plain(node: Any, root: str, path: list[Any]) -> Any:
        t = type(node)
        if t is ObjectNode:
            value = plain(node.value, root, path)
            return node if value is node.value else ObjectNode(node.kind, node.cls, value)
        if isinstance(node, dict):
            kind = kind_of(node)
            if kind is not None:
                records.append([root, list(path), kind[0], kind[1]])
            out = {k: plain(v, root, path + [k]) for k, v in node.items()}
            same = t is dict and all(out[k] is v for k, v in node.items())
            return node if same else out
        if t is list or t is tuple:
            items = [plain(v, root, path + [i]) for i, v in enumerate(node)]
            if all(a is b for a, b in zip(items, node)):
                return node
            return tuple(items) if t is tuple else items
        return node

    return {r: plain(v, r, []) for r, v in roots.items()}, records


def join(roots: dict[str, Any], records: Any) -> dict[str, Any]:
    """The inverse of :func:`split`: ``roots`` with the recorded maps rebuilt as
    their kinds. ``ValueError`` names a malformed record, or one that names no
    map of the tree."""
    if records is None or records == []:
        return roots
    if type(records) is not list:
        raise ValueError(f"the container kinds are a {type(records).__name__}, not a list")
    wanted: dict[tuple[Any, ...], tuple[str, str | None]] = {}
    for rec in records:
        if type(rec) is not list or len(rec) != 4 or rec[0] not in roots \
                or type(rec[1]) is not list \
                or any(type(k) not in (str, int) for k in rec[1]) or rec[2] not in KINDS \
                or (rec[3] is not None and (rec[2] != "defaultdict" or rec[3] not in FACTORIES)):
            raise ValueError(f"malformed container kind record {rec!r:.200}")
        key = (rec[0], *rec[1])   # not in the subscript: mypy reads that as 3.11 syntax
        wanted[key] = (rec[2], rec[3])
    used = 0

    def typed(node: Any, path: tuple[Any, ...]) -> Any:
        nonlocal used
        t = type(node)
        if t is ObjectNode:
            return ObjectNode(node.kind, node.cls, typed(node.value, path))
        if t is dict:
            items = {k: typed(v, path + (k,)) for k, v in node.items()}
            kind = wanted.get(path)
            used += kind is not None
            return _build(kind, items)
        if t is list or t is tuple:
            out = [typed(v, path + (i,)) for i, v in enumerate(node)]
            return tuple(out) if t is tuple else out
        return node

    out = {r: typed(v, (r,)) for r, v in roots.items()}
    if used != len(wanted):
        raise ValueError(f"{len(wanted) - used} container kind record(s) name no map of the "
                         "tree: the table does not belong to it")
    return out

"""Key paths: how a value's place in a state names its entry, and questions
asked of a state or of its flattened tree without staging it.

::

    path   := segment ("/" segment)*
    segment:= str key, with "%" -> "%25", "/" -> "%2F" and a leading "#" -> "%23"
            | "#" decimal      an int key, or a list or tuple index

One module keeps its own names (:func:`model_key`): the value under the
top-level key ``"model"`` if it is a module, else the only module among the
top-level values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from torch import nn

from ..format.protocol import InlineTensor, ObjectNode, TensorRef

__all__ = ["MAX_DEPTH", "path_name", "show", "segment", "model_key", "find", "param_names",
           "outline"]

MAX_DEPTH = 64  # containers nest no deeper; a real training state is a few levels


def segment(key: str | int) -> str:
    if type(key) is int:
        return f"#{key}"
    # type(key) is int leaves a str here (a bool key is refused earlier); mypy cannot see it
    s = cast(str, key).replace("%", "%25").replace("/", "%2F")
    return "%23" + s[1:] if s.startswith("#") else s


def path_name(path: tuple) -> str:
    """The entry name, or report path, of ``path`` (a tuple of keys and indices)."""
    return "/".join(segment(k) for k in path)


def show(path: tuple, root: str = "state") -> str:
    return root + "".join(f"[{k!r}]" for k in path)


def model_key(state: Mapping) -> str | None:
    """Which top-level module keeps its own names (see the module docstring)."""
    if isinstance(state.get("model"), nn.Module):
        return "model"
    keys = [k for k, v in state.items() if isinstance(v, nn.Module)]
    return keys[0] if len(keys) == 1 and type(keys[0]) is str else None


def find(state: Mapping, types: type | tuple[type, ...]) -> list[tuple[str, Any]]:
    """(path name, value) of every value of ``types`` in ``state``, reached through
    dicts, lists and tuples, in the state's order."""
    out: list[tuple[str, Any]] = []

    def visit(v: Any, path: tuple) -> None:
        if isinstance(v, types):
            out.append((path_name(path), v))
        elif len(path) >= MAX_DEPTH:
            return
        elif isinstance(v, Mapping):
            for k, item in v.items():
                visit(item, path + (k,))
        elif type(v) in (list, tuple):
            for i, item in enumerate(v):
                visit(item, path + (i,))

    visit(state, ())
    return out


def param_names(state: Mapping) -> dict[int, str]:
    """``id(parameter)`` -> its entry name, for every module in ``state``: the
    names a submit gives them."""
    out: dict[int, str]
    key, out = model_key(state), {}
    own = None if key is None else segment(key)
    for where, module in find(state, nn.Module):
        # named_parameters()'s names, first name of a shared one kept, without its set of
        # seen tensors: hashing a DTensor goes through __torch_function__ (~3 us each).
        # A module that overrides named_parameters() (FSDP1 strips its wrapper's prefix)
        # gets its modules' own attribute names here, not the override's
        for prefix, mod in module.named_modules():
            for n, p in mod._parameters.items():
                if p is not None and id(p) not in out:
                    n = f"{prefix}.{n}" if prefix else n
                    out[id(p)] = n if where == own else f"{where}/{segment(n)}"
    return out


def outline(tree: Any) -> list[str]:
    """One line per leaf of a flattened tree: its path and what it is (not its
    value), so two trees of the same structure have the same outline."""
    out: list[str] = []

    def visit(node: Any, path: tuple) -> None:
        t = type(node)
        if t is ObjectNode:
            out.append(f"{show(path)}: {node.kind}")
            visit(node.value, path)
        elif isinstance(node, dict):
            if t is not dict:   # an OrderedDict, Counter or defaultdict
                out.append(f"{show(path)}: {t.__name__}")
            for k, v in node.items():
                visit(v, path + (k,))
        elif t in (list, tuple):
            out.append(f"{show(path)}: {t.__name__} of {len(node)}")
            for i, v in enumerate(node):
                visit(v, path + (i,))
        elif t is InlineTensor:
            out.append(f"{show(path)}: {node.dtype} tensor {list(node.shape)}")
        elif t is TensorRef:
            out.append(f"{show(path)}: tensor {node.name!r}")
        else:
            out.append(f"{show(path)}: {t.__name__}")

    visit(tree, ())
    return out

"""``snapsvc convert``, ``migrate`` and ``consolidate``: write a checkpoint from another.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Callable
from torch import nn

from ..errors import SnapsvcError
from ..state.migrate import migrate_checkpoint
from ..files.convert import convert_file, file_format
from .core import EXIT_INCOMPLETE, EXIT_OK, ProgressBar, UsageError, human_bytes, register


# -- convert ------------------------------------------------------------------------
def _convert_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", metavar="SRC", help=".fdl, .fdl.gz, .safetensors, .pt or .pth")
    p.add_argument("dst", metavar="DST", help=".fdl, .fdl.gz, .safetensors, .pt or .pth "
                   "(written atomically)")


@register("convert", help="convert between .fdl/.fdl.gz, .safetensors and .pt",
          description="Convert tensors bit for bit between .fdl/.fdl.gz, .safetensors and .pt "
          "state dicts (file types by suffix). .pt files are read with torch.load("
          "weights_only=True). DST is written atomically: on any error it is left as it was. "
          "dtypes .fdl lacks (bool, uint8, int8, int16, ...) are refused, naming the entry.",
          arguments=_convert_arguments)
def _convert(args: argparse.Namespace) -> int:
    for path in (args.src, args.dst):
        try:
            file_format(path)
        except ValueError as e:
            raise UsageError(str(e)) from None
    with ProgressBar() as bar:
        tf = convert_file(args.src, args.dst, progress=bar)
    print(f"{args.src} -> {args.dst}: {len(tf.entries)} entries, "
          f"{human_bytes(tf.tensor_bytes)} of tensor data")
    return EXIT_OK


# -- migrate ------------------------------------------------------------------------
def load_factory(spec: str) -> Callable[[], object]:
    """``"package.module:factory"`` (or ``module:Class.method``) to the callable it names."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"--model {spec!r}: expected MODULE:FACTORY, e.g. mypkg.models:build")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does, for a console script
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError as e:
        raise SnapsvcError(f"--model {spec!r}: cannot import {module_name!r} ({e})") from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise SnapsvcError(f"--model {spec!r}: {module_name!r} has no attribute "
                               f"{attr!r}") from None
    if not callable(obj):
        raise SnapsvcError(f"--model {spec!r}: {attr!r} is a {type(obj).__name__}, "
                           "not callable")
    return obj


def _fdl_arg(path: str, what: str) -> None:
    try:
        kind = file_format(path)
    except ValueError:
        return  # no known suffix: read as .fdl (the magic is checked)
    if kind != "fdl":
        raise UsageError(f"{what} {path}: migrate reads and writes .fdl/.fdl.gz only; "
                         "use 'snapsvc convert' first")


def _migrate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", metavar="SRC", help="the old .fdl/.fdl.gz checkpoint")
    p.add_argument("dst", metavar="DST", help="the rewritten checkpoint (.fdl/.fdl.gz)")
    p.add_argument("--model", required=True, metavar="MODULE:FACTORY",
                   help="a function (or class) returning the new nn.Module, e.g. "
                   "mypkg.models:build; the current directory is importable")


@register("migrate", help="rewrite a checkpoint under a renamed model's names",
          description="Rewrite SRC under the names of the model FACTORY() builds (flodl's "
          "rules: same name and shape first, then the first unused entry of the same shape "
          "and dtype), and print the report.",
          epilog="exit codes: 0 complete, 3 incomplete (entries dropped or missing; DST is "
          "written all the same), 1 failure, 2 usage error",
          arguments=_migrate_arguments)
def _migrate(args: argparse.Namespace) -> int:
    _fdl_arg(args.src, "SRC")
    _fdl_arg(args.dst, "DST")
    factory = load_factory(args.model)
    model = factory()
    if not isinstance(model, nn.Module):
        raise SnapsvcError(f"--model {args.model!r} returned a {type(model).__name__}, "
                           "not a torch.nn.Module")
    report = migrate_checkpoint(args.src, args.dst, model)
    print(report)
    return EXIT_OK if report.is_complete() else EXIT_INCOMPLETE


def _consolidate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("step_dir", metavar="STEP_DIR",
                   help="a complete step_<N> directory saved from a sharded (FSDP2/DTensor) model")
    p.add_argument("dst", metavar="DST", help="the .fdl, .fdl.gz, .safetensors, .pt or .pth "
                   "to write")


@register("consolidate", help="merge a sharded multi-rank checkpoint into one file",
          description="Write the full, unsharded model of a sharded checkpoint (STEP_DIR, "
          "written by DistributedSnapshotWriter from FSDP2/DTensor parameters) to DST under the "
          "model's own names, in the format DST's suffix names. A .fdl/.fdl.gz DST gets DST.meta "
          "and, when the optimizer was saved, its .optim.fdl beside it; a .safetensors or .pt "
          "DST holds the model's tensors only. Every piece is checked against the manifest's "
          "CRC-32 first; DST is written atomically. Prints DST.",
          arguments=_consolidate_arguments)
def _consolidate(args: argparse.Namespace) -> int:
    from ..distributed import consolidate  # torch.distributed only when needed
    try:
        file_format(args.dst)
    except ValueError as e:
        raise UsageError(str(e)) from None
    with ProgressBar() as bar:
        dst = consolidate(args.step_dir, args.dst, progress=bar)
    print(dst)
    return EXIT_OK

"""The ``snapsvc`` command line (also ``python -m snapsvc``).

Subcommands live in :data:`COMMANDS`, filled by the :func:`register`
decorator; a new one is a function ``run(args) -> int`` plus a function that
adds its arguments (see ``_demo`` below).

Output goes to stdout; errors go to stderr as one line ``snapsvc: error:
...`` (exit 2 for usage, 1 for failures), never a traceback unless
``--debug``. The progress bar is drawn on stderr only when it is a terminal.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import json
import logging
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Callable, TextIO

from torch import nn

from . import __version__
from .checkpoint import migrate_checkpoint
from .convert import FileInfo, convert_file, describe_file, file_format
from .errors import SnapsvcError
from .meta import META_SUFFIX, meta_path, read_meta
from .resume import optim_path
from .verify import VerifyReport, verify

__all__ = ["EXIT_OK", "EXIT_FAILURE", "EXIT_USAGE", "EXIT_INCOMPLETE", "Command", "COMMANDS",
           "register", "build_parser", "main", "ProgressBar", "UsageError"]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INCOMPLETE = 3

EPILOG = """\
exit codes:
  0  success
  1  failure: an unreadable or corrupt file, a refused conversion, a failed verify
  2  usage error: bad arguments, an unknown file type
  3  migrate only: the migration is incomplete (entries dropped or missing);
     DST is written all the same

file types are chosen by suffix: .fdl, .fdl.gz, .safetensors, .pt/.pth
"""

class UsageError(Exception):
    """Bad command-line arguments: exit code 2."""


# -- the command registry -----------------------------------------------------------
@dataclass(frozen=True)
class Command:
    name: str
    help: str
    run: Callable[[argparse.Namespace], int]
    arguments: Callable[[argparse.ArgumentParser], None] | None = None
    description: str | None = None
    epilog: str | None = None


COMMANDS: dict[str, Command] = {}


def register(name: str, *, help: str, arguments: Callable[[argparse.ArgumentParser], None]
             | None = None, description: str | None = None, epilog: str | None = None
             ) -> Callable[[Callable[[argparse.Namespace], int]],
                           Callable[[argparse.Namespace], int]]:
    """Decorator: make ``run(args) -> exit code`` the subcommand ``name``."""
    def deco(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        if name in COMMANDS:
            raise ValueError(f"command {name!r} is already registered")
        COMMANDS[name] = Command(name, help, run, arguments, description, epilog)
        return run
    return deco


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise UsageError(message)


def _global_options(p: argparse.ArgumentParser, default: object) -> None:
    p.add_argument("-v", "--verbose", action="store_true", default=default,
                   help="log progress details (INFO) on stderr")
    p.add_argument("--debug", action="store_true", default=default,
                   help="show the full traceback of an error")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="snapsvc", description="Inspect, verify, convert and migrate "
                     "flodl .fdl checkpoints.", epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"snapsvc {__version__}")
    _global_options(parser, False)
    # The same flags after the subcommand; SUPPRESS keeps the top-level value when absent.
    common = _Parser(add_help=False)
    _global_options(common, argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for cmd in COMMANDS.values():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.description or cmd.help,
                           epilog=cmd.epilog, parents=[common])
        if cmd.arguments is not None:
            cmd.arguments(p)
    return parser


# -- output helpers -----------------------------------------------------------------
def human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024  # type: ignore[assignment]
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    raise AssertionError  # pragma: no cover


def _printable(name: str) -> str:
    """A name as-is, or its repr when it holds control characters."""
    return name if name.isprintable() else repr(name)


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _one_line(e: BaseException) -> str:
    text = _ANSI.sub("", str(e)).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    msg = lines[0] if lines else ""
    if isinstance(e, (SnapsvcError, OSError)):
        return msg or type(e).__name__
    return f"{type(e).__name__}: {msg} (--debug shows the traceback)" if msg \
        else f"{type(e).__name__} (--debug shows the traceback)"


def _error(message: str) -> None:
    print(f"snapsvc: error: {message}", file=sys.stderr)


class ProgressBar:
    """A one-line progress bar, drawn only when ``stream`` (stderr) is a terminal.

    Call it as a :data:`snapsvc.convert.Progress`: ``bar(phase, done, total)``.
    ``unit="B"`` shows byte counts, anything else plain counts.
    """

    def __init__(self, stream: TextIO | None = None, *, unit: str = "B", width: int = 28,
                 interval: float = 0.1) -> None:
        self.stream = sys.stderr if stream is None else stream
        try:
            self.enabled = bool(self.stream.isatty())
        except (AttributeError, ValueError):
            self.enabled = False
        self.unit = unit
        self.width = width
        self.interval = interval
        self._last = 0.0
        self._drawn = False

    def _count(self, n: int) -> str:
        return human_bytes(n) if self.unit == "B" else str(n)

    def __call__(self, phase: str, done: int, total: int | None) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        final = total is not None and done >= total
        if self._drawn and not final and now - self._last < self.interval:
            return
        self._last = now
        if total:
            frac = min(max(done / total, 0.0), 1.0)
            fill = int(frac * self.width)
            text = (f"{phase} [{'#' * fill}{'.' * (self.width - fill)}] {frac:4.0%} "
                    f"{self._count(done)}/{self._count(total)}")
        else:
            text = f"{phase} {self._count(done)}"
        self.stream.write(f"\r{text}\x1b[K")
        self.stream.flush()
        self._drawn = True

    def clear(self) -> None:
        """Erase the bar (before printing a line to the same terminal)."""
        if self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._drawn = False

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc: object) -> None:
        self.clear()


# -- inspect ------------------------------------------------------------------------
def _iso(ts: object) -> str | None:
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
        return None
    try:
        return _dt.datetime.fromtimestamp(ts, _dt.timezone.utc).astimezone() \
            .isoformat(timespec="seconds")
    except (OverflowError, OSError, ValueError):
        return None


def _meta_summary(path: str) -> tuple[dict | None, str | None]:
    """(metadata as plain JSON-able values, or None; the reason it is unreadable, or None)."""
    if not os.path.exists(meta_path(path)):
        return None, None
    try:
        m = read_meta(path)
    except SnapsvcError as e:
        return None, getattr(e, "reason", str(e))
    buffers = m.buffers if isinstance(m.buffers, list) else []
    return {
        "path": meta_path(path),
        "epoch": m.epoch,
        "metrics": m.metrics,
        "buffers": len(buffers),
        "buffer_names": buffers,
        "entries": m.entries,
        "size": m.size,
        "crc32": f"{m.crc32:08x}" if isinstance(m.crc32, int) else repr(m.crc32),
        "structural_hash": m.structural_hash,
        "format_version": m.format_version,
        "created": _iso(m.created),
        "created_unix": m.created if isinstance(m.created, (int, float)) else None,
        "optimizer": _optimizer_summary(getattr(m, "optimizer", None)),
    }, None


def _optimizer_summary(opt: object) -> dict | None:
    """The optimizer file's description from the metadata, without its state."""
    if not isinstance(opt, dict):
        return None
    return {k: opt.get(k) for k in ("class", "file", "entries", "size")}


def _inspect_json(info: FileInfo, meta: dict | None, meta_error: str | None) -> str:
    doc = {
        "path": info.path,
        "format": info.format,
        "gzip": info.gzip,
        "file_bytes": info.file_bytes,
        "version": info.version,
        "structural_hash": info.structural_hash,
        "tensor_bytes": info.tensor_bytes,
        "entries": [{"name": e.name, "dtype": str(e.dtype).removeprefix("torch."),
                     "shape": list(e.shape), "bytes": e.nbytes, "offset": e.offset}
                    for e in info.entries],
        "safetensors_metadata": info.metadata if info.format == "safetensors" else None,
        "meta": meta,
        "meta_error": meta_error,
    }
    return json.dumps(_strict_json(doc), default=str, allow_nan=False)


def _strict_json(value: object) -> object:
    """``value`` ready for strict JSON: every non-finite float (a diverged loss, say)
    becomes the string "NaN", "Infinity" or "-Infinity", which keeps which one it
    was (``float()`` reads each back), and a map key JSON cannot hold its ``str``."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, dict):
        return {k if isinstance(k, (str, int)) or k is None else str(_strict_json(k)):
                _strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(v) for v in value]
    return value


def _table(rows: list[tuple[str, ...]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.rjust(w) if i in right else c.ljust(w)
                             for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in rows]


def _inspect_text(info: FileInfo, meta: dict | None, meta_error: str | None) -> str:
    kind = info.format + (" (gzip)" if info.gzip else "")
    lines = [
        f"file:            {info.path}",
        f"format:          {kind}, {info.file_bytes} bytes on disk",
    ]
    if info.format == "fdl":
        lines.append(f"version:         {info.version}")
    lines += [
        f"structural hash: {info.structural_hash or ('none (all zeros)' if info.format == 'fdl' else 'none')}",
        f"entries:         {len(info.entries)}, {info.tensor_bytes} bytes of tensor data"
        + (f" ({human_bytes(info.tensor_bytes)})" if info.tensor_bytes >= 1024 else ""),
    ]
    if info.entries:
        rows = [("name", "dtype", "shape", "bytes")]
        rows += [(_printable(e.name), str(e.dtype).removeprefix("torch."),
                  "[" + ", ".join(map(str, e.shape)) + "]", str(e.nbytes)) for e in info.entries]
        lines += [""] + _table(rows, right={3})
    if info.format == "safetensors" and info.metadata:
        lines += ["", "safetensors metadata:"]
        lines += [f"  {_printable(k)}: {_printable(v)}" for k, v in info.metadata.items()]
    lines.append("")
    if meta_error is not None:
        lines.append(f"metadata:        invalid: {meta_error}")
    elif meta is None:
        if info.format == "fdl":
            lines.append(f"metadata:        none ({os.path.basename(meta_path(info.path))} "
                         "does not exist)")
    else:
        metrics = meta["metrics"]
        if isinstance(metrics, dict):
            metrics = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                                for k, v in metrics.items()) or "none"
        lines += [
            f"metadata ({os.path.basename(meta['path'])}):",
            f"  epoch:    {meta['epoch']}",
            f"  metrics:  {metrics}",
            f"  buffers:  {meta['buffers']}",
            f"  entries:  {meta['entries']}",
            f"  size:     {meta['size']} bytes",
            f"  crc32:    {meta['crc32']}",
            f"  created:  {meta['created'] or repr(meta['created_unix'])}",
        ]
        opt = meta["optimizer"]
        if opt is not None:
            lines.append(f"  optimizer: {opt['class']}, {opt['entries']} entries in "
                         f"{opt['file']} ({opt['size']} bytes)")
    return "\n".join(lines).rstrip("\n")


def _inspect_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE", help=".fdl, .fdl.gz or .safetensors (a .pt file "
                   "is loaded, weights only)")
    p.add_argument("--json", action="store_true", help="print one strict JSON object; a "
                   "non-finite number (e.g. a NaN loss) is the string \"NaN\", \"Infinity\" "
                   "or \"-Infinity\"")


@register("inspect", help="show a checkpoint's version, hash, entries and metadata",
          description="Show a checkpoint's version, structural hash and entries (name, "
          "dtype, shape, bytes) without loading tensor data, and its <FILE>.meta when "
          "present.", arguments=_inspect_arguments)
def _inspect(args: argparse.Namespace) -> int:
    try:
        kind = file_format(args.file)
    except ValueError:
        kind = "fdl"  # snapsvc's own format needs no suffix; the decoder checks the magic
    info = describe_file(args.file, format=kind)
    meta, meta_error = _meta_summary(args.file) if kind == "fdl" else (None, None)
    print(_inspect_json(info, meta, meta_error) if args.json
          else _inspect_text(info, meta, meta_error))
    return EXIT_OK


# -- verify -------------------------------------------------------------------------
def _verify_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", metavar="FILE", nargs="+", help=".fdl or .fdl.gz checkpoints")
    p.add_argument("--no-meta", action="store_true",
                   help="do not require <FILE>.meta (still checked when present)")


def _part_of(path: str) -> tuple[str, str] | None:
    """(checkpoint, role) when ``path`` is the metadata or the optimizer file
    written beside a checkpoint; None for a checkpoint (or anything else)."""
    if os.path.exists(meta_path(path)):
        return None  # it has metadata of its own: a checkpoint
    if path.endswith(META_SUFFIX):
        return path[: -len(META_SUFFIX)], "metadata"
    head, sep, tail = path.rpartition(".optim")
    owner = head + tail
    if sep and optim_path(owner) == path and (os.path.exists(owner)
                                              or os.path.exists(meta_path(owner))):
        return owner, "optimizer file"
    return None


@register("verify", help="check checkpoints' structure, size and CRC-32",
          description="Check each checkpoint's structure and, from its <FILE>.meta, its size, "
          "CRC-32, entry count and hash, and those of its optimizer file. A .meta or "
          "optimizer file given on its own is checked as part of its checkpoint (so "
          "'verify checkpoints/*' works). Prints one line per file (OK) or per problem; exits "
          "1 if any file fails.", arguments=_verify_arguments)
def _verify(args: argparse.Namespace) -> int:
    reports: dict[str, VerifyReport] = {}  # by checkpoint: each is read once
    given = set(args.files)
    failed = 0
    n = len(args.files)
    with ProgressBar(unit="files") as bar:
        for i, path in enumerate(args.files):
            bar(f"verifying {os.path.basename(path)}", i, n)
            part = _part_of(path)
            owner = path if part is None else part[0]
            first = owner not in reports
            if first:
                reports[owner] = verify(owner, require_meta=not args.no_meta)
            report = reports[owner]
            bar.clear()
            if part is None:
                lines, ok = [str(report)], report.ok
            else:
                # the checkpoint's problems, once, unless it is listed itself
                shown = [str(report)] if first and owner not in given and not report.ok else []
                lines, ok = _verify_part(path, part[1], report, args.no_meta)
                lines = shown + lines
            print("\n".join(lines), flush=True)
            failed += not ok
    if n > 1:
        print(f"{n - failed} of {n} files OK" + (f", {failed} failed" if failed else ""))
    return EXIT_FAILURE if failed else EXIT_OK


def _verify_part(path: str, role: str, report: VerifyReport, no_meta: bool
                 ) -> tuple[list[str], bool]:
    """The lines for a metadata or optimizer file whose checkpoint gave ``report``, and
    whether it passed. It passes with its checkpoint, when the checkpoint checked it."""
    owner = report.path
    if role == "optimizer file":
        if report.meta is None:
            if no_meta:  # no metadata vouches for it: check its structure on its own
                alone = verify(path, require_meta=False)
                return [str(alone)], alone.ok
        else:
            opt = report.meta.optimizer
            named = opt.get("file") if isinstance(opt, dict) else None
            if named != os.path.basename(path):
                return [f"{path}: FAILED: not the optimizer file of {owner} (its metadata "
                        f"names {named or 'none'}): a leftover of an earlier write?"], False
    if report.ok:
        return [f"{path}: OK, checked as the {role} of {owner}"], True
    return [f"{path}: FAILED, checked as the {role} of {owner} (see its problems)"], False


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
    return obj  # type: ignore[return-value]


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


# -- demo ---------------------------------------------------------------------------
def _demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default="checkpoints", help="where checkpoints go (default: "
                   "./checkpoints)")
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument("--every", type=int, default=25, help="checkpoint every N steps (default 25)")
    p.add_argument("--keep-last", type=int, default=3, help="checkpoints kept (default 3)")


def _consolidate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("step_dir", metavar="STEP_DIR",
                   help="a complete step_<N> directory saved from a sharded (FSDP2/DTensor) model")
    p.add_argument("dst", metavar="DST", help="the .fdl or .fdl.gz to write")


@register("consolidate", help="merge a sharded multi-rank checkpoint into one .fdl",
          description="Write the full, unsharded model of a sharded checkpoint (STEP_DIR, "
          "written by DistributedSnapshotWriter from FSDP2/DTensor parameters) to DST under the "
          "model's own names, with DST.meta and, when the optimizer was saved, its .optim.fdl "
          "beside it. Every piece is checked against the manifest's CRC-32 first; DST is "
          "written atomically. Prints DST.", arguments=_consolidate_arguments)
def _consolidate(args: argparse.Namespace) -> int:
    from .distributed import consolidate  # torch.distributed only when needed
    print(consolidate(args.step_dir, args.dst))
    return EXIT_OK


@register("demo", help="train a small CPU model with sidecar checkpoints, then restore",
          description="Train a small MLP on synthetic data on the CPU, checkpoint model, "
          "optimizer and step through the writer sidecar every --every steps into --dir, "
          "print a per-checkpoint stall table, then restore the last checkpoint into a fresh "
          "model and check it is bit-identical.", arguments=_demo_arguments)
def _demo(args: argparse.Namespace) -> int:
    from .demo import format_demo, run_demo  # torch training code: only when asked for

    if args.steps < args.every or args.every < 1:
        raise UsageError("--steps must be at least --every, and --every at least 1")
    print(f"snapsvc demo: {args.steps} steps, a checkpoint every {args.every}, into "
          f"{os.path.abspath(args.dir)}", flush=True)
    result = run_demo(args.dir, steps=args.steps, every=args.every, keep_last=args.keep_last)
    print(format_demo(result))
    return EXIT_OK if result.restored_ok else EXIT_FAILURE


# -- bench --------------------------------------------------------------------------
def _bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plot", default="stall.png", help="PNG plot (default stall.png)")
    p.add_argument("--json", default="stall.json", help="JSON rows (default stall.json)")
    p.add_argument("rest", nargs=argparse.REMAINDER,
                   help="further options for benchmarks/stall.py (after --), e.g. "
                   "-- --models 64M small --reps 20")


@register("bench", help="run the stall benchmark against the peers and write the plot",
          description="Run benchmarks/stall.py from the source checkout snapsvc is installed "
          "from: torch.save, a thread-based async save, DCP async_save and snapsvc, same "
          "models, one run.", arguments=_bench_arguments)
def _bench(args: argparse.Namespace) -> int:
    import subprocess

    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "benchmarks", "stall.py")
    if not os.path.exists(script):
        raise SnapsvcError(f"{script} not found: 'snapsvc bench' needs the source checkout "
                           "(pip install -e .)")
    rest = [a for a in args.rest if a != "--"]
    return subprocess.call([sys.executable, script, "--plot", args.plot, "--json", args.json,
                            *rest])


# -- main ---------------------------------------------------------------------------
def _configure_logging(verbose: bool, debug: bool) -> None:
    logging.basicConfig(format="%(name)s: %(levelname)s: %(message)s", stream=sys.stderr)
    level = logging.DEBUG if debug else logging.INFO if verbose else logging.WARNING
    logging.getLogger("snapsvc").setLevel(level)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (the console script exits with it)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as e:
        _error(f"{e} (see 'snapsvc --help')")
        return EXIT_USAGE
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else EXIT_OK
    if args.command is None:
        _error("a command is required: " + ", ".join(COMMANDS) + " (see 'snapsvc --help')")
        return EXIT_USAGE
    _configure_logging(args.verbose, args.debug)
    try:
        return COMMANDS[args.command].run(args)
    except UsageError as e:
        _error(str(e))
        return EXIT_USAGE
    except KeyboardInterrupt:
        if args.debug:
            raise
        _error("interrupted")
        return 130
    except Exception as e:
        if args.debug:
            raise
        _error(_one_line(e))
        return EXIT_FAILURE


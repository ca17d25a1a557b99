"""The ``snapsvc`` command line's core: the command registry, the parser, output helpers, ``main``.

Subcommands live in :data:`COMMANDS`, filled by the :func:`register`
decorator in the command modules (``files``, ``rewrite``, ``tools``); a new one
is a function ``run(args) -> int`` plus a function that adds its arguments.

Output goes to stdout; errors go to stderr as one line ``snapsvc: error:
...`` (exit 2 for usage, 1 for failures), never a traceback unless
``--debug``. Progress (tqdm's bar) is drawn on stderr only when it is a terminal.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from dataclasses import dataclass
from typing import Callable, NoReturn

from tqdm import tqdm

from .. import __version__
from ..errors import SnapsvcError

__all__ = ["EXIT_OK", "EXIT_FAILURE", "EXIT_USAGE", "EXIT_INCOMPLETE", "Command", "COMMANDS", "register", "build_parser", "main", "ProgressBar", "UsageError", "human_bytes"]


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
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _global_options(p: argparse.ArgumentParser, default: object) -> None:
    p.add_argument("-v", "--verbose", action="store_true", default=default,
                   help="log progress details (INFO) on stderr")
    p.add_argument("--debug", action="store_true", default=default,
                   help="show the full traceback of an error")


def build_parser() -> argparse.ArgumentParser:
    from . import files, rewrite, tools  # noqa: F401 - their @register fills COMMANDS

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
    """tqdm's bar on stderr, as a :data:`snapsvc.files.tensors.Progress` callback:
    ``bar(phase, done, total)``; each new phase starts a bar of its own. tqdm draws
    only on a terminal (``disable=None``). ``unit="B"`` counts bytes (KiB, MiB...)."""

    def __init__(self, *, unit: str = "B") -> None:
        self.unit = unit
        self._bar: tqdm | None = None
        self._phase = ""

    def __call__(self, phase: str, done: int, total: int | None) -> None:
        bar = self._bar
        if bar is None or self._phase != phase:
            self.close()
            self._phase = phase
            bar = self._bar = tqdm(desc=phase, total=total, unit=self.unit, disable=None,
                                   unit_scale=self.unit == "B", unit_divisor=1024,
                                   leave=False, file=sys.stderr, dynamic_ncols=True)
        elif total is not None and bar.total != total:
            bar.total = total
        bar.update(done - bar.n)

    def clear(self) -> None:
        """Erase the bar before a line is printed to the same terminal."""
        if self._bar is not None:
            self._bar.clear()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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

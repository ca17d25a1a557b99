"""The RAM tier: memory-only snapshots, held in tmpfs beside the sidecar.

A snapshot submitted with ``persist=False`` is written by the sidecar, as
any other, but under a private mirror of its directory in ``/dev/shm``
(RAM, never a disk) instead of under its own path: the same files, the same
metadata with its CRC-32s, so a read checks it exactly as it checks a disk
copy. The trainer's submit is unchanged (the slot copy); only where the
sidecar writes differs.

Layout: ``/dev/shm/snapsvc-<uid>/`` (mode 0700, owned by the user; a
symlink or a foreign owner is refused with :class:`UnsafePathError`), then one
folder per checkpoint directory, named by a hash of its absolute path, holding
the checkpoint's files under their own names. The sidecar that wrote them
removes them when it exits: a RAM copy lives as long as its writer.

Reads (:func:`read_first`) try the RAM copy of a path first and fall back to
the disk when there is none or it is bad (reported with a warning).
No torch here: the sidecar imports this module.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import stat
import warnings
from typing import Any, Callable, TypeVar

from ..errors import SnapsvcError, UnsafePathError
from .metafile import META_SUFFIX, checkpoint_names, meta_path
from .verify import verify

__all__ = ["check_private", "ram_root", "ram_path", "ram_folder", "held", "problem", "good_copy",
           "read_first", "drop", "series", "ram_series", "complete", "number"]

log = logging.getLogger("snapsvc")

F = TypeVar("F", bound=Callable[..., Any])

SHM = "/dev/shm"

_DIGITS = re.compile(r"\d+")


def series(path: str) -> tuple[str, str]:
    """The series of ``path`` (keep_last's, keep_in_memory's, persist_every's):
    its directory and its name with digits masked."""
    return os.path.dirname(path), _DIGITS.sub("#", os.path.basename(path))


def ram_series(path: str) -> tuple[str, str, str]:
    """The series of ``path`` in the RAM tier (``keep_in_memory``'s): as :func:`series`,
    and its folder's name with digits masked too, so the state files of
    ``checkpoint-100/`` and ``checkpoint-200/`` replace each other."""
    folder, name = series(path)
    return os.path.dirname(folder), _DIGITS.sub("#", os.path.basename(folder)), name


def check_private(path: str, create: bool) -> bool:
    """``path`` is a real directory of ours, mode 0700 (made so when ``create``);
    False when missing and not created. Never follows a symlink."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not create:
            return False
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError(f"{path} is not a plain directory (a symlink or a file): snapsvc "
                              "keeps private snapshots there and never follows one; remove it")
    if st.st_uid != os.getuid():
        raise UnsafePathError(f"{path} is owned by uid {st.st_uid}, not by this user "
                              f"(uid {os.getuid()}): refused; remove it or run as its owner")
    if st.st_mode & 0o077:
        raise UnsafePathError(f"{path} has mode {stat.S_IMODE(st.st_mode):o}, open to other "
                              "users; expected 0700: chmod 700 it or remove it")
    return True


def ram_root() -> str:
    """The user's RAM-tier folder (its path; not made here)."""
    return os.path.join(SHM, f"snapsvc-{os.getuid()}")


def ram_path(path: str | os.PathLike[str], *, create: bool = False) -> str | None:
    """Where the RAM copy of the checkpoint ``path`` lives; None when the
    tier's folders do not exist (and ``create`` is False)."""
    full = os.path.abspath(os.fspath(path))
    root = ram_root()
    folder = os.path.join(root, hashlib.sha256(os.path.dirname(full).encode()).hexdigest()[:16])
    for _ in range(3):  # another sidecar's exit may remove an empty root between the two
        try:
            if not check_private(root, create) or not check_private(folder, create):
                return None
            return os.path.join(folder, os.path.basename(full))
        except FileNotFoundError:
            continue
    raise UnsafePathError(f"{folder} kept vanishing while it was made; is something "
                          f"removing {root}?")


def _tidy(ram: str) -> None:
    """Remove the folders above a dropped RAM copy once empty, so an exited
    sidecar leaves no /dev/shm entry (a folder still in use stays)."""
    for folder in (os.path.dirname(ram), ram_root()):
        try:
            os.rmdir(folder)
        except OSError:  # not empty: another writer's copies, or its folder
            return


def held(path: str | os.PathLike[str]) -> str | None:
    """The RAM copy of ``path`` when one is complete (its metadata, written
    last, is there), else None."""
    if not os.path.isdir(SHM):
        return None
    ram = ram_path(path)
    return ram if ram is not None and os.path.exists(meta_path(ram)) else None


def ram_folder(directory: str | os.PathLike[str]) -> str | None:
    """The RAM tier's folder of the checkpoints in ``directory``; None when there is none."""
    ram = ram_path(os.path.join(os.path.abspath(os.fspath(directory)), "x"))
    return None if ram is None or not os.path.isdir(os.path.dirname(ram)) \
        else os.path.dirname(ram)


def problem(ram: str) -> str | None:
    """The first thing wrong with the RAM copy ``ram`` (its size, the CRC-32 of each
    part, its metadata), or None when it is whole: checked before a read trusts it."""
    try:
        report = verify(ram)
    except (SnapsvcError, ValueError, OSError) as e:
        return str(e)
    return report.problems[0] if report.problems else None


def good_copy(path: str | os.PathLike[str]) -> str | None:
    """The RAM copy of ``path`` when one is held and whole; None when none is held,
    or when it is bad (then a ``RuntimeWarning`` names the problem)."""
    ram = held(path)
    if ram is None:
        return None
    why = problem(ram)
    if why is None:
        return ram
    warnings.warn(f"the RAM copy of {os.fspath(path)} is bad ({why}); reading it from disk "
                  "instead", RuntimeWarning, stacklevel=2)
    return None


def drop(ram: str) -> None:
    """Remove a RAM copy, metadata first (it vouches for the rest), and its
    folders once empty."""
    for name in checkpoint_names(ram):
        try:
            os.unlink(name)
        except FileNotFoundError:
            pass
    _tidy(ram)


def read_first(reader: F) -> F:
    """``reader(path, ...)`` that reads the RAM copy of ``path`` when one is
    held, and the disk when there is none or it fails its checks (a warning
    names the problem)."""
    @functools.wraps(reader)
    def wrapper(path: Any, *args: Any, **kwargs: Any) -> Any:
        local = isinstance(path, (str, os.PathLike)) and "://" not in os.fspath(path)
        ram = held(path) if local else None
        if ram is None:
            return reader(path, *args, **kwargs)
        try:
            result = reader(ram, *args, **kwargs)
        except (SnapsvcError, ValueError, OSError) as e:
            if not any(os.path.exists(p) for p in (path, meta_path(path))):
                raise  # no disk copy to fall back to: the RAM copy's own error says why
            warnings.warn(f"the RAM copy of {os.fspath(path)} is bad ({e}); "
                          "reading it from disk instead", RuntimeWarning, stacklevel=2)
            return reader(path, *args, **kwargs)
        problems = getattr(result, "problems", None)
        if problems:  # verify's report: a bad RAM copy is skipped too
            warnings.warn(f"the RAM copy of {os.fspath(path)} is bad ({problems[0]}); "
                          "checking the disk copy instead", RuntimeWarning, stacklevel=2)
            return reader(path, *args, **kwargs)
        if getattr(result, "path", None) == ram:
            result.path = os.fspath(path)
        return result
    return wrapper  # type: ignore[return-value]


def complete(folder: str) -> dict[str, tuple[int, float]]:
    """Checkpoint names in ``folder`` whose metadata and file are there: (the last
    number in the name, or -1; the metadata's mtime). Newest first by these is what
    :func:`snapsvc.latest` (:mod:`snapsvc.remote.listing`) answers."""
    found: dict[str, tuple[int, float]] = {}
    try:
        names = set(os.listdir(folder))
    except FileNotFoundError:
        return found
    for meta in names:
        name = meta[:-len(META_SUFFIX)]
        if not meta.endswith(META_SUFFIX) or name not in names:
            continue
        found[name] = (number(name), os.stat(os.path.join(folder, meta)).st_mtime)
    return found


def number(name: str) -> int:
    """The last number in a checkpoint's name (its step), -1 when it has none."""
    digits = _DIGITS.findall(os.path.basename(name))
    return int(digits[-1]) if digits else -1

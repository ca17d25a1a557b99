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

A process that holds copies in a folder marks it, first, with a file of its
own there (``.owner-<pid>-<random>``: pids repeat across containers sharing
``/dev/shm``; an older version's ``.owner-<pid>`` is a mark too) that it keeps
locked (``flock``) until it exits:
the kernel drops the lock when the process dies, SIGKILL included, so a lock
that can be taken is a dead owner's. A sidecar killed before it could free its
copies (a SIGKILLed ``snapsvc serve``, or a lingering sidecar, with no trainer
attached) thus leaves a folder no live process marks: the next sidecar or
service of that directory adopts it (:func:`adopt`), holding the whole copies
that pass their checks as its own and removing the rest. Marks are made and
looked at under a ``flock`` of the folder itself, so that of two processes
starting at once exactly one adopts. Each start also sweeps the whole tree
(:func:`sweep`): what dead holders left of directories that are gone, or that is
no part of a whole copy. A symlink in the tree is removed, never followed.

Reads (:func:`read_first`) try the RAM copy of a path first and fall back to
the disk when there is none or it is bad (reported with a warning).
No torch here: the sidecar imports this module.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import hashlib
import logging
import os
import re
import secrets
import stat
import time
import warnings
from typing import Any, Callable, TypeVar

from ..errors import SnapsvcError, UnsafePathError
from .metafile import META_SUFFIX, checkpoint_names, meta_path
from .verify import verify

__all__ = ["check_private", "ram_root", "ram_path", "ram_folder", "held", "problem", "good_copy",
           "read_first", "drop", "size_of", "series", "ram_series", "complete", "number", "claim", "adopt",
           "release_marks", "sweep", "tidy"]

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
    digest = hashlib.sha256(os.fsencode(os.path.dirname(full))).hexdigest()
    folder = os.path.join(root, digest[:16])
    for _ in range(3):  # another sidecar's exit may remove an empty root between the two
        try:
            if not check_private(root, create) or not check_private(folder, create):
                return None
            return os.path.join(folder, os.path.basename(full))
        except FileNotFoundError:
            continue
    raise UnsafePathError(f"{folder} kept vanishing while it was made; is something "
                          f"removing {root}?")


_OWNER = ".owner-"
_RECORD = ".snapsvc-dir"   # the directory whose checkpoints a folder mirrors (for sweep)
_EMPTY_AGE = 60.0   # seconds an empty folder is left to the process that just made it
# folder -> (our pid, the locked fd of our mark, its name)
_marks: dict[str, tuple[int, int, str]] = {}


def _ours(folder: str) -> int | None:
    """The locked fd of this process's mark in ``folder`` (none in a forked child)."""
    pid, fd, _ = _marks.get(folder, (None, -1, ""))
    return fd if pid == os.getpid() else None


def _our_mark(folder: str) -> tuple[str, int]:
    """This process's mark in ``folder`` (its path and locked fd), no longer remembered."""
    _, fd, name = _marks.pop(folder)
    return os.path.join(folder, name), fd


def _lock(folder: str, create: bool, wait: bool = True) -> int | None:
    """An fd of ``folder`` itself, ``flock``-ed: held around every mark's making and
    every look at others' marks (:func:`claim`, :func:`adopt`, :func:`sweep`,
    removal), so that two processes never both see the other's mark as live, nor
    one removes a folder another is marking. None when the folder is missing (and
    not ``create``d), or, without ``wait``, locked by another process."""
    for _ in range(5):
        try:
            if not check_private(ram_root(), create) or not check_private(folder, create):
                return None
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:  # removed meanwhile (under its lock, by another)
            continue
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            raise UnsafePathError(f"{folder} was replaced by a symlink or a file while it was "
                                  "locked: snapsvc keeps private snapshots there and never "
                                  "follows one; remove it") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            if os.path.samestat(os.fstat(fd), os.lstat(folder)):
                return fd
        except (BlockingIOError, FileNotFoundError):
            pass
        os.close(fd)
        if not wait:
            return None
    raise UnsafePathError(f"{folder} kept vanishing while it was locked; is something "
                          f"removing {ram_root()}?")


def _entries(folder: str) -> list[str]:
    """The names in ``folder`` (locked by us), symlinks left out: each one is removed
    with a warning naming it (the link itself: never followed). Nothing snapsvc
    makes there is a link."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        entry = os.path.join(folder, name)
        try:
            if not stat.S_ISLNK(os.lstat(entry).st_mode):
                out.append(name)
                continue
            os.unlink(entry)
        except FileNotFoundError:
            continue
        warnings.warn(f"{entry} is a symlink in snapsvc's private RAM tier, where snapsvc "
                      "makes none: removed, never followed", RuntimeWarning, stacklevel=3)
    return out


def _home(path: str) -> str:
    """What a RAM folder's record names: the nearest existing folder above ``path``
    (the checkpoint's directory, or for a memory-only ``step_<N>/`` the writer's)."""
    here = os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(here) and os.path.dirname(here) != here:
        here = os.path.dirname(here)
    return here


def claim(ram: str, path: str | None = None) -> None:
    """Mark the folder of the RAM copy ``ram`` (made if missing) as this process's
    until it exits: before it writes there, or holds copies handed over. A live
    mark keeps :func:`adopt` and :func:`sweep` of another process out of the folder.
    ``path``: the checkpoint ``ram`` mirrors, recorded for :func:`sweep` (which
    removes a dead holder's folder once its directory is gone)."""
    folder = os.path.dirname(ram)
    if _ours(folder) is not None:
        return
    lock = _lock(folder, create=True)
    assert lock is not None
    try:
        _mark(folder, path)
    finally:
        os.close(lock)


def _mark(folder: str, path: str | None) -> None:
    """:func:`claim`'s mark, ``folder`` locked by us."""
    if _ours(folder) is not None:
        return
    # a name of our own, not the pid alone: containers sharing /dev/shm reuse pids
    name = f"{_OWNER}{os.getpid()}-{secrets.token_hex(8)}"
    fd = os.open(os.path.join(folder, name),
                 os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a file just made: no one else holds it
    _marks[folder] = (os.getpid(), fd, name)
    if path is not None and not os.path.lexists(os.path.join(folder, _RECORD)):
        _write_record(folder, _home(path))


def _write_record(folder: str, home: str) -> None:
    """The record, written whole under a temp name then renamed: a writer killed (or
    a full tmpfs) midway never leaves an empty record under the final name."""
    temp = os.path.join(folder, f"{_RECORD}.{os.getpid()}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        with open(fd, "wb") as f:
            f.write(os.fsencode(home))
        os.replace(temp, os.path.join(folder, _RECORD))
    except BaseException:
        try:
            os.unlink(temp)
        except FileNotFoundError:
            pass
        raise


def _read_record(folder: str) -> str | None:
    """The directory ``folder``'s record names; None when there is no record, or it
    is not an absolute path (an empty one, cut short by an older writer): unknown,
    so the folder's copies are kept."""
    try:
        with open(os.path.join(folder, _RECORD), "rb") as f:
            home = os.fsdecode(f.read())
    except FileNotFoundError:
        return None
    return home if os.path.isabs(home) else None


def _dead_marks(folder: str, names: list[str]) -> list[tuple[str, int]] | None:
    """The marks in ``folder`` (locked by us) of dead processes, each locked by us
    now (so ours to remove); None when one is a live process's. Our own mark is
    left out."""
    dead: list[tuple[str, int]] = []
    mine = _marks[folder][2] if _ours(folder) is not None else None
    for name in names:
        if not name.startswith(_OWNER) or name == mine:
            continue
        try:
            fd = os.open(os.path.join(folder, name), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:  # its process removed it at exit
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # held: its process lives
            os.close(fd)
            _unmark([], tuple(fd for _, fd in dead))
            return None
        dead.append((os.path.join(folder, name), fd))
    return dead


def _unmark(marks: list[tuple[str, int]], fds: tuple[int, ...] = ()) -> None:
    """Remove the marks we hold locked (their files first), then close their fds."""
    for mark, _ in marks:
        try:
            os.unlink(mark)
        except FileNotFoundError:
            pass
    for fd in [fd for _, fd in marks] + list(fds):
        os.close(fd)


def release_marks() -> None:
    """At a sidecar's exit, once its copies are dropped: its marks go, and each
    folder too when nothing else is left in it."""
    for folder in [f for f in _marks if _ours(f) is not None]:
        lock = _lock(folder, create=False)
        try:
            _unmark([_our_mark(folder)])
        finally:
            if lock is not None:
                os.close(lock)
        tidy(folder)


def _bookkeeping(name: str) -> bool:
    """A mark or the record: not a copy."""
    return name.startswith(_OWNER) or name == _RECORD


def tidy(folder: str) -> None:
    """Remove the RAM folder ``folder`` (and the tier's root) once no copy is left in
    it, only its record and our own or dead processes' marks: after a copy is dropped,
    or a receive into it refused or failed, so that nothing leaves a /dev/shm entry.
    A folder with copies, or marked by another live process, stays."""
    lock = _lock(folder, create=False)
    if lock is None:
        return
    try:
        names = _entries(folder)
        if any(not _bookkeeping(n) for n in names):
            return  # copies: ours still, or another writer's
        dead = _dead_marks(folder, names)
        if dead is None:
            return  # a live process marks it
        if _ours(folder) is not None:
            dead.append(_our_mark(folder))
        _unmark(dead)
        _remove(folder, [_RECORD])
    finally:
        os.close(lock)


def _remove(folder: str, names: list[str]) -> None:
    """Remove ``names`` from ``folder`` (locked by us), then the folder and the
    root once empty."""
    for name in names:
        try:
            os.unlink(os.path.join(folder, name))
        except (FileNotFoundError, IsADirectoryError):
            pass
    for empty in (folder, ram_root()):
        try:
            os.rmdir(empty)
        except OSError:  # not empty: another writer's copies, or its folder
            return


def sweep() -> None:
    """Remove what dead holders left in the user's RAM tier, for any directory: in
    each folder no live process marks (and no other process has locked), the dead
    processes' marks; then the folder with all in it when its record's directory is
    gone, or when nothing else is left in it (an empty one once it is
    :data:`_EMPTY_AGE` old: its maker may be about to write). Whole copies of a
    directory that still exists stay, for its next writer to adopt; what is not
    part of one (a temp file, a replica holder's spare, a copy cut mid-write) goes. Symlinks are removed with
    a warning, never followed. Run at each sidecar's and service's start."""
    root = ram_root()
    if not os.path.isdir(SHM) or not check_private(root, False):
        return
    for name in _entries(root):
        folder = os.path.join(root, name)
        try:
            lock = _lock(folder, create=False, wait=False)
        except UnsafePathError as e:  # a file, or another user's: reported, left
            warnings.warn(f"snapsvc's RAM tier: {e}", RuntimeWarning, stacklevel=2)
            continue
        if lock is None:
            continue  # another process marks or adopts it now
        try:
            _sweep_one(folder)
        finally:
            os.close(lock)


def _sweep_one(folder: str) -> None:
    names = _entries(folder)
    dead = _dead_marks(folder, names)
    if dead is None:
        return  # a live holder's
    _unmark(dead)
    if _ours(folder) is not None:
        return
    rest = [n for n in names if not _bookkeeping(n)]
    if not rest and names:
        _remove(folder, [_RECORD])
        return
    home = _read_record(folder)
    if home is not None and not os.path.isdir(home):
        log.info("snapsvc: removing %s: RAM copies of dead processes whose directory %s "
                 "is gone", folder, home)
        _remove(folder, rest + [_RECORD])
    elif not names and time.time() - os.lstat(folder).st_mtime > _EMPTY_AGE:
        _remove(folder, [])
    elif home is not None:  # marked once: what is not part of a whole copy is a dead one's
        whole = {os.path.basename(p) for n in complete(folder)
                 for p in checkpoint_names(os.path.join(folder, n))}
        loose = [n for n in rest if n not in whole]  # temps, spares, a copy cut mid-write
        if loose:
            log.info("snapsvc: removing %s from %s: left by dead processes mid-write",
                     loose, folder)
            _remove(folder, loose + ([_RECORD] if len(loose) == len(rest) else []))


def adopt(directory: str | os.PathLike[str] | None) -> list[tuple[str, str]]:
    """The RAM copies of ``directory``'s checkpoints that dead processes left
    (a sidecar or service SIGKILLed before it freed them), as (path, its RAM copy)
    pairs, now this process's (marked: :func:`claim`): only where no live process
    marks the folder (the folder's lock makes this exact: of two processes
    adopting at once, the first takes the copies, the second sees its live mark).
    Each must be whole (metadata, files, sizes and CRC-32s: :func:`problem`); the
    others (a copy killed mid-write, a damaged one, a temp file) are removed, a
    damaged one with a warning. Oldest first. What dead holders left elsewhere is
    swept first (:func:`sweep`)."""
    if directory is None or not os.path.isdir(SHM):
        return []
    sweep()
    base = os.path.abspath(os.fspath(directory))
    folder = ram_folder(base)
    if folder is None:
        return []
    lock = _lock(folder, create=False)
    if lock is None:
        return []
    try:
        return _adopt(folder, base)
    finally:
        os.close(lock)


def _adopt(folder: str, base: str) -> list[tuple[str, str]]:
    _mark(folder, os.path.join(base, "x"))  # first: a process marking it after us is live
    names = _entries(folder)
    dead = _dead_marks(folder, names)
    if dead is None or not dead and not any(not _bookkeeping(n) for n in names):
        return []  # a live owner holds it, or there is nothing to adopt
    whole = complete(folder)
    keep: list[tuple[str, str]] = []
    held_names: set[str] = set()
    for name in sorted(whole, key=lambda n: whole[n][::-1]):
        ram = os.path.join(folder, name)
        why = problem(ram)
        if why is not None:
            log.warning("a dead sidecar's RAM copy %s is bad (%s): removed", ram, why)
            continue
        keep.append((os.path.join(base, name), ram))
        held_names.update(os.path.basename(p) for p in checkpoint_names(ram))
    _remove(folder, [n for n in names if not _bookkeeping(n) and n not in held_names])
    _unmark(dead)   # the folder stays: our mark is in it
    return keep


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


def size_of(ram: str) -> int:
    """The bytes of a RAM copy's files (those that exist)."""
    total = 0
    for name in checkpoint_names(ram):
        try:
            total += os.stat(name).st_size
        except FileNotFoundError:
            pass
    return total


def drop(ram: str) -> None:
    """Remove a RAM copy, metadata first (it vouches for the rest), and its
    folders once empty."""
    for name in checkpoint_names(ram):
        try:
            os.unlink(name)
        except FileNotFoundError:
            pass
    tidy(os.path.dirname(ram))


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

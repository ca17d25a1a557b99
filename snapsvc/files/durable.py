"""Durable file writes: temp file in the same directory, fsync, rename, fsync dir.

A reader of the final name sees either the previous complete file or the new
complete file, never a partial one, whatever happens to this process. Temp
files carry :data:`TMP_SUFFIX` and the writing pid, so a restarted writer can
find and remove the ones a dead writer left behind.

Two phases, so several files can be committed in a chosen order (checkpoint
before its metadata): :func:`staged_write` writes and fsyncs a temp file,
:func:`commit` renames them in order and fsyncs each directory once, all or
nothing: a failure at any step puts back the files it replaced.
:func:`atomic_write` is both for one file.

Temp files are created like ``open()`` creates files (mode 0666 less the
umask), so a committed checkpoint has the permissions any other file written
by the process would have, and are named so they fit the file system's name
limit beside a final name of any allowed length (:func:`check_final_name`).

Fault injection: :func:`set_fault_hook` installs ``hook(stage, path)``, called
at ``"open"``, ``"write"``, ``"fsync"`` and ``"rename"``; raising ``OSError``
there simulates a disk fault (tests use it for faults no filesystem here can
produce on demand, such as a failed fsync).
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import time
from contextlib import contextmanager
from typing import BinaryIO, Callable, Iterable, Iterator

from isal import isal_zlib

from ..errors import PathError

__all__ = ["TMP_SUFFIX", "DurableFile", "staged_write", "commit", "discard", "atomic_write",
           "fsync_dir", "remove_stale_temps", "set_fault_hook", "check_final_name", "set_aside",
           "unlink_quietly", "current_umask"]

TMP_SUFFIX = ".snapsvc-tmp"
_NAME_MAX = 255  # bytes in one file name on Linux file systems (ext4, xfs, btrfs, tmpfs)
_hook: Callable[[str, str], None] | None = None


def set_fault_hook(hook: Callable[[str, str], None] | None) -> None:
    """Install (or with None remove) the process-wide fault-injection hook."""
    global _hook
    _hook = hook


def _fault(stage: str, path: str) -> None:
    if _hook is not None:
        _hook(stage, path)


# A write this large bypasses the file's buffer: its bytes go from the
# caller's memory (a slot) to the kernel with no copy in user space.
_DIRECT = 1 << 20
# ...in chunks of this size: each is CRC'd just before its write() (so it is
# read from cache, not memory, the second time) and handed to writeback right
# after, so the disk works while later chunks are copied and the final fsync
# has little left to wait for. 8 MiB: measured here, 8-16 MiB chunks with
# early writeback reach durable ~15-30 % sooner than one write then fsync.
WRITE_CHUNK = 8 << 20
_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h: start writeback, do not wait for it


def _libc_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux/glibc: writeback starts at fsync
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _libc_sync_file_range()


class DurableFile:
    """A write-only temp file that keeps the CRC-32 and size of every byte
    written and the seconds spent in the OS; ``path`` is its final name."""

    def __init__(self, file: BinaryIO, path: str, tmp_path: str) -> None:
        self._file = file
        self.path = path
        self.tmp_path = tmp_path
        self.size = 0
        self.crc32 = 0
        self.write_s = 0.0
        self.fsync_s = 0.0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        """Write a bytes-like object; return its size in bytes.

        Small writes are gathered in the file's buffer; large ones go straight
        from ``data``'s memory to the kernel in :data:`WRITE_CHUNK` pieces.
        """
        _fault("write", self.tmp_path)
        view = memoryview(data)
        if view.nbytes < _DIRECT:
            t0 = time.perf_counter()
            n = self._file.write(view)
            self.write_s += time.perf_counter() - t0
            self.crc32 = isal_zlib.crc32(view, self.crc32)
            self.size += n
            return n
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        t0 = time.perf_counter()
        self._file.flush()  # what is buffered goes first: the fd's offset is then self.size
        fd = self._file.fileno()
        self.write_s += time.perf_counter() - t0
        for start in range(0, len(view), WRITE_CHUNK):
            chunk = view[start:start + WRITE_CHUNK]
            self.crc32 = isal_zlib.crc32(chunk, self.crc32)
            t0 = time.perf_counter()
            done = 0
            while done < len(chunk):
                n = os.write(fd, chunk[done:])
                if n <= 0:  # no progress would loop forever
                    raise OSError(errno.EIO, "write() wrote nothing", self.tmp_path)
                done += n
            if _sync_file_range is not None:
                # A hint only: a failure here (an fs without it) is ignored, and
                # any I/O error of these pages is reported by the fsync that follows.
                _sync_file_range(fd, self.size, len(chunk), _SYNC_FILE_RANGE_WRITE)
            self.write_s += time.perf_counter() - t0
            self.size += len(chunk)
        return len(view)

    def flush(self) -> None:
        self._file.flush()


def fsync_dir(directory: str) -> None:
    """fsync a directory so a rename inside it survives a power cut."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _fault("fsync", directory)
        os.fsync(fd)
    finally:
        os.close(fd)


def discard(*files: DurableFile) -> None:
    """Remove the temp files of staged writes that will not be committed."""
    unlink_quietly(f.tmp_path for f in files)


def _name_max(directory: str) -> int:
    """The longest file name (bytes) ``directory`` takes, or :data:`_NAME_MAX` if unknown
    (e.g. the directory does not exist yet)."""
    try:
        return os.pathconf(directory, "PC_NAME_MAX")
    except (OSError, ValueError):
        return _NAME_MAX


def check_final_name(path: str | os.PathLike[str]) -> None:
    """Raise :class:`~snapsvc.errors.PathError` if ``path``'s file name is longer
    than its directory allows, so a write can be refused before it starts."""
    path = os.fspath(path)
    name = os.path.basename(path)
    limit = _name_max(os.path.dirname(os.path.abspath(path)))
    size = len(os.fsencode(name))
    if size > limit:
        raise PathError(f"{path}: the file name is {size} bytes, longer than the {limit} bytes "
                        "the file system allows; use a shorter name")


def _temp_names(path: str) -> Iterator[str]:
    """Candidate temp names beside ``path``: ``.<base>.<pid>.<random>`` + :data:`TMP_SUFFIX`.

    The pid is what :func:`remove_stale_temps` reads; ``<base>`` is the final
    name, cut at a character boundary when the whole would exceed the name
    limit. 32 random bits: a clash is rare, a hundred in a row impossible.
    """
    directory, base = os.path.split(path)
    pid = os.getpid()
    room = _name_max(directory) - len(f"..{pid}.{'0' * 8}{TMP_SUFFIX}")
    encoded = os.fsencode(base)
    if len(encoded) > room:
        base = encoded[:max(room, 0)].decode("utf-8", "ignore")
    for _ in range(100):
        yield os.path.join(directory, f".{base}.{pid}.{secrets.token_hex(4)}{TMP_SUFFIX}")


def current_umask() -> int:
    """This process's umask, read without changing it where Linux allows
    (``/proc/self/status``, since 4.7): ``os.umask`` can only be read by
    setting it, which races with any other thread creating a file. The
    sidecar writes each file under the umask its submit saw.

    The status file stays open and is read again from its start at each
    call: the kernel writes it anew for every read, so a changed umask
    shows, at ~0.7x the cost of opening it each time (issue 34). A forked
    child opens its own; a descriptor closed (and perhaps reused) under us
    is told by its identity, left alone, and replaced.
    """
    global _status, _no_umask_line
    for _ in range(2):
        if _no_umask_line:
            break
        try:
            if _status is None:
                fd = os.open("/proc/self/status", os.O_RDONLY | os.O_CLOEXEC)
                st = os.fstat(fd)
                _status = (fd, st.st_dev, st.st_ino)
            fd, dev, ino = _status
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (dev, ino):
                raise OSError("another file now")
            data = os.pread(fd, 4096, 0)
        except OSError:  # not Linux, or our descriptor was closed: not ours to close
            _status = None
            continue
        at = data.find(b"\nUmask:")
        if at >= 0:
            return int(data[at + 7:data.index(b"\n", at + 1)], 8)
        os.close(fd)  # a kernel before 4.7: no Umask line
        _status, _no_umask_line = None, True
    mask = os.umask(0o022)  # the racy way, where there is no other
    os.umask(mask)
    return mask


_status: tuple[int, int, int] | None = None  # (descriptor, device, inode) of /proc/self/status
_no_umask_line = False  # before Linux 4.7


def _forget_status() -> None:
    """In a forked child: its /proc/self is another process; close the parent's copy."""
    global _status
    if _status is not None:
        try:
            os.close(_status[0])
        except OSError:
            pass
    _status = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_status)


def _create_temp(path: str) -> tuple[int, str]:
    """Create a new, empty temp file beside ``path``: (fd, temp path).

    Created with mode 0666 so the kernel applies the umask (and a
    directory's default ACL) exactly as for ``open()``: reading the umask to
    chmod afterwards is not thread-safe (``os.umask`` can only be read by
    setting it).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
    tmp = path
    for tmp in _temp_names(path):
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
        except OSError as e:  # named by the destination, the name the user knows
            better = _for_destination(e, path)
            if better is e:
                raise
            raise better from None
    raise FileExistsError(errno.EEXIST, "no unused temp file name", tmp)


def _for_destination(e: OSError, path: str) -> OSError:
    """``e``, raised for a temp file beside ``path``, as about ``path`` or its directory
    (``e`` itself when the temp file is what is wrong: a vanished temp, say)."""
    if e.errno == errno.ENOENT and not os.path.isdir(os.path.dirname(path)):
        name = os.path.basename(path)
        return FileNotFoundError(errno.ENOENT, f"no such directory to write {name} in (create "
                                 "it first)", os.path.dirname(path))
    if e.errno == errno.EISDIR:
        return IsADirectoryError(errno.EISDIR, "is a directory; give a file name", path)
    if e.errno == errno.ENOTDIR:
        return NotADirectoryError(errno.ENOTDIR, "a part of the directory is not a directory",
                                  path)
    return e


def set_aside(path: str) -> str | None:
    """Give the file ``path`` a second, hidden temp name; return it (None if
    there is no such file, or links are not supported).

    Removing or replacing the last name of a large file frees its blocks and
    page cache on the spot: tens of ms for 256 MiB. With a second name, that
    work waits until the caller unlinks the returned name, e.g. after it has
    reported a new checkpoint durable. A crash leaves only a temp file,
    which :func:`remove_stale_temps` removes.
    """
    for tmp in _temp_names(path):
        try:
            os.link(path, tmp, follow_symlinks=False)
            return tmp
        except FileExistsError:
            continue
        except OSError:  # no such file, or a file system without hard links
            return None
    return None


def unlink_quietly(paths: Iterable[str]) -> None:
    """Remove ``paths``, ignoring those already gone."""
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


@contextmanager
def staged_write(path: str | os.PathLike[str]) -> Iterator[DurableFile]:
    """Yield a :class:`DurableFile`; on exit it is flushed and fsynced, not renamed.

    A final name too long for its directory is a
    :class:`~snapsvc.errors.PathError` before anything is written. On an
    exception the temp file is removed. After a clean exit the caller must
    :func:`commit` or :func:`discard` it.
    """
    path = os.fspath(path)
    check_final_name(path)
    if os.path.isdir(path):   # refused before the data is written, not at the rename
        raise IsADirectoryError(errno.EISDIR, "is a directory; give a file name", path)
    _fault("open", path)
    fd, tmp = _create_temp(os.path.abspath(path))
    try:
        with os.fdopen(fd, "wb", buffering=1 << 20) as f:
            out = DurableFile(f, os.path.abspath(path), tmp)
            yield out
            t0 = time.perf_counter()
            f.flush()
            out.write_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            _fault("fsync", tmp)
            os.fsync(f.fileno())
            out.fsync_s = time.perf_counter() - t0
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def commit(*files: DurableFile, trash: list[str] | None = None,
           remove: Iterable[str] = ()) -> None:
    """Rename staged files into place in the given order, then fsync their directories.

    ``remove``: files that must be gone once the commit is done (an earlier
    write's companion files that this one does not replace); they are removed
    just before the last file is renamed (the one that commits the rest, a
    checkpoint's metadata), and put back if the commit fails.

    All or nothing: each file about to be replaced first gets a second,
    hidden name (:func:`set_aside`), so if a rename or a directory's fsync
    fails, every file already renamed is put back as it was (the previous
    file under its name again, or no file where there was none) and the
    temp files are removed: the previous checkpoint stays whole. (On a file
    system without hard links a replaced file cannot be put back.) With
    ``trash``, the second names of the replaced files are appended there,
    for the caller to unlink once it is done timing; without, they are
    unlinked here.
    """
    done: list[tuple[DurableFile, str | None]] = []  # renamed, with the previous file's second name
    removed: list[tuple[str, str | None]] = []  # removed, with its second name
    try:
        for f in files:
            if f is files[-1]:
                removed = _remove(remove)
            _fault("rename", f.path)
            old = set_aside(f.path)
            try:
                os.replace(f.tmp_path, f.path)
            except BaseException as e:
                unlink_quietly([old] if old is not None else [])
                if isinstance(e, OSError) and (better := _for_destination(e, f.path)) is not e:
                    raise better from e
                raise
            done.append((f, old))
        for directory in dict.fromkeys(os.path.dirname(f.path) for f in files):
            t0 = time.perf_counter()
            fsync_dir(directory)
            files[-1].fsync_s += time.perf_counter() - t0
    except BaseException:
        _put_back(done)
        _restore(removed)
        discard(*files)
        raise
    olds = [old for _, old in done + removed if old is not None]
    if trash is not None:
        trash.extend(olds)
    else:
        unlink_quietly(olds)


def _remove(paths: Iterable[str]) -> list[tuple[str, str | None]]:
    """Remove each of ``paths`` that exists, keeping a second name to put it back
    by (see :func:`set_aside`); (path, second name) of each removed."""
    removed: list[tuple[str, str | None]] = []
    try:
        for p in paths:
            aside = set_aside(p)
            try:
                os.unlink(p)
            except OSError as e:  # absent; a name too long for the file system is absent too
                if e.errno not in (errno.ENOENT, errno.ENAMETOOLONG):
                    raise
                unlink_quietly([aside] if aside is not None else [])
                continue
            removed.append((p, aside))
    except BaseException:
        _restore(removed)
        raise
    return removed


def _restore(removed: list[tuple[str, str | None]]) -> None:
    """Undo :func:`_remove`, best effort (a file without a second name is lost)."""
    for p, aside in reversed(removed):
        if aside is not None:
            try:
                os.replace(aside, p)
            except OSError:
                pass


def _put_back(done: list[tuple[DurableFile, str | None]]) -> None:
    """Undo the renames of a failed :func:`commit`, last first (the metadata,
    which vouches for the rest, goes back first). Best effort: the error that
    made the commit fail is the one raised."""
    for f, old in reversed(done):
        try:
            if old is not None:
                os.replace(old, f.path)
            else:
                os.unlink(f.path)
        except OSError:
            pass
    for directory in dict.fromkeys(os.path.dirname(f.path) for f, _ in done):
        try:
            fsync_dir(directory)
        except OSError:
            pass


@contextmanager
def atomic_write(path: str | os.PathLike[str]) -> Iterator[DurableFile]:
    """Yield a :class:`DurableFile` that replaces ``path`` durably on success.

    On any exception the temp file is removed and ``path`` is left as it was.
    """
    with staged_write(path) as out:
        yield out
    commit(out)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(directory: str | os.PathLike[str],
                       only: Callable[[str, float], bool] | None = None) -> list[str]:
    """Delete temp files in ``directory`` whose writing process is dead; return them.
    ``only(final name, the temp's mtime)``, when given, must say yes too (a
    directory shared across hosts, where another host's pid means nothing here)."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for name in names:
        if not (name.startswith(".") and name.endswith(TMP_SUFFIX)):
            continue
        parts = name[: -len(TMP_SUFFIX)].rsplit(".", 2)  # [".<base>", pid, random]
        if len(parts) != 3 or not parts[1].isdigit() or _alive(int(parts[1])):
            continue
        path = os.path.join(directory, name)
        if only is not None:
            try:
                if not only(parts[0][1:], os.stat(path).st_mtime):
                    continue
            except FileNotFoundError:
                continue
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed

"""The checkpoint API: save, load and inspect ``.fdl`` files.

(``migrate_checkpoint`` is :mod:`snapsvc.state.migrate`: it renames optimizer state too.)

Loading follows flodl's rules (``shared/FORMAT.md``): exact-name matching
against parameters and persistent buffers, a shape mismatch is an error, a
differing dtype is converted, data lands on the model tensor's device, and a
non-zero structural hash is checked. Unlike a naive loader, the whole file is
decoded and every check passes before the first model tensor is touched, so a
bad file never leaves a model half-loaded.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Union

import torch
from torch import nn

from ..errors import (ArchitectureMismatchError, FormatError, ShapeMismatchError,
                      StrictLoadError, TargetNotWritableError)
from ..format import fdl
from .durable import commit
from .fused import Pairs, PieceCopier, resident as _resident
from .metafile import FileStats, file_framing, stage_checkpoint_file
from ..format.streams import (GZIP_MAGIC, CrcReader, MemoryReader, PathOrFile, ReadStream,
                              crc32_of, is_gzip_path, open_source)

__all__ = [
    "Checkpoint",
    "FileStats",
    "LoadReport",
    "save_checkpoint",
    "load_checkpoint",
    "read_checkpoint",
    "read_verified",
    "checkpoint_keys",
    "checkpoint_version",
    "copy_problem",
    "file_framing",
    "plan_load",
    "structural_hash",
    "layout_hash",
    "layout_rows_hash",
    "model_tensors",
    "persistent_buffers",
    "stage_checkpoint_file",
    "write_checkpoint_file",
    "encode_to",
]

Tensors = Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]
HashLike = Union[str, bytes, None]


# -- model helpers -------------------------------------------------------------
def persistent_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``model.named_buffers()`` without the buffers registered ``persistent=False``."""
    for name, buf in model.named_buffers():
        owner, _, leaf = name.rpartition(".")
        if leaf not in model.get_submodule(owner)._non_persistent_buffers_set:
            yield name, buf


def model_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What a checkpoint of ``model`` holds, in file order: params, then buffers."""
    return list(model.named_parameters()) + list(persistent_buffers(model))


def structural_hash(model: nn.Module) -> str:
    """SHA-256 (64 hex characters) of the model's tensor layout.

    Exactly this UTF-8 text is hashed, one line per tensor, parameters in
    ``named_parameters()`` order, then persistent buffers in
    ``named_buffers()`` order::

        snapsvc-structural-hash-v1\\n
        param\\t<name>\\t<dtype>\\t<d0>,<d1>,...\\n
        buffer\\t<name>\\t<dtype>\\t<d0>,<d1>,...\\n

    ``<dtype>`` is the torch dtype without ``torch.`` (``float32``); a scalar
    has an empty shape field. Values, devices and ``requires_grad`` do not go
    in, so the hash is the same across processes, runs and devices.
    """
    return layout_hash(model.named_parameters(), persistent_buffers(model))


def layout_hash(params: Iterable[tuple[str, torch.Tensor]],
                buffers: Iterable[tuple[str, torch.Tensor]]) -> str:
    """:func:`structural_hash` of explicit (name, tensor) pairs."""
    return layout_rows_hash(
        (kind, name, t.dtype, tuple(t.shape))
        for kind, pairs in (("param", params), ("buffer", buffers)) for name, t in pairs)


def layout_rows_hash(rows: Iterable[tuple[str, str, torch.dtype, tuple[int, ...]]]) -> str:
    """:func:`structural_hash` of (``"param"`` or ``"buffer"``, name, dtype,
    shape) rows, in file order: what a caller that has them without the
    tensors (a cached layout) hashes."""
    h = hashlib.sha256(b"snapsvc-structural-hash-v1\n")
    for kind, name, dtype, shape in rows:
        h.update(f"{kind}\t{name}\t{str(dtype).removeprefix('torch.')}\t"
                 f"{','.join(map(str, shape))}\n".encode("utf-8"))
    return h.hexdigest()


_structural_hash = structural_hash  # parameters named structural_hash shadow it below


def _hash_bytes(value: HashLike) -> bytes:
    if value is None:
        return bytes(fdl.HASH_LEN)
    if isinstance(value, (bytes, bytearray)):
        if len(value) != fdl.HASH_LEN:
            raise ValueError(f"structural_hash must be {fdl.HASH_LEN} bytes, got {len(value)}")
        return bytes(value)
    if isinstance(value, str):
        try:
            raw = bytes.fromhex(value)
        except ValueError:
            raw = b""
        if len(raw) != fdl.HASH_LEN:
            raise ValueError(f"structural_hash must be {2 * fdl.HASH_LEN} hex characters, "
                             f"got {value!r}")
        return raw
    raise TypeError(f"structural_hash must be a hex str, bytes or None, not {type(value).__name__}")


def _pairs(tensors: Tensors | None) -> list[tuple[str, torch.Tensor]]:
    if tensors is None:
        return []
    if isinstance(tensors, Mapping):
        return list(tensors.items())
    return [(name, t) for name, t in tensors]


# -- save ----------------------------------------------------------------------
def write_checkpoint_file(path: str | os.PathLike[str], entries: list[tuple[str, torch.Tensor]],
                          hash_: bytes, *, compress_level: int | None = None) -> FileStats:
    """Encode ``entries`` durably to ``path`` (gzip when it ends in ``.gz``)."""
    out, stream_bytes, encode_s = stage_checkpoint_file(
        path, fdl.Encoder(entries, structural_hash=hash_), compress_level=compress_level)
    commit(out)
    return FileStats(out.path, out.size, out.crc32, stream_bytes, encode_s, out.write_s,
                     out.fsync_s)


def encode_to(dest: PathOrFile, entries: list[tuple[str, torch.Tensor]], hash_: bytes, *,
              compress_level: int | None = None) -> None:
    """Encode to a path (durably; gzip on ``.gz``) or to a writable binary file."""
    if isinstance(dest, (str, os.PathLike)):
        write_checkpoint_file(dest, entries, hash_, compress_level=compress_level)
    else:
        fdl.encode(dest, entries, structural_hash=hash_)


def save_checkpoint(dest: PathOrFile, params: nn.Module | Tensors,
                    buffers: Tensors | None = None, *, structural_hash: HashLike = None,
                    compress_level: int | None = None) -> None:
    """Write a ``.fdl`` checkpoint.

    ``dest`` is a path (written atomically; gzip when it ends in ``.gz``, at
    isal level ``compress_level``) or a writable binary file. ``params`` and
    ``buffers`` are mappings or iterables of (name, tensor) pairs; params go
    first, then buffers, each in the order given. An ``nn.Module`` as
    ``params`` writes its parameters then persistent buffers, hashed with
    :func:`structural_hash` unless a hash is given.
    """
    if isinstance(params, nn.Module):
        if buffers is not None:
            raise TypeError("pass either a module or params/buffers, not both")
        entries = model_tensors(params)
        if structural_hash is None:
            structural_hash = _structural_hash(params)
    else:
        entries = _pairs(params) + _pairs(buffers)
    encode_to(dest, entries, _hash_bytes(structural_hash), compress_level=compress_level)


# -- read ----------------------------------------------------------------------
@dataclass
class Checkpoint:
    """A decoded checkpoint: every entry as a CPU tensor, in file order."""

    version: int
    structural_hash: str | None
    entries: dict[str, torch.Tensor]
    path: str | None = None


def _checkpoint(dec: fdl.Decoder, entries: dict[str, torch.Tensor], path: str | None
                ) -> Checkpoint:
    assert dec.header is not None
    h = dec.header.structural_hash
    return Checkpoint(dec.header.version, h.hex() if any(h) else None, entries, path)


def read_checkpoint(src: PathOrFile) -> Checkpoint:
    """Decode a whole checkpoint (plain or gzip) from a path or binary file."""
    with open_source(src) as s:
        dec = fdl.Decoder(s.stream, size=s.size, seekable=s.seekable, path=s.path)
        entries = {e.name: e.tensor for e in dec.entries()}
    return _checkpoint(dec, entries, s.path)


def read_verified(path: str | os.PathLike[str], size: int, crc32: int, *,
                  shared_buffer: bool = False, pin_memory: bool = False,
                  recorded_in: str = "metadata", framing: fdl.Framing = fdl.FDL,
                  fill: Callable[[Checkpoint], Pairs] | None = None) -> Checkpoint:
    """Decode ``path`` (plain or gzip), checking in the same pass that the file
    on disk has ``size`` bytes and CRC-32 ``crc32``, as recorded when it was
    written (``recorded_in`` names the record in errors: "metadata", "manifest").

    A mismatch raises :class:`FormatError` naming the file and what was
    expected: the file is corrupt, or is newer or older than its record (an
    overwrite that crashed between its renames). Every check is done before
    this returns, so a caller that copies out afterwards changes nothing when
    it raises. A file that does not decode raises FormatError as
    :func:`read_checkpoint` does.

    By default every entry is a tensor of its own. ``shared_buffer=True``
    (plain files; gzip ignores it) makes each entry a view, at whatever byte
    offset it has in the file (so not aligned), of one private mapping of
    the file, checked whole before this returns: the fastest way to copy a
    checkpoint into existing tensors, as :func:`snapsvc.restore` does; copy
    such entries out, do not keep them. ``pin_memory`` (with
    ``shared_buffer``) reads the file into one page-locked buffer instead, so
    copies to a CUDA device with ``non_blocking=True`` are direct DMA.
    ``framing``: the file's format (a data file: :data:`snapsvc.format.datafile.DATA`).

    ``fill(checkpoint)`` returns (entry, fresh tensor) pairs: when this
    returns, each fresh tensor holds its entry. Of a mapped file, ``fill``
    sees the entries before the check, and each piece of the file is copied
    into the fresh tensors just after it is checksummed (one read of memory,
    not two: :mod:`snapsvc.files.fused`); what ``fill`` raises on a file
    that fails its check gives way to the check's error. Only tensors that
    nothing else holds may be filled: a file that fails leaves them partly
    written.
    """
    path = os.fspath(path)
    if not (isinstance(size, int) and isinstance(crc32, int)):
        raise FormatError(f"the {recorded_in} records size {size!r} and crc32 {crc32!r}, "
                          "not integers", path=path)
    if shared_buffer and not pin_memory:
        mapped = _read_mapped(path, size, crc32, recorded_in, framing, fill)
        if mapped is not None:
            return mapped
    with open_source(path, checksum=True) as s:
        tap = s.tap
        assert tap is not None and s.file_size is not None
        _check_size(path, s.file_size, size, recorded_in)
        if shared_buffer and not s.gzip:
            return _filled(_read_shared(path, s.stream, tap, size, crc32, pin_memory,
                                        recorded_in, framing), fill)
        # not seekable: every byte is read
        dec = fdl.Decoder(s.stream, size=s.size, path=path, framing=framing)
        try:
            entries = {e.name: e.tensor for e in dec.entries()}
        except FormatError as e:
            tap.drain()  # a damaged file: say so, rather than what the damage broke
            _check_file(path, tap, size, crc32, recorded_in, cause=e)
            raise
        tap.drain()
        _check_file(path, tap, size, crc32, recorded_in)
    return _filled(_checkpoint(dec, entries, path), fill)


def _filled(ckpt: Checkpoint, fill: Callable[[Checkpoint], Pairs] | None) -> Checkpoint:
    """``ckpt`` (checked) with ``fill``'s fresh tensors copied into."""
    if fill is not None:
        for src, dst in fill(ckpt):
            dst.copy_(src)
    return ckpt


_NOT_ITS_FILE = ("or it is not the file its {} was written for (an overwrite that crashed between "
                 "its renames leaves a new file beside the old record); use an earlier checkpoint")


def _check_size(path: str, actual: int, size: int, recorded_in: str) -> None:
    if actual != size:
        how = "truncated" if actual < size else "longer than it was written"
        raise FormatError(f"the file has {actual} bytes but its {recorded_in} records {size}: "
                          f"it is {how}, " + _NOT_ITS_FILE.format(recorded_in), path=path)


def _check_file(path: str, seen: CrcReader | tuple[int, int], size: int, crc32: int,
                recorded_in: str, cause: FormatError | None = None) -> None:
    """Compare what was read of the whole file (a tap, or (size, CRC-32)) with the record."""
    seen_size, seen_crc = (seen.size, seen.crc32) if isinstance(seen, CrcReader) else seen
    _check_size(path, seen_size, size, recorded_in)  # it changed while being read
    if seen_crc != crc32:
        also = f"; decoding it failed too: {cause.reason}" if cause is not None else ""
        raise FormatError(f"CRC-32 {seen_crc:08x} but its {recorded_in} records {crc32:08x}: "
                          "the file is corrupt, " + _NOT_ITS_FILE.format(recorded_in) + also,
                          path=path)


def _file_buffer(size: int, pin_memory: bool) -> tuple[Any, memoryview]:
    """A writable buffer for a whole file, and a byte view of it.

    The buffer is what ``torch.frombuffer`` keeps alive. Pinned: a page-locked
    torch tensor, exported through a ctypes array that holds it. Otherwise an
    anonymous mmap, populated in one kernel call where the OS can (measured
    ~15 % off a 256 MiB read, against a page fault every 4 KiB while reading).
    """
    if pin_memory:
        pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        array = (ctypes.c_char * size).from_address(pinned.data_ptr())
        array._owner = pinned  # type: ignore[attr-defined]  # lives as long as its views
        return array, memoryview(array).cast("B")
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0) \
        | getattr(mmap, "MAP_POPULATE", 0)
    buf = mmap.mmap(-1, max(size, 1), flags=flags) if flags else mmap.mmap(-1, max(size, 1))
    return buf, memoryview(buf)[:size]


def _read_shared(path: str, stream: ReadStream, tap: CrcReader, size: int, crc32: int,
                 pin_memory: bool, recorded_in: str, framing: fdl.Framing) -> Checkpoint:
    """``read_verified(shared_buffer=True)`` of a plain file: read and check it
    whole, then decode the structure from memory."""
    buf, view = _file_buffer(size, pin_memory)
    done = 0
    while done < size:  # a large readinto goes past the stream's buffer, straight to the file
        n = stream.readinto(view[done:])
        if not n:
            break
        done += n
    tap.drain()
    _check_file(path, tap, size, crc32, recorded_in)
    return _entries_in(path, buf, view, size, framing)


_MADV_POPULATE_READ = 22  # Linux 5.14+; another OS may give 22 another meaning
_populates: bool | None = None  # whether this kernel has it: asked once


def _can_populate() -> bool:
    """Whether ``MADV_POPULATE_READ`` works here: it maps pages in one kernel
    call, reading from the disk any that must come from there, and reports
    a read error as an error of that call, not a SIGBUS on touching the page."""
    global _populates
    if _populates is None:
        _populates = False
        if sys.platform == "linux":
            probe = mmap.mmap(-1, mmap.PAGESIZE)
            try:
                probe.madvise(_MADV_POPULATE_READ)
                _populates = True
            except (OSError, AttributeError):  # before Linux 5.14: EINVAL
                pass
            finally:
                probe.close()
    return _populates


def _read_mapped(path: str, size: int, crc32: int, recorded_in: str,
                 framing: fdl.Framing,
                 fill: Callable[[Checkpoint], Pairs] | None = None) -> Checkpoint | None:
    """``read_verified(shared_buffer=True)`` of a plain file through a
    private mapping of it: the data is never copied into a buffer before it
    reaches its tensor, and there is no fresh buffer to fault in (measured
    here: 256 MiB checked and copied into a model in 0.3x the time of
    reading it into a fresh buffer first). None where the file is gzip,
    cannot be mapped, or its pages cannot all be mapped safely now: the
    caller reads it.

    A page touched in a mapping that must come from the disk would report a
    read error as SIGBUS, not as an exception: so each part of the file is
    mapped whole (:func:`_can_populate`) on the thread that checksums it,
    just before (measured here against the residency check it replaces,
    256 MiB checked and copied in ~0.85x the time); where the kernel cannot,
    only a file wholly in the page cache is mapped (:func:`_resident`), and
    a cold one is read. Private and writable, so
    ``torch.frombuffer`` takes it; nothing writes to it, so no page is
    copied. The check covers the file as it is now: the tensors then read
    the page cache, so a process rewriting the file in place meanwhile
    would change what is copied, and one truncating it would make the copy
    fault. snapsvc never does either (it replaces files by rename).
    """
    with open(path, "rb") as f:
        _check_size(path, os.fstat(f.fileno()).st_size, size, recorded_in)
        if not size or is_gzip_path(path) or f.read(2) == GZIP_MAGIC:
            return None
        try:
            buf = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError, AttributeError):  # a file system without mmap
            return None
        populate = _can_populate()
        if not populate and not _resident(buf, size):
            buf.close()
            return None
        if fill is not None:
            f.seek(0)
            return _read_filling(path, buf, f, size, crc32, recorded_in, framing, fill,
                                 populate)
    view = memoryview(buf)
    try:
        seen = crc32_of(view, (lambda at, n: buf.madvise(_MADV_POPULATE_READ, at, n))
                        if populate else None)
    except OSError:  # a page could not be read: the read path says why
        view.release()
        buf.close()
        return None
    _check_file(path, (size, seen), size, crc32, recorded_in)
    return _entries_in(path, buf, view, size, framing)


def _read_filling(path: str, buf: mmap.mmap, file: Any, size: int, crc32: int,
                  recorded_in: str, framing: fdl.Framing, fill: Callable[[Checkpoint], Pairs],
                  populate: bool) -> Checkpoint | None:
    """:func:`_read_mapped` with ``fill``: the entries are decoded from ``file``
    (the mapped file, read: headers only, the data skipped, so no page of the
    mapping is touched before it is mapped whole), ``fill`` names its pairs,
    then each part's pages are mapped (on its thread, as without ``fill``)
    and each piece checksummed and copied out at once."""
    view = memoryview(buf)
    try:
        ckpt = _entries_in(path, buf, view, size, framing, file)
        copier = PieceCopier(buf, size, fill(ckpt))
    except Exception as e:  # decoded from unchecked bytes: a bad file is the first thing to say
        _check_file(path, (size, _populated_crc(buf, view, populate)), size, crc32,
                    recorded_in, cause=e if isinstance(e, FormatError) else None)
        raise

    def before(at: int, n: int) -> None:
        if populate:
            buf.madvise(_MADV_POPULATE_READ, at, n)
        copier.populate(at, n)

    try:
        seen = crc32_of(view, before, copier)
    except OSError:  # a page could not be read: the read path says why (and fills anew)
        return None
    _check_file(path, (size, seen), size, crc32, recorded_in)
    copier.copy_rest()
    return ckpt


def _populated_crc(buf: mmap.mmap, view: memoryview, populate: bool) -> int:
    return crc32_of(view, (lambda at, n: buf.madvise(_MADV_POPULATE_READ, at, n))
                    if populate else None)


def _entries_in(path: str, buf: Any, view: memoryview, size: int,
                framing: fdl.Framing, file: Any = None) -> Checkpoint:
    """Decode a whole file held in ``buf``: each entry a view of it. The
    structure is read from ``view``, or from ``file`` (the same file, open)."""
    reader = MemoryReader(view) if file is None else file
    dec = fdl.Decoder(reader, size=size, seekable=True, path=path, framing=framing)
    entries: dict[str, torch.Tensor] = {}
    for e in dec.entries(load=False):  # bounds checked; data skipped by seeking
        numel = e.nbytes // e.dtype.itemsize
        if not numel:  # frombuffer refuses a count of 0
            entries[e.name] = torch.empty(e.shape, dtype=e.dtype)
            continue
        at = reader.tell() - e.nbytes  # the decoder has just skipped the data
        entries[e.name] = fdl.check_bools(
            torch.frombuffer(buf, dtype=e.dtype, count=numel, offset=at).view(e.shape),
            path=path, entry=e.name, offset=at)
    return _checkpoint(dec, entries, path)


def checkpoint_keys(src: PathOrFile) -> list[str]:
    """Entry names in file order, without loading data (plain files seek past it)."""
    with open_source(src) as s:
        dec = fdl.Decoder(s.stream, size=s.size, seekable=s.seekable, path=s.path)
        return [e.name for e in dec.entries(load=False)]


def checkpoint_version(src: PathOrFile) -> int:
    """The format version, from magic and version alone."""
    with open_source(src) as s:
        return fdl.Decoder(s.stream, size=s.size, path=s.path).read_version()


# -- load into a model ---------------------------------------------------------
@dataclass
class LoadReport:
    """Which entries were loaded, which the model lacks, which the file lacks.

    :func:`snapsvc.restore` also fills ``epoch``, ``metrics`` and ``extra``
    from the checkpoint's metadata. Restoring a nested state names paths in
    the state (``snapsvc.state``'s syntax) instead of entries, lists the
    objects it loaded in ``restored``, and puts the whole saved state, as
    :func:`snapsvc.load` returns it, in ``state`` (non-tensor values cannot
    be restored in place: read them there). Its tensors are views of the
    checked file's mapping, as ``torch.load(mmap=True)`` gives them: while the
    report or one of them lives, the mapping does (a RAM-tier copy's memory
    too, even once its sidecar dropped it); clone a tensor to keep it alone.
    """

    loaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    epoch: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    extra: Any = None
    restored: list[str] = field(default_factory=list)
    state: Any = None


def _where(ckpt: Checkpoint) -> str:
    return f"{ckpt.path}: " if ckpt.path else ""


def copy_problem(target: torch.Tensor, saved: torch.Tensor) -> str | None:
    """Why copying ``saved`` into the live ``target`` in place would fail, do
    nothing, or lose data; None when it is fine. Checked before anything changes."""
    if target.is_inference() and not torch.is_inference_mode_enabled():
        return ("an inference tensor (made under torch.inference_mode), which cannot be "
                "written outside it; restore into a tensor made outside inference mode")
    if target.is_meta:  # copy_ into it does nothing, silently
        return ("on the meta device, with no memory to restore into; materialize the "
                "model first (model.to_empty(device=...))")
    if torch._debug_has_internal_overlap(target) == 1:  # MemOverlap::Yes: copy_ refuses it
        return ("a view whose elements share memory (an expand()ed tensor); restore into "
                "a tensor with memory of its own (.clone())")
    if saved.is_complex() and not target.is_complex():  # copy_ drops the imaginary part
        return (f"a {str(target.dtype).removeprefix('torch.')} tensor, and the checkpoint's "
                f"is {str(saved.dtype).removeprefix('torch.')}: copying would drop the "
                "imaginary part; restore into a complex tensor")
    return None


def plan_load(ckpt: Checkpoint, model: nn.Module, *, structural_hash: HashLike = None,
              strict: bool = False) -> tuple[LoadReport, list[tuple[str, torch.Tensor]]]:
    """Check ``ckpt`` against ``model`` by flodl's rules (hash, shapes, ``strict``)
    and that every target can be written; nothing changes. Returns the report
    and the (name, live tensor) pairs to copy ``ckpt.entries[name]`` into."""
    expected = _hash_bytes(structural_hash if structural_hash is not None
                           else _structural_hash(model))
    if ckpt.structural_hash is not None and any(expected) \
            and bytes.fromhex(ckpt.structural_hash) != expected:
        raise ArchitectureMismatchError(
            f"{_where(ckpt)}architecture mismatch: file hash {ckpt.structural_hash}, "
            f"model hash {expected.hex()}; load into the architecture that saved it, "
            "or use migrate_checkpoint for renamed models")
    targets = dict(model_tensors(model))
    report = LoadReport()
    for name, t in ckpt.entries.items():
        target = targets.get(name)
        if target is None:
            report.skipped.append(name)
            continue
        if t.shape != target.shape:
            raise ShapeMismatchError(
                f"{_where(ckpt)}entry {name!r}: checkpoint shape {list(t.shape)} "
                f"but model shape {list(target.shape)}")
        problem = copy_problem(target, t)
        if problem:
            raise TargetNotWritableError(f"{_where(ckpt)}entry {name!r}: the model's tensor "
                                         f"is {problem}")
        report.loaded.append(name)
    report.missing = [n for n in targets if n not in ckpt.entries]
    if strict and (report.skipped or report.missing):
        raise StrictLoadError(
            f"{_where(ckpt)}strict load: {len(report.skipped)} entries not in the model "
            f"{report.skipped[:5]}, {len(report.missing)} model tensors not in the file "
            f"{report.missing[:5]}; pass strict=False to load the overlap")
    return report, [(name, targets[name]) for name in report.loaded]


def load_into(ckpt: Checkpoint, model: nn.Module, *, structural_hash: HashLike = None,
              strict: bool = False) -> LoadReport:
    """Apply flodl's loading rules for an already decoded checkpoint: everything
    checked (:func:`plan_load`), then copied."""
    report, copies = plan_load(ckpt, model, structural_hash=structural_hash, strict=strict)
    with torch.no_grad():  # in place: optimizers keep their references
        for name, target in copies:
            # from pinned memory (read_verified(pin_memory=True)) a copy to CUDA is async DMA
            target.copy_(ckpt.entries[name], non_blocking=target.is_cuda)
    # Done before returning: the source may be a buffer freed with ``ckpt``.
    for device in {target.device for _, target in copies if target.is_cuda}:
        torch.cuda.current_stream(device).synchronize()
    return report


def load_checkpoint(src: PathOrFile, model: nn.Module, *, structural_hash: HashLike = None,
                    strict: bool = False) -> LoadReport:
    """Load a checkpoint into ``model`` in place, following flodl's rules.

    ``structural_hash`` defaults to the model's own; a zero hash on either
    side skips the check. The file is fully decoded and checked (hash, shapes,
    ``strict``) before any model tensor changes.
    """
    return load_into(read_checkpoint(src), model, structural_hash=structural_hash,
                     strict=strict)

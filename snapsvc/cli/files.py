"""``snapsvc inspect``, ``snapsvc verify`` and ``snapsvc ls``: read checkpoints, change nothing.

Each takes a remote URL (``s3://``, ``gs://``, ``az://``) as well as a local path. A
local path the sidecar holds in RAM (:mod:`snapsvc.files.ramtier`) is read from its RAM
copy, once that is checked whole; a bad one is reported and the disk copy is read.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import warnings
from typing import Sequence

from ..errors import SnapsvcError
from ..files.checkpoint import file_framing
from ..files.convert import FileInfo, describe_file, file_format
from ..files.meta import META_SUFFIX, companions, data_owner, meta_path, optim_path, read_meta
from ..files.ramtier import good_copy, problem, ram_folder, read_first
from ..files.verify import VerifyReport
from ..format import fdl
from ..remote.fetch import fetched, verify
from ..remote.listing import list_checkpoints
from ..remote.store import is_url
from .core import EXIT_FAILURE, EXIT_OK, ProgressBar, _printable, human_bytes, register


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
        "data": _optimizer_summary(getattr(m, "data", None)),
    }, None


def _optimizer_summary(opt: object) -> dict | None:
    """The optimizer file's (or the data file's) description from the metadata, without
    the optimizer's state."""
    if not isinstance(opt, dict):
        return None
    return {k: opt[k] for k in ("class", "file", "entries", "size") if k in opt}


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


def _table(rows: Sequence[tuple[str, ...]], right: set[int]) -> list[str]:
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
            lines.append(f"  optimizer: {opt['class']}, {opt.get('entries')} entries in "
                         f"{opt.get('file')} ({opt['size']} bytes)")
        data = meta["data"]
        if data is not None:
            lines.append(f"  data file: {data['entries']} entries in {data['file']} "
                         f"({data['size']} bytes; inspect it for its entries)")
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
    ram = None
    if is_url(args.file):  # a checked local copy, shown under its URL
        with ProgressBar() as bar, fetched(args.file, progress=bar) as local:
            info, meta, meta_error = _describe(local)
        info.path = args.file
        if meta is not None:
            meta["path"] = meta_path(args.file)
    else:
        ram = good_copy(args.file)
        info, meta, meta_error = _describe(ram or args.file)
        if ram is not None:  # shown under its own path, as snapsvc.load reads it
            info.path = args.file
            if meta is not None:
                meta["path"] = meta_path(args.file)
    text = _inspect_json(info, meta, meta_error) if args.json \
        else _inspect_text(info, meta, meta_error)
    if ram is not None and not args.json:
        text += "\ntier: RAM (the sidecar's copy of this path, read in its place)"
    print(text)
    return EXIT_OK


def _describe(path: str) -> tuple[FileInfo, dict | None, str | None]:
    try:
        kind = file_format(path)
    except ValueError:
        kind = "fdl"  # snapsvc's own format needs no suffix; the decoder checks the magic
    info = describe_file(path, format=kind)
    if kind == "fdl" and file_framing(path) is not fdl.FDL:  # a checkpoint's data file
        info.format = "data"  # its checkpoint's .meta describes it
        return info, None, None
    return (info, *(_meta_summary(path) if kind == "fdl" else (None, None)))


# -- verify -------------------------------------------------------------------------
def _verify_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", metavar="FILE", nargs="+", help=".fdl or .fdl.gz checkpoints, or "
                   "step_<N> directories of multi-rank checkpoints")
    p.add_argument("--no-meta", action="store_true",
                   help="do not require <FILE>.meta (still checked when present)")


def _part_of(path: str) -> tuple[str, str] | None:
    """(checkpoint, role) when ``path`` is the metadata, the optimizer file or the
    data file written beside a checkpoint; None for a checkpoint (or anything else)."""
    if os.path.exists(meta_path(path)):
        return None  # it has metadata of its own: a checkpoint
    if path.endswith(META_SUFFIX):
        return path[: -len(META_SUFFIX)], "metadata"
    candidates = []
    head, sep, tail = path.rpartition(".optim")
    if sep and optim_path(head + tail) == path:
        candidates.append((head + tail, "optimizer file"))
    owner = data_owner(path)
    if owner is not None:
        candidates.append((owner, "data file"))
    for owner, role in candidates:
        if os.path.exists(owner) or os.path.exists(meta_path(owner)):
            return owner, role
    return None


def _is_step(path: str) -> bool:
    """Whether ``path`` is a multi-rank checkpoint: a step directory (a manifest in it, or
    named ``step_<N>``: one without is incomplete), or its manifest."""
    if not os.path.isdir(path) and not path.endswith(".msgpack"):
        return False
    from ..distributed.manifest import _STEP_RE, MANIFEST_NAME
    if os.path.isdir(path):
        return bool(_STEP_RE.match(os.path.basename(os.path.abspath(path)))) \
            or os.path.exists(os.path.join(path, MANIFEST_NAME))
    return os.path.basename(path) == MANIFEST_NAME


@register("verify", help="check checkpoints' structure, size and CRC-32",
          description="Check each checkpoint's structure and, from its <FILE>.meta, its size, "
          "CRC-32, entry count and hash, and those of its optimizer file. A .meta or "
          "optimizer file given on its own is checked as part of its checkpoint (so "
          "'verify checkpoints/*' works). A multi-rank checkpoint's step_<N> directory, or "
          "its manifest.msgpack, is checked as a whole: the manifest, and every rank's files "
          "against their metadata and the manifest (so 'verify step_<N>/*' works too). Prints one line per file (OK) or per problem; exits "
          "1 if any file fails.", arguments=_verify_arguments)
def _verify(args: argparse.Namespace) -> int:
    reports: dict[str, VerifyReport] = {}  # by checkpoint: each is read once
    given = set(args.files)
    failed = 0
    n = len(args.files)
    with ProgressBar(unit="files") as bar:
        for i, path in enumerate(args.files):
            bar(f"verifying {os.path.basename(path)}", i, n)
            if _is_step(path):
                from ..distributed.verify import verify_step  # torch.distributed when needed
                step = verify_step(path)
                reports.update((r.path, r) for r in step.ranks)
                bar.clear()
                print(step, flush=True)
                failed += not step.ok
                continue
            part = None if is_url(path) else _part_of(path)
            owner = path if part is None else part[0]
            first = owner not in reports
            if first:
                with ProgressBar() as fetching:  # a URL's bytes as they arrive
                    reports[owner] = _verify_first(owner, require_meta=not args.no_meta,
                                                   progress=fetching if is_url(owner) else None)
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


_verify_first = read_first(verify)   # the RAM copy of a local path first, then the disk


def _verify_part(path: str, role: str, report: VerifyReport, no_meta: bool
                 ) -> tuple[list[str], bool]:
    """The lines for a metadata or optimizer file whose checkpoint gave ``report``, and
    whether it passed. It passes with its checkpoint, when the checkpoint checked it."""
    owner = report.path
    if role in ("optimizer file", "data file"):
        if report.meta is None:
            if no_meta:  # no metadata vouches for it: check its structure on its own
                alone = verify(path, require_meta=False)
                return [str(alone)], alone.ok
        else:
            try:
                named = next((c.name for c in companions(owner, report.meta)
                              if c.role == role), None)
            except SnapsvcError:  # verify listed it among the checkpoint's problems
                named = None
            if named != os.path.basename(path):
                return [f"{path}: FAILED: not the {role} of {owner} (its metadata "
                        f"names {named or 'none'}): a leftover of an earlier write?"], False
    if report.ok:
        return [f"{path}: OK, checked as the {role} of {owner}"], True
    return [f"{path}: FAILED, checked as the {role} of {owner} (see its problems)"], False


# -- ls -----------------------------------------------------------------------------
def _ls_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("location", metavar="URL_OR_DIR", help="a checkpoint directory or a remote "
                   "URL (s3://bucket/prefix, gs://..., az://...)")
    p.add_argument("--remote", metavar="URL_OR_DIR", help="the remote tier of a local "
                   "directory: its checkpoints are listed beside the local ones")
    p.add_argument("--json", action="store_true", help="print one strict JSON object")


def _good_ram(rows: list, folder: str) -> list:
    """``rows`` without the RAM copies that fail their checks (each reported)."""
    kept = []
    for r in rows:
        why = problem(os.path.join(folder, r.name)) if "ram" in r.tiers else None
        if why is not None:
            warnings.warn(f"the RAM copy of {r.name} is bad ({why}): not listed",
                          RuntimeWarning, stacklevel=2)
            r.tiers.remove("ram")
        if r.tiers:
            kept.append(r)
    return kept


@register("ls", help="list checkpoints with step, size, metrics and the tiers holding them",
          description="List the complete checkpoints (those with a .meta) under a directory "
          "or a remote URL, newest step first: name, step, bytes, metrics and which tiers "
          "hold them (ram: the sidecar's copy in memory, local, remote; a bad RAM copy is "
          "reported and not listed). A multi-rank checkpoint (a step_<N> directory, or "
          "any directory with a manifest.msgpack) is one entry: its directory, with the "
          "manifest's step and metrics and the bytes of all its files. Incomplete ones (no "
          ".meta, or no manifest) are not listed. Then, for a directory, per multi-rank "
          "step (memory-only ones too), where each rank's file is held: own RAM, a peer's "
          "replica RAM, disk, remote (in the text output only when some file is not "
          "simply on disk).", arguments=_ls_arguments)
def _ls(args: argparse.Namespace) -> int:
    from ..distributed.tier import listed_steps  # torch.distributed when needed
    tiers = [("remote" if is_url(args.location) else "local", args.location)]
    folder = None if is_url(args.location) else ram_folder(args.location)
    if folder is not None:   # the RAM copies the sidecar holds for this directory
        tiers.insert(0, ("ram", folder))
    if args.remote:
        tiers.append(("remote", args.remote))
    with ProgressBar(unit="files") as bar:
        rows = list_checkpoints(tiers, steps=listed_steps, progress=bar)
    if folder is not None:
        rows = _good_ram(rows, folder)
    shards = _shards(args.location, rows)
    if args.json:
        print(json.dumps(_strict_json({"location": args.location, "remote": args.remote,
                                       "checkpoints": [r.__dict__ for r in rows],
                                       "shards": shards}),
                         allow_nan=False))
        return EXIT_OK
    table = [("name", "step", "size", "tiers", "metrics")]
    for r in rows:
        metrics = " ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in sorted(r.metrics.items()))
        table.append((_printable(r.name), "-" if r.step is None else str(r.step),
                      human_bytes(r.bytes), "+".join(r.tiers), _printable(metrics)))
    print("\n".join(_table(table, right={1, 2})) if rows else "no checkpoints")
    # only where some rank's file is not simply on disk (a RAM tier, replicas, a loss)
    if any(set(where) - {"disk", "remote"} or "disk" not in where
           for ranks in shards.values() for where in ranks):
        print("\nwhere each rank's file of a multi-rank step is held:")
        print("\n".join(_table([("step", "rank", "held")] + [
            (_printable(name), str(r), ", ".join(where) or "nowhere: lost")
            for name, ranks in shards.items() for r, where in enumerate(ranks)], right={1})))
    return EXIT_OK


def _shards(location: str, rows: list) -> dict[str, list[list[str]]]:
    """Per multi-rank step of a local directory (memory-only ones too), per rank, the
    places holding its file: own RAM, a peer's replica RAM, disk, remote."""
    if is_url(location):
        return {}
    from ..distributed.replicas import shard_places
    remote = {os.path.basename(os.path.normpath(r.name)) for r in rows if "remote" in r.tiers}
    return {name: [where + ["remote"] if name in remote else where for where in ranks]
            for name, ranks in shard_places(location)}

"""The peer checkpoint methods that benchmarks/stall.py compares snapsvc against.

Four methods behind one interface (:class:`Method`), fresh instances from
:func:`peer_methods`:

1. ``torch.save``       synchronous ``torch.save`` + fsync, on the caller.
2. ``thread-async``     Lightning's ``AsyncCheckpointIO`` recipe: clone every
                        tensor on the caller, ``torch.save`` + fsync in one
                        background thread.
3. ``dcp-process``      ``torch.distributed.checkpoint.async_save`` with
                        ``AsyncCheckpointerType.PROCESS`` and one reused
                        ``DefaultStager`` staging into shared memory, at world
                        size 1 on gloo (its best CPU setting).
4. ``torchsnapshot``    ``torchsnapshot.Snapshot.async_take`` (optional:
                        ``pip install torchsnapshot==0.1.0``, benchmark only).

Timing contract, the same for all four:

* ``setup`` is one-time and untimed (thread / stager / process start, plus a
  warm-up save where the method has caches to fill); its seconds are kept in
  ``method.setup_s`` (DCP's "time to first save").
* ``save`` is the stall: it returns when the training loop may mutate the
  model again.  A method that still has an earlier save in flight first waits
  for it (one checkpoint in flight at most, so memory stays bounded; for DCP
  this is required for correctness, see :class:`DcpProcessAsync`).
* ``wait_durable`` blocks until the last save is on disk and returns seconds
  from the start of that ``save`` to the moment it was durable.  "Durable"
  means every file fsynced and the directory entries that name them fsynced
  too, the same bar snapsvc's writer meets.

Self-test (builds 64 MiB of 16 MiB tensors and 4096 x 32 KiB tensors, saves
5 times with each method, loads every checkpoint back and compares it with
the model as it was at ``save``; also checks for leaked processes, fds and
/dev/shm entries)::

    python benchmarks/peers.py [--reps 5] [--models 64M small] [--dir .]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from snapsvc.files.durable import fsync_dir

__all__ = ["Method", "TorchSaveSync", "ThreadAsync", "DcpProcessAsync", "TorchSnapshotAsync",
           "TORCHSNAPSHOT_PIN", "peer_methods"]

WAIT_S = 600.0  # upper bound on every wait on a background save


@runtime_checkable
class Method(Protocol):
    name: str

    def setup(self, model: nn.Module, directory: str) -> None: ...  # one-time, not timed

    def save(self, model: nn.Module, step: int) -> None: ...  # timed; returns when the loop may go on

    def wait_durable(self) -> float: ...  # block until last save is on disk; seconds since its save() began

    def close(self) -> None: ...


# --------------------------------------------------------------------------- helpers

def _durable_torch_save(obj: object, path: str) -> float:
    """torch.save to a temp name, fsync, rename over ``path``, fsync the directory
    (a crash leaves the previous file at ``path`` or the new one, never a torn
    one).  Returns ``time.perf_counter()`` at the moment it is durable."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")
    return time.perf_counter()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- 1. torch.save

class TorchSaveSync:
    """``torch.save(model.state_dict())`` + fsync on the caller: stall == durable."""

    name = "torch.save"

    def __init__(self) -> None:
        self.setup_s = 0.0
        self._dir = ""
        self._last_s: float | None = None
        self.last_path: str | None = None

    def setup(self, model: nn.Module, directory: str) -> None:
        self._dir = directory

    def save(self, model: nn.Module, step: int) -> None:
        t0 = time.perf_counter()
        path = os.path.join(self._dir, f"torch_{step % 2}.pt")  # two names, reused
        done = _durable_torch_save(model.state_dict(), path)
        self._last_s = done - t0
        self.last_path = path

    def wait_durable(self) -> float:
        if self._last_s is None:
            raise RuntimeError("wait_durable() before any save()")
        return self._last_s

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- 2. thread async

class ThreadAsync:
    """Lightning's ``AsyncCheckpointIO``: a point-in-time clone on the caller,
    then ``torch.save`` + fsync in a single background thread.

    Lightning (lightning/pytorch/plugins/io/async_plugin.py, 2.5+) clones with
    ``apply_to_collection(ckpt, Tensor, lambda t: t.detach().clone())`` on the
    caller and submits the write to a ``ThreadPoolExecutor(max_workers=1)``.
    Here the clone is ``.detach().clone()`` on the model's device; this host is
    CPU-only, and on CUDA a CPU peer would use ``.detach().cpu()`` instead
    (Lightning itself clones on the GPU, which costs GPU memory, not a D2H copy).
    """

    name = "thread-async"

    def __init__(self) -> None:
        self.setup_s = 0.0
        self._dir = ""
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._t0 = 0.0
        self.last_path: str | None = None

    def setup(self, model: nn.Module, directory: str) -> None:
        t0 = time.perf_counter()
        self._dir = directory
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="peers-thread-async")
        self._pool.submit(lambda: None).result(timeout=WAIT_S)  # thread started
        self.setup_s = time.perf_counter() - t0

    def save(self, model: nn.Module, step: int) -> None:
        t0 = time.perf_counter()
        # One write in flight: wait for the previous one before cloning again.
        # NOTE Lightning itself does not block here: its max_workers=1 executor
        # just queues the next write (and its clone) behind the running one, so
        # memory grows with the backlog.  We block instead, to keep at most one
        # extra copy of the model alive; this only changes the stall when a
        # save is issued before the previous one is durable.
        if self._pending is not None:
            self._pending.result(timeout=WAIT_S)
        snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
        path = os.path.join(self._dir, f"thread_{step % 2}.pt")  # two names, reused
        assert self._pool is not None, "setup() first"
        self._pending = self._pool.submit(_durable_torch_save, snapshot, path)
        self._t0 = t0
        self.last_path = path

    def wait_durable(self) -> float:
        if self._pending is None:
            raise RuntimeError("wait_durable() before any save()")
        done = self._pending.result(timeout=WAIT_S)  # perf_counter() when durable
        return done - self._t0

    def close(self) -> None:
        if self._pool is not None:
            try:
                if self._pending is not None and not self._pending.done():
                    self._pending.result(timeout=WAIT_S)
            finally:
                self._pool.shutdown(wait=True)
                self._pool = None


# --------------------------------------------------------------------------- 3. DCP process

class DcpProcessAsync:
    """``dcp.async_save(..., async_checkpointer_type=PROCESS, async_stager=<reused
    DefaultStager on shared memory>)`` at world size 1 on gloo.

    API in torch 2.13 (torch/distributed/checkpoint/state_dict_saver.py,
    staging.py, _async_process_executor.py):

    * ``async_save(state_dict, *, checkpoint_id, storage_writer, planner,
      process_group, async_checkpointer_type=THREAD, async_stager=None,
      no_dist=False, use_collectives=True) -> Future | AsyncSaveResponse``.
      It stages on the caller (``async_stager.stage(sd)``), then hands the
      upload to a fresh one-thread executor.  If ``stage`` returned a Future
      (``use_async_staging=True``) the result is an ``AsyncSaveResponse`` with
      ``staging_completion`` (the local copy is done: the model may be
      mutated) and ``upload_completion`` (``dcp.save`` finished in the
      checkpoint process); otherwise it is the upload Future alone, and staging
      was already complete when ``async_save`` returned.
    * ``DefaultStager(StagingOptions(use_pinned_memory, use_shared_memory,
      use_async_staging, use_non_blocking_copy))``; all four default to True,
      and ``use_non_blocking_copy=True`` raises without an accelerator, pinned
      memory is ignored (with a warning) without CUDA.  The stager caches one
      staging storage per source storage (weakly keyed), so a reused stager
      copies into the same shared-memory buffers every save.
    * PROCESS: a module-global ``_CHECKPOINT_PROCESS`` (spawn context, daemon)
      is started lazily on the first ``async_save`` and serves every later one
      over a Pipe; it runs its own world-size-N gloo group on a fresh TCPStore
      port at ``$MASTER_ADDR``.  There is no public API to stop it: it is
      stopped by ``_AsyncCheckpointProcess.__del__`` (TERMINATE, join 5 s,
      SIGTERM) or at interpreter exit; ``close()`` here does the same
      explicitly, with timeouts.
    * The child writes with ``FileSystemWriter`` defaults (``sync_files=True``):
      each data file and the ``.metadata`` temp are fsynced, then ``.metadata``
      is renamed into place, but no directory is fsynced; ``wait_durable``
      fsyncs the checkpoint directory and its parent to finish the job.

    Stall (what ``save`` waits for) is defined as:
    1. the previous upload, if still running.  Required for correctness: the
       reused stager overwrites the same shared-memory buffers the checkpoint
       process may still be reading, which would tear the previous checkpoint
       (torchtitan also waits for the previous ``async_save`` future first);
    2. ``async_save`` returning, which with synchronous staging (the default
       here) means the copy into shared memory is done;
    3. with ``async_staging=True``, ``staging_completion`` too: the copy runs
       in the stager's thread, and until it finishes the model must not be
       mutated.  On CPU there is nothing to overlap it with inside ``save``,
       so synchronous staging is the better setting (no thread hop).

    Only one instance may be live per process (the checkpoint process is a
    module global); it is shut down by the instance that started it.
    """

    name = "dcp-process"

    def __init__(self, async_staging: bool = False) -> None:
        self.async_staging = async_staging
        self.setup_s = 0.0
        self._dir = ""
        self._stager = None
        self._upload: Future | None = None
        self._durable_at: list[float | None] = [None]
        self._durable_ev = threading.Event()
        self._t0 = 0.0
        self._seq = 0
        self._own_pg = False
        self._own_process = False
        self._set_master_addr = False
        self._old_nofile: tuple[int, int] | None = None
        self._dirs: list[str] = []  # checkpoint dirs, oldest first
        self.last_path: str | None = None

    def setup(self, model: nn.Module, directory: str) -> None:
        import torch.distributed as dist
        from torch.distributed.checkpoint import _async_process_executor as ape
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        t0 = time.perf_counter()
        self._dir = directory
        if "MASTER_ADDR" not in os.environ:  # the checkpoint process's TCPStore binds here
            os.environ["MASTER_ADDR"] = "127.0.0.1"
            self._set_master_addr = True
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}",
                                    rank=0, world_size=1, timeout=timedelta(seconds=120))
            self._own_pg = True
        self._own_process = ape._CHECKPOINT_PROCESS is None
        # Shared-memory staging under the default "file_descriptor" sharing
        # strategy keeps one open fd per staged storage, in this process and
        # again in the checkpoint process (which inherits this limit when it is
        # spawned below): 4096 tensors fail at the common soft limit of 1024
        # with "unable to open shared memory object ... Too many open files".
        # Raise the soft limit as a DCP user would have to (restored in close).
        need = 2 * len(model.state_dict()) + 1024
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < need:
            resource.setrlimit(resource.RLIMIT_NOFILE,
                               (need if hard == resource.RLIM_INFINITY else min(hard, need), hard))
            self._old_nofile = (soft, hard)
        self._stager = DefaultStager(StagingOptions(
            use_pinned_memory=False,  # needs CUDA
            use_shared_memory=True,  # staged storages go to the checkpoint process by fd, no copy
            use_async_staging=self.async_staging,
            use_non_blocking_copy=False,  # needs an accelerator
        ))
        # Warm-up: spawns the checkpoint process (and its gloo group) and
        # allocates the stager's shared-memory copy of this model, as a
        # training job's first checkpoint would.
        self.save(model, -1)
        self.wait_durable()
        self._prune(keep=0)
        self.setup_s = time.perf_counter() - t0

    def save(self, model: nn.Module, step: int) -> None:
        from torch.distributed.checkpoint import async_save
        from torch.distributed.checkpoint.state_dict_saver import (
            AsyncCheckpointerType, AsyncSaveResponse)

        t0 = time.perf_counter()
        if self._upload is not None:  # see class docstring, point 1
            self._upload.result(timeout=WAIT_S)
        self._seq += 1
        path = os.path.join(self._dir, f"dcp_{self._seq:05d}" + (f"_step{step}" if step >= 0 else "_warm"))
        # Nested under one key, as in DCP's own examples ({"model": model}):
        # async_save wraps every top-level key in a DEBUG-logging decorator
        # (the c10d logger is always at DEBUG: ~30 us per key), so a flat dict
        # of 4096 tensors pays for 4096 of them: async_save p50 233 ms flat vs
        # 98 ms nested on this 2-CPU host.
        resp = async_save({"model": model.state_dict()}, checkpoint_id=path,
                          async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                          async_stager=self._stager)
        if isinstance(resp, AsyncSaveResponse):
            resp.staging_completion.result(timeout=WAIT_S)  # point 3
            upload = resp.upload_completion
        else:
            upload = resp
        rec: list[float | None] = [None]
        ev = threading.Event()

        def _done(_f: Future, rec=rec, ev=ev) -> None:
            rec[0] = time.perf_counter()
            ev.set()

        upload.add_done_callback(_done)
        self._upload, self._durable_at, self._durable_ev, self._t0 = upload, rec, ev, t0
        self._dirs.append(path)
        self.last_path = path

    def wait_durable(self) -> float:
        if self._upload is None:
            raise RuntimeError("wait_durable() before any save()")
        if not self._durable_ev.wait(timeout=WAIT_S):
            raise TimeoutError(f"DCP upload not done after {WAIT_S:.0f} s")
        self._upload.result(timeout=0)  # raises the checkpoint process's error, if any
        t = time.perf_counter()
        fsync_dir(self.last_path)  # .metadata was renamed in here
        fsync_dir(self._dir)  # the checkpoint directory is new
        elapsed = self._durable_at[0] - self._t0 + (time.perf_counter() - t)
        self._prune(keep=1)  # untimed: delete older checkpoints
        return elapsed

    def _prune(self, keep: int) -> None:
        while len(self._dirs) > keep:
            shutil.rmtree(self._dirs.pop(0), ignore_errors=True)

    def close(self) -> None:
        import torch.distributed as dist
        from torch.distributed.checkpoint import _async_process_executor as ape

        try:
            if self._upload is not None and not self._upload.done():
                self._upload.result(timeout=WAIT_S)
        finally:
            self._upload = None
            if self._stager is not None:
                self._stager.close()  # shuts its staging thread, drops the shared-memory cache
                self._stager = None
            if self._own_process:
                _stop_checkpoint_process(ape)
                self._own_process = False
            if self._own_pg and dist.is_initialized():
                dist.destroy_process_group()
                self._own_pg = False
            if self._set_master_addr:
                os.environ.pop("MASTER_ADDR", None)
                self._set_master_addr = False
            if self._old_nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, self._old_nofile)
                self._old_nofile = None


# --------------------------------------------------------------------------- 4. torchsnapshot

TORCHSNAPSHOT_PIN = "torchsnapshot==0.1.0"  # its last PyPI release; runs on CPU with torch 2.13


class TorchSnapshotAsync:
    """torchsnapshot's ``Snapshot.async_take(path, {"model": model})``.

    ``async_take`` returns once it holds a consistent copy of the tensors
    (checked by the self-test: the model is mutated right after ``save``);
    the write goes on in its own thread. torchsnapshot does not fsync, so
    ``wait_durable`` fsyncs every file and directory of the snapshot (timed:
    the same bar as the others). Optional: ``pip install torchsnapshot==0.1.0``;
    ``setup`` raises ImportError without it.
    """

    name = "torchsnapshot"

    def __init__(self) -> None:
        self.setup_s = 0.0
        self._dir = ""
        self._pending = None  # torchsnapshot.snapshot.PendingSnapshot
        self._t0 = 0.0
        self._last_s: float | None = None
        self._seq = 0
        self._paths: list[str] = []
        self.last_path: str | None = None

    def setup(self, model: nn.Module, directory: str) -> None:
        import torchsnapshot  # noqa: F401 - ImportError: the caller skips this peer

        t0 = time.perf_counter()
        self._dir = directory
        self.save(model, -1)  # warm-up: its thread and event loop
        self.wait_durable()
        self._prune(keep=0)
        self.setup_s = time.perf_counter() - t0

    def save(self, model: nn.Module, step: int) -> None:
        from torchsnapshot import Snapshot

        t0 = time.perf_counter()
        self._finish()  # one in flight
        self._seq += 1
        path = os.path.join(self._dir, f"ts_{self._seq:05d}")
        self._pending = Snapshot.async_take(path=path, app_state={"model": model})
        self._t0, self._last_s = t0, None
        self._paths.append(path)
        self.last_path = path

    def _finish(self) -> None:
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        pending.wait()
        assert self.last_path is not None
        for root, dirs, files in os.walk(self.last_path, topdown=False):
            for name in files:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            fsync_dir(root)
        fsync_dir(self._dir)
        self._last_s = time.perf_counter() - self._t0

    def wait_durable(self) -> float:
        self._finish()
        if self._last_s is None:
            raise RuntimeError("wait_durable() before any save()")
        self._prune(keep=1)  # untimed: delete older snapshots
        return self._last_s

    def _prune(self, keep: int) -> None:
        while len(self._paths) > keep:
            shutil.rmtree(self._paths.pop(0), ignore_errors=True)

    def close(self) -> None:
        self._finish()


def _stop_checkpoint_process(ape, timeout: float = 30.0) -> None:
    """Stop DCP's module-global checkpoint process: TERMINATE over its pipe,
    then SIGTERM, then SIGKILL, each with a timeout; never hangs."""
    proc = ape._CHECKPOINT_PROCESS
    if proc is None:
        return
    ape._CHECKPOINT_PROCESS = None
    p = proc._save_process
    try:
        if p.is_alive():
            proc._send(ape._CheckpointSaveProcessControlOpts.TERMINATE)
            p.join(timeout)
    except (OSError, ValueError):
        pass
    if p.is_alive():
        p.terminate()
        p.join(5)
    if p.is_alive():
        p.kill()
        p.join(5)
    try:
        proc._process_pipe.close()
    except OSError:
        pass


def peer_methods() -> list[Method]:
    """Fresh instances of the peers, in the issue's order; torchsnapshot only
    where it is installed."""
    methods: list[Method] = [TorchSaveSync(), ThreadAsync(), DcpProcessAsync()]
    if importlib.util.find_spec("torchsnapshot") is not None:
        methods.append(TorchSnapshotAsync())
    return methods


# --------------------------------------------------------------------------- self-test

def _build_model(spec: str) -> nn.Module:
    """Same shapes as benchmarks/stall.py: ``<N>M`` is N MiB of 16 MiB float32
    tensors, ``small`` is 4096 tensors of 32 KiB."""
    if spec.startswith("small"):
        sizes = [(32 << 10) // 4] * (int(spec.split(":")[1]) if ":" in spec else 4096)
    else:
        total, large = int(spec[:-1]) << (20 if spec.endswith("M") else 30), 16 << 20
        sizes = [large // 4] * (total // large) + ([(total % large) // 4] if total % large else [])
    m = nn.Module()
    for i, n in enumerate(sizes):
        m.register_parameter(f"p{i}", nn.Parameter(torch.randn(n)))
    return m


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@torch.no_grad()
def _mutate(model: nn.Module, step: int) -> None:
    torch._foreach_add_([p for p in model.parameters()], float(step + 1))


def _load(method: Method, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    path = method.last_path  # type: ignore[attr-defined]
    if isinstance(method, DcpProcessAsync):
        import torch.distributed.checkpoint as dcp
        out = {k: torch.full_like(v, float("nan")) for k, v in like.items()}
        dcp.load({"model": out}, checkpoint_id=path)  # same nesting as save(); loads in place
        return out
    if isinstance(method, TorchSnapshotAsync):
        from torchsnapshot import Snapshot, StateDict
        holder = StateDict({k: torch.full_like(v, float("nan")) for k, v in like.items()})
        Snapshot(path=path).restore(app_state={"model": holder})
        return dict(holder)
    return torch.load(path, weights_only=True)


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> str | None:
    if got.keys() != want.keys():
        return f"keys differ: {sorted(set(got) ^ set(want))[:5]}"
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    return f"{len(bad)} tensors differ, e.g. {bad[:3]}" if bad else None


def _children() -> list[tuple[int, str]]:
    me, out = os.getpid(), []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) == me:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:100]
                out.append((int(pid), cmd))
        except (OSError, IndexError, ValueError):
            pass
    return out


def _fd_count() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # EMFILE itself
        return -1


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def _shm_maps() -> int:
    """Shared-memory mappings of this process: torch's fd-strategy segments are
    unlinked from /dev/shm at once, so only /proc/self/maps shows they are live."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "/dev/shm/" in line or "/torch_" in line)


def _self_test(specs: list[str], reps: int, base: str, dcp_async_staging: bool = False) -> int:
    torch.manual_seed(0)
    failures: list[str] = []
    rows = []
    before_children = {p for p, _ in _children()}
    before_shm, before_fds = _shm(), _fd_count()
    for spec in specs:
        model = _build_model(spec)
        mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        methods = peer_methods()
        if dcp_async_staging:
            methods = [DcpProcessAsync(async_staging=True) if isinstance(m, DcpProcessAsync) else m
                       for m in methods]
        for method in methods:
            d = tempfile.mkdtemp(dir=base, prefix=f"peers-selftest-{method.name}-")
            stall, durable, errs = [], [], []
            maps0, maps_open = _shm_maps(), 0
            child_fds = 0
            try:
                method.setup(model, d)
                # Phase A (timed): save, mutate at once (the loop going on),
                # wait durable, load back, compare with the state at save().
                for i in range(reps):
                    want = _snapshot(model)
                    t0 = time.perf_counter()
                    method.save(model, i)
                    stall.append(time.perf_counter() - t0)
                    _mutate(model, i)
                    durable.append(method.wait_durable())
                    if (e := _same(_load(method, want), want)) is not None:
                        errs.append(f"save {i}: {e}")
                # Phase B (untimed): back-to-back saves with no wait_durable in
                # between; save() must cope with a save still in flight.
                for i in range(reps, reps + 3):
                    want = _snapshot(model)
                    method.save(model, i)
                    _mutate(model, i)
                if isinstance(method, DcpProcessAsync):
                    from torch.distributed.checkpoint import _async_process_executor as ape
                    if ape._CHECKPOINT_PROCESS is not None:
                        child_fds = len(os.listdir(f"/proc/{ape._CHECKPOINT_PROCESS._save_process.pid}/fd"))
                method.wait_durable()
                if (e := _same(_load(method, want), want)) is not None:
                    errs.append(f"back-to-back: {e}")
            except Exception as e:  # report and go on to the next method
                errs.append(f"{type(e).__name__}: {e}")
            finally:
                fds_open, maps_open = _fd_count(), _shm_maps() - maps0
                t0 = time.perf_counter()
                try:
                    method.close()
                except Exception as e:
                    errs.append(f"close: {type(e).__name__}: {e}")
                close_s = time.perf_counter() - t0
                gc.collect()
                maps_closed = _shm_maps() - maps0
                left = sorted(os.listdir(d))
                shutil.rmtree(d, ignore_errors=True)
            if errs:
                failures += [f"{method.name} {spec}: {e}" for e in errs]
            row = dict(method=method.name, model=spec, mib=mib, tensors=len(list(model.parameters())),
                       setup_s=method.setup_s, close_s=close_s,  # type: ignore[attr-defined]
                       stall_p50=1e3 * statistics.median(stall) if stall else float("nan"),
                       stall_max=1e3 * max(stall) if stall else float("nan"),
                       durable_p50=1e3 * statistics.median(durable) if durable else float("nan"),
                       ok="OK" if not errs else "FAIL", fds=fds_open - before_fds, child_fds=child_fds,
                       maps_open=maps_open, maps_closed=maps_closed, left=len(left))
            rows.append(row)
            print(f"{row['method']:>12} {row['model']:>5} {row['tensors']:>5}x {row['mib']:5.0f} MiB | "
                  f"setup {row['setup_s']:5.2f} s | stall p50 {row['stall_p50']:6.1f} max "
                  f"{row['stall_max']:6.1f} ms | durable p50 {row['durable_p50']:7.1f} ms | {row['ok']} | "
                  f"open: fds +{row['fds']} child fds {row['child_fds']} shm maps {row['maps_open']} | "
                  f"after close {row['close_s']:.2f} s: shm maps {row['maps_closed']} | files {row['left']}",
                  flush=True)
            del method
        del methods
    gc.collect()
    time.sleep(0.5)
    new_children = [(p, c) for p, c in _children() if p not in before_children]
    new_shm = sorted(_shm() - before_shm)
    fds_after = _fd_count()
    print(f"# {time.strftime('%Y-%m-%d')} {os.cpu_count()} cpu, torch {torch.__version__}, reps={reps}")
    # Expected after a DCP run: multiprocessing's resource_tracker child (started
    # by the spawn, lives until this process exits) and 4 fds (gloo's pipe pair,
    # the tracker's pipe, multiprocessing.resource_sharer's listening socket).
    print(f"# after all closes: child processes {new_children or 'none'}; shm mappings here "
          f"{_shm_maps()}; new /dev/shm entries (any process on the host) {new_shm or 'none'}; "
          f"open fds {before_fds} -> {fds_after}")
    for f in failures:
        print("FAIL", f)
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="self-test the peer checkpoint methods")
    ap.add_argument("--models", nargs="+", default=["64M", "small"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=".", help="where the temp checkpoint dirs go")
    ap.add_argument("--dcp-async-staging", action="store_true",
                    help="DCP with use_async_staging=True (save() then waits on staging_completion)")
    args = ap.parse_args(argv)
    return _self_test(args.models, args.reps, args.dir, args.dcp_async_staging)


if __name__ == "__main__":
    sys.exit(main())

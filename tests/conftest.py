import pytest
import torch
from torch import nn


class Net(nn.Module):
    """Parameters, a persistent buffer, a non-persistent buffer and a nested block."""

    def __init__(self, hidden: int = 4) -> None:
        super().__init__()
        self.encoder = nn.Linear(3, hidden)
        self.norm = nn.BatchNorm1d(hidden)
        self.head = nn.Linear(hidden, 2)
        self.register_buffer("scratch", torch.zeros(5), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.encoder(x))))


@pytest.fixture
def net() -> Net:
    torch.manual_seed(0)
    m = Net()
    m.norm.running_mean.uniform_()
    m.norm.num_batches_tracked.fill_(7)
    return m


# -- leak checks for tests that spawn the sidecar -------------------------------
import contextlib  # noqa: E402
import gc  # noqa: E402
import hashlib  # noqa: E402
import os  # noqa: E402
from typing import Iterator  # noqa: E402


# What torch's shared memory and snapsvc could leave. Other processes on the
# machine (a parallel test run, multiprocessing's named semaphores "sem.mp-*")
# come and go in /dev/shm too, and must not fail these tests.
_OURS = ("torch_", "psm_", "snapsvc")


def _shm_entries(pids: tuple[int, ...] = ()) -> set[str]:
    """What snapsvc and torch's shared memory left in /dev/shm that this process (or the
    processes ``pids``) could have made."""
    # torch names its segments torch_<creator pid>_...: count only ours, so a test run
    # or a helper beside this one cannot fail it.
    mine = tuple(f"torch_{pid}_" for pid in (os.getpid(), *pids))
    found = {e for e in os.listdir("/dev/shm") if e.startswith(_OURS)
             and (not e.startswith("torch_") or e.startswith(mine))}
    # the RAM tier's per-user root is shared by every writer of the user (other
    # tests' included): count the per-directory folders inside it, not the root
    ram = f"snapsvc-{os.getuid()}"
    if ram in found:
        found.discard(ram)
        try:
            found |= {f"{ram}/{e}" for e in os.listdir(f"/dev/shm/{ram}")}
        except FileNotFoundError:   # removed meanwhile by the last writer using it
            pass
    return found


def shm_leaked(before: set[str], top: str, pids: tuple[int, ...] = ()) -> set[str]:
    """The entries of :func:`_shm_entries` new since ``before``. The RAM tier's root is
    shared by every writer of the user (the other xdist worker's included), so a new
    folder in it counts only when it belongs to a directory under ``top`` (the test's
    ``tmp_path``)."""
    ram = f"snapsvc-{os.getuid()}/"
    leaked = _shm_entries(pids) - before
    if any(e.startswith(ram) for e in leaked):
        ours = _ram_folders_under(top)
        leaked = {e for e in leaked if not e.startswith(ram) or e in ours}
    return leaked


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def sidecar_children() -> list[int]:
    """Pids of this process's children that run a snapsvc writer sidecar."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (ValueError, OSError):  # not a process, or gone meanwhile
            continue
        if ppid == os.getpid() and b"from snapsvc.sidecar.worker import boot" in cmdline:
            pids.append(int(entry))
    return pids


@pytest.fixture(scope="session")
def _warm_sidecar(tmp_path_factory):
    """Start and close one writer, so process-wide helpers that live for the
    whole session (multiprocessing's resource_sharer listener and resource
    tracker) exist before any leak is counted."""
    import snapsvc
    with snapsvc.SnapshotWriter(tmp_path_factory.mktemp("warm")) as w:
        w.submit(nn.Linear(2, 2), "warm.fdl").result(timeout=60)


def _ram_folders_under(top: str) -> set[str]:
    """The RAM tier's folder names (a hash of a checkpoint directory) that directories
    under ``top`` would have: what this test's writers may leave in the shared root."""
    ram = f"snapsvc-{os.getuid()}"
    return {f"{ram}/{hashlib.sha256(d.encode()).hexdigest()[:16]}"
            for d, _, _ in os.walk(top)}


@contextlib.contextmanager
def leak_checked(top: str) -> Iterator[None]:
    """Fail if the block leaves /dev/shm entries (:func:`shm_leaked`, ``top`` the block's
    directory) or open fds behind: :func:`no_leaks` for a test, and for a module fixture's work."""
    gc.collect()
    shm, fds = _shm_entries(), _open_fds()
    yield
    gc.collect()
    leaked_shm = shm_leaked(shm, top)
    leaked_fds = {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in _open_fds() - fds
                  if os.path.exists(f"/proc/self/fd/{fd}")}
    assert not leaked_shm, f"/dev/shm entries leaked: {sorted(leaked_shm)}"
    assert not leaked_fds, f"file descriptors leaked: {leaked_fds}"


@pytest.fixture
def no_leaks(_warm_sidecar, tmp_path):
    """Fail the test if it leaves /dev/shm entries (:func:`shm_leaked`) or open fds behind."""
    with leak_checked(str(tmp_path)):
        yield


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA: skip them on machines without it. Then the order
    the two xdist workers share the suite in (:func:`_schedule`)."""
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    _schedule(items)


def _budget(item: pytest.Item) -> float:
    """The timeout a test declares, 0 without one: every test that spawns a process has
    one (the developers' guide), and the longer it is, the longer the test is expected to run."""
    mark = item.get_closest_marker("timeout")
    if mark is None:
        return 0.0
    return float(mark.args[0] if mark.args else mark.kwargs.get("timeout", 0))


def _schedule(items: list[pytest.Item]) -> None:
    """The test files, the longest first.

    ``-n 2`` runs with ``--dist loadfile --no-loadscope-reorder`` (pyproject.toml): xdist
    hands each worker a whole file at a time, in this order, so a module fixture (a spawned
    world, a written checkpoint) is built by one worker, not both. First the files with a
    test that declares more than a minute (:func:`_budget`: trainer runs, spawned worlds),
    the longest declared first; then the in-process files, the biggest first, so the last
    ones are small and fill the gaps: neither worker is left alone at the end with a long
    file. The same order with ``-n 0``; the tests of a file keep theirs."""
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)

    def weight(tests: list[pytest.Item]) -> tuple:
        longest = max(map(_budget, tests))
        if longest > 60:
            return (0, -longest, -sum(map(_budget, tests)))
        return (1, -len(tests))

    items[:] = [item for f in sorted(files.values(), key=weight) for item in f]


@pytest.fixture
def world1(tmp_path):
    """torch.distributed in this process: one gloo rank (for the tests of the distributed
    writer, DCP and the RAM tier's collectives)."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _sigint_deliverable() -> Iterator[None]:
    """SIGINT deliverable in this process's main thread before and after each test: not
    blocked, and Python's own handler. In a full run something in-process left it
    ignored or blocked in both workers, and from then on every Ctrl-C test hung or saw no
    KeyboardInterrupt (the trainers the tests start inherit both). It is put back with a
    warning, so the culprit shows in the warnings summary."""
    _unblock_sigint("before this test")
    yield
    _unblock_sigint("by this test's code")


def _unblock_sigint(when: str) -> None:
    import signal
    import threading
    import warnings
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
        warnings.warn(f"SIGINT was left blocked in the main thread {when}; unblocked",
                      RuntimeWarning)
    # ignored (SIG_IGN is inherited by the trainers a test starts, across exec) or
    # another handler: a Ctrl-C test then never sees its KeyboardInterrupt
    handler = signal.getsignal(signal.SIGINT)
    if handler is not signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        warnings.warn(f"SIGINT's handler was left as {handler!r} {when}; put back",
                      RuntimeWarning)

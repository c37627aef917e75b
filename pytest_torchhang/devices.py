"""GPU and CPU markers, CUDA-safe GPU detection, GPU leases under pytest-xdist, fake GPUs."""

from __future__ import annotations

import ast
import contextlib
import fcntl
import importlib.metadata
import importlib.util
import math
import operator
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from . import settings

GPU_MARKER = "gpu"
CPU_MARKER = "cpu"
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
#: Testing aid: report this many GPUs and touch neither CUDA nor the driver.
FAKE_GPUS_ENV = "PYTEST_TORCH_HANG_FAKE_GPUS"
LEASE_TIMEOUT_INI = "torch_hang_gpu_lease_timeout"
LEASE_TIMEOUT_ENV = "PYTEST_TORCH_HANG_GPU_LEASE_TIMEOUT"
#: A test waits this long for GPUs held by other tests before it errors. Tests that hold GPUs
#: are themselves bounded by --torch-hang-timeout, so a long wait is contention, not a hang.
DEFAULT_LEASE_TIMEOUT_S = 300.0
#: Key of the lease directory in an xdist worker's ``workerinput``.
LEASE_DIR_KEY = "torch_hang_gpu_lease_dir"
PROC_NVIDIA_GPUS = "/proc/driver/nvidia/gpus"
NVIDIA_SMI_TIMEOUT_S = 10.0
_POLL_S = 0.05

_GPU_HELP = (
    f"{GPU_MARKER}(count=1): the test needs count CUDA GPUs of its own; skipped where fewer are "
    f"visible, otherwise leased exclusively for the test and named in {CUDA_VISIBLE_DEVICES} "
    "for its process tree (pytest-torchhang)"
)
_CPU_HELP = (
    f"{CPU_MARKER}: the test must not touch a GPU; CUDA is hidden from it and its child "
    f'processes ({CUDA_VISIBLE_DEVICES}="") so a stray .cuda() fails fast (pytest-torchhang)'
)


# --- what torch was built with, read without importing torch -------------------------------


@dataclass(frozen=True)
class TorchBuild:
    """The installed torch, as far as can be told without importing it (the import costs ~3 s)."""

    version: str | None  # None: torch is not installed
    cuda: str | None  # CUDA version torch was built with; None for a CPU-only or ROCm build
    hip: str | None
    known: bool  # False when the build could not be read: then assume it can use GPUs

    @property
    def supports_gpus(self) -> bool:
        return not self.known or self.cuda is not None or self.hip is not None


def torch_build() -> TorchBuild:
    """Read torch's version and CUDA build from its metadata and ``torch/version.py``."""
    torch_mod = sys.modules.get("torch")
    version_mod = getattr(torch_mod, "version", None)
    if version_mod is not None:  # already imported by someone else: free to ask
        return TorchBuild(
            str(getattr(torch_mod, "__version__", "")) or None,
            getattr(version_mod, "cuda", None),
            getattr(version_mod, "hip", None),
            known=True,
        )
    try:
        version: str | None = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        version = None
    try:
        # find_spec of a top-level package locates it without running its __init__.
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return TorchBuild(version, None, None, known=False)
    fields = _version_py_fields(os.path.join(spec.submodule_search_locations[0], "version.py"))
    if fields is None or "cuda" not in fields:
        return TorchBuild(version, None, None, known=False)
    return TorchBuild(version, fields.get("cuda"), fields.get("hip"), known=True)


def _version_py_fields(path: str) -> dict[str, str | None] | None:
    try:
        with open(path, encoding="utf-8") as source:
            text = source.read()
    except OSError:
        return None
    fields: dict[str, str | None] = {}
    for name, value in re.findall(r"^(cuda|hip)\s*(?::[^=\n]*)?=\s*(.+)$", text, re.MULTILINE):
        try:
            parsed = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            continue
        fields[name] = str(parsed) if parsed is not None else None
    return fields


# --- GPU detection without initialising CUDA -----------------------------------------------


@dataclass(frozen=True)
class GpuInventory:
    """The GPUs this session may hand to tests, found without initialising CUDA."""

    devices: tuple[str, ...]  # the CUDA_VISIBLE_DEVICES entry of each usable GPU, in CUDA order
    source: str  # where the count came from, for the report header and skip reasons
    note: str = ""  # why GPUs that are present cannot be used, or ""
    fake: bool = False

    @property
    def count(self) -> int:
        return len(self.devices)

    def describe(self) -> str:
        return self.note or self.source


def fake_gpu_count(environ: Mapping[str, str]) -> int | None:
    """``PYTEST_TORCH_HANG_FAKE_GPUS`` as a count, None when unset; usage error when invalid."""
    raw = environ.get(FAKE_GPUS_ENV, "").strip()
    if raw == "":
        return None
    try:
        count = int(raw, 10)
    except ValueError:
        count = -1
    if count < 0:
        raise pytest.UsageError(
            f"environment variable {FAKE_GPUS_ENV} must be a whole number of fake GPUs >= 0, "
            f"got {environ[FAKE_GPUS_ENV]!r}; unset it to detect real GPUs"
        )
    return count


def _strtoul(entry: str) -> int:
    """The leading integer of ``entry`` as CUDA's strtoul-like parser reads it, or -1."""
    match = re.match(r"[+-]?\d+", entry)
    return int(match.group()) if match else -1


def visible_devices(
    cuda_visible_devices: str | None, physical: int, uuids: Sequence[str] = ()
) -> tuple[str, ...]:
    """Which GPUs CUDA would expose, as ``CUDA_VISIBLE_DEVICES`` entries in CUDA's order.

    Mirrors CUDA's (and ``torch.cuda._parse_visible_devices``') reading of the variable: entries
    up to the first invalid one count; a repeated entry hides every device; ``""`` hides all.
    ``uuids`` are the driver's GPU UUIDs, when known, to check ``GPU-...`` entries against.
    """
    if physical <= 0:
        return ()
    if cuda_visible_devices is None:
        return tuple(str(index) for index in range(physical))
    entries = [entry.strip() for entry in cuda_visible_devices.split(",")]
    if entries[0].startswith(("GPU-", "MIG-")):
        prefix = entries[0][:4]
        named: list[str] = []
        for entry in entries:
            if entry in named:
                return ()
            if not entry.startswith(prefix):
                break
            if prefix == "GPU-" and uuids and not any(u.startswith(entry) for u in uuids):
                break
            named.append(entry)
        return tuple(named[:physical] if prefix == "GPU-" else named)
    ordinals: list[int] = []
    for entry in entries:
        ordinal = _strtoul(entry)
        if ordinal in ordinals:
            return ()
        if ordinal < 0 or ordinal >= physical:
            break
        ordinals.append(ordinal)
    return tuple(str(ordinal) for ordinal in ordinals)


def _physical_gpus(proc_dir: str = PROC_NVIDIA_GPUS) -> tuple[int, tuple[str, ...], str]:
    """(count, UUIDs if known, source) of the NVIDIA GPUs on this machine; never touches CUDA."""
    with contextlib.suppress(OSError):
        # One directory per GPU the driver exposes to this container; no process is started.
        return len(os.listdir(proc_dir)), (), proc_dir
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0, (), "no NVIDIA driver found"
    try:
        # nvidia-smi talks to the driver through NVML, which does not create a CUDA context.
        proc = subprocess.Popen(
            [smi, "-L"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    except OSError as exc:
        return 0, (), f"nvidia-smi -L could not run: {exc}"
    try:
        out, _ = proc.communicate(timeout=NVIDIA_SMI_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(1.0)  # a driver-wedged nvidia-smi may not even die: do not wait for it
        return 0, (), f"nvidia-smi -L did not answer within {NVIDIA_SMI_TIMEOUT_S:g}s"
    if proc.returncode != 0:
        first = out.strip().splitlines()[0] if out.strip() else f"exit code {proc.returncode}"
        return 0, (), f"nvidia-smi -L failed: {first}"
    gpus = re.findall(r"^GPU \d+:.*?(?:\(UUID: (GPU-[^)\s]+)\))?\s*$", out, re.MULTILINE)
    return len(gpus), tuple(u for u in gpus if u), "nvidia-smi -L"


def detect_gpus(environ: Mapping[str, str] | None = None) -> GpuInventory:
    """Find the GPUs tests may use, without initialising CUDA or importing torch.

    ``PYTEST_TORCH_HANG_FAKE_GPUS=N`` overrides detection entirely (a testing aid). Otherwise
    GPUs are counted from ``/proc/driver/nvidia/gpus`` or ``nvidia-smi -L``, filtered through
    ``CUDA_VISIBLE_DEVICES``, and none count when the installed torch is a CPU-only build.
    """
    env = os.environ if environ is None else environ
    fake = fake_gpu_count(env)
    if fake is not None:
        return GpuInventory(
            tuple(str(i) for i in range(fake)), f"fake: {FAKE_GPUS_ENV}={fake}", fake=True
        )
    physical, uuids, source = _physical_gpus()
    cvd = env.get(CUDA_VISIBLE_DEVICES)
    devices = visible_devices(cvd, physical, uuids)
    if cvd is not None and physical:
        source = f"{source}, {CUDA_VISIBLE_DEVICES}={cvd!r}"
    build = torch_build()
    if devices and not build.supports_gpus:
        note = f"{len(devices)} present, but torch {build.version} is a CPU-only build"
        return GpuInventory((), source, note=note)
    return GpuInventory(devices, source)


# --- markers ------------------------------------------------------------------------------


class MarkerError(ValueError):
    """A ``gpu`` or ``cpu`` marker with arguments that make no sense; a collection error."""


def requested_gpus(item: pytest.Item) -> int | None:
    """GPUs the test's markers ask for: n for ``gpu(n)``, 0 for ``cpu``, None for neither.

    Raises ``MarkerError`` naming the test and the marker when the arguments are invalid.
    """
    gpu = item.get_closest_marker(GPU_MARKER)
    cpu = item.get_closest_marker(CPU_MARKER)
    if cpu is not None:
        where = f"@pytest.mark.{CPU_MARKER} on {item.nodeid}"
        if cpu.args or cpu.kwargs:
            raise MarkerError(
                f"{where}: takes no arguments, got args={cpu.args!r} kwargs={cpu.kwargs!r}"
            )
        if gpu is not None:
            raise MarkerError(
                f"{where}: a test cannot be marked both {CPU_MARKER} and {GPU_MARKER}; keep one"
            )
        return 0
    if gpu is None:
        return None
    where = f"@pytest.mark.{GPU_MARKER} on {item.nodeid}"
    args, kwargs = gpu.args, gpu.kwargs
    if len(args) > 1 or set(kwargs) - {"count"} or (args and "count" in kwargs):
        raise MarkerError(
            f"{where}: takes one argument, gpu(count=1), got args={args!r} kwargs={kwargs!r}"
        )
    value: Any = args[0] if args else kwargs.get("count", 1)
    try:
        count = -1 if isinstance(value, bool) else operator.index(value)
    except TypeError:
        count = -1
    if count < 1:
        raise MarkerError(
            f"{where}: count must be a whole number of GPUs >= 1, got {value!r}; "
            f"use @pytest.mark.{CPU_MARKER} for a test that needs no GPU"
        )
    return count


def skip_reason(needed: int, inventory: GpuInventory) -> str | None:
    """Why a ``gpu(needed)`` test cannot run here, or None when it can."""
    if needed <= inventory.count:
        return None
    unit = "GPU" if needed == 1 else "GPUs"
    return f"needs {needed} CUDA {unit}, found {inventory.count} ({inventory.describe()})"


# --- leases: one GPU, one test at a time, across the session's processes ------------------


class LeaseTimeout(Exception):
    """A test waited its bounded time for GPUs that other tests kept holding."""


@dataclass
class GpuLease:
    """GPUs held by one test: an exclusive ``flock`` on one file per GPU index."""

    indices: tuple[int, ...]
    waited_s: float
    _fds: list[int] = field(default_factory=list, repr=False)
    devices: tuple[str, ...] = ()  # their CUDA_VISIBLE_DEVICES entries, set by the plugin

    def release(self) -> None:
        """Give the GPUs back (idempotent)."""
        for fd in self._fds:
            # Unlock explicitly: a forked child of the test may still hold a copy of the fd.
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()


def _open_lock(path: str) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _write_holder(fd: int, text: str) -> None:
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, text.encode("utf-8", "replace"), 0)


def _read_holder(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as held:
            return held.read().strip() or "unknown holder"
    except OSError:
        return "unknown holder"


class GpuLeaser:
    """Leases GPU indices through lock files in a directory shared by the session's processes.

    A request first takes ``queue.lock``, then waits there until ``count`` GPUs are free at once
    and locks them all; holding nothing while it waits for the queue, and everything or nothing
    of the GPUs, it can neither deadlock nor be starved by a stream of smaller requests. Locks
    die with their process, so a crashed xdist worker (and its replacement, gw5 after gw0..gw3)
    leaves nothing stale.
    """

    def __init__(self, lock_dir: str) -> None:
        self.lock_dir = lock_dir

    def _path(self, name: str) -> str:
        return os.path.join(self.lock_dir, name)

    def acquire(
        self,
        count: int,
        total: int,
        timeout_s: float,
        holder: str,
        candidates: Sequence[int] | None = None,
    ) -> GpuLease:
        """Lock ``count`` of the GPUs ``0..total-1``; ``LeaseTimeout`` after ``timeout_s``.

        ``candidates`` are the indices to take, in order of preference (default: all).
        """
        order = list(range(total)) if candidates is None else list(candidates)
        if not 1 <= count <= len(order) or not all(0 <= i < total for i in order):
            raise ValueError(f"cannot lease {count} of GPUs {order} (of {total})")
        os.makedirs(self.lock_dir, mode=0o700, exist_ok=True)
        started = time.monotonic()
        deadline = started + timeout_s
        queue_fd = _open_lock(self._path("queue.lock"))
        try:
            while not _try_lock(queue_fd):
                if time.monotonic() >= deadline:
                    raise LeaseTimeout(
                        self._timeout_text(count, order, total, timeout_s)
                        + f"; queued behind {_read_holder(self._path('queue.lock'))}"
                    )
                _pause()
            _write_holder(queue_fd, f"{holder}, which waits for {count} GPU(s)")
            while True:
                lease = self._try_gpus(count, order, holder)
                if lease is not None:
                    lease.waited_s = time.monotonic() - started
                    return lease
                if time.monotonic() >= deadline:
                    busy = [
                        f"GPU {i} held by {_read_holder(self._path(f'gpu-{i}.lock'))}"
                        for i in order
                        if self._is_busy(i)
                    ]
                    held = "; ".join(busy) or "the GPUs came free too late"
                    raise LeaseTimeout(
                        f"{self._timeout_text(count, order, total, timeout_s)}; {held}"
                    )
                _pause()
        finally:
            os.close(queue_fd)  # closing releases the queue for the next request

    def _try_gpus(self, count: int, order: Sequence[int], holder: str) -> GpuLease | None:
        taken: list[tuple[int, int]] = []
        for index in order:
            fd = _open_lock(self._path(f"gpu-{index}.lock"))
            if _try_lock(fd):
                taken.append((index, fd))
                if len(taken) == count:
                    break
            else:
                os.close(fd)
        taken.sort()  # preference decides which GPUs; cuda:0 is still the lowest of them
        lease = GpuLease(tuple(i for i, _ in taken), 0.0, [fd for _, fd in taken])
        if len(taken) < count:
            lease.release()  # all or nothing: holding some while waiting could deadlock
            return None
        for _, fd in taken:
            _write_holder(fd, holder)
        return lease

    def _is_busy(self, index: int) -> bool:
        fd = _open_lock(self._path(f"gpu-{index}.lock"))
        try:
            return not _try_lock(fd)
        finally:
            os.close(fd)

    @staticmethod
    def _timeout_text(count: int, order: Sequence[int], total: int, timeout_s: float) -> str:
        of = f"{total} GPUs" if len(order) == total else f"GPUs {','.join(map(str, order))}"
        return (
            f"gave up waiting for {count} of {of} after {timeout_s:g}s "
            f"({LEASE_TIMEOUT_INI} / {LEASE_TIMEOUT_ENV}; other tests kept them busy)"
        )


def _pause() -> None:
    # Jitter keeps workers that poll together from colliding in step.
    time.sleep(_POLL_S * (1.0 + random.random()))


def lease_timeout(config: pytest.Config) -> float:
    """Seconds a test may wait for GPUs: ini < env, default 300; usage error when invalid."""
    timeout: object = DEFAULT_LEASE_TIMEOUT_S
    source = ""
    with contextlib.suppress(ValueError):  # ValueError: the ini key is not registered
        ini_value = config.getini(LEASE_TIMEOUT_INI)
        if ini_value not in ("", None):
            timeout, source = ini_value, f"ini option {LEASE_TIMEOUT_INI}"
    env_value = os.environ.get(LEASE_TIMEOUT_ENV, "")
    if env_value.strip():
        timeout, source = env_value, f"environment variable {LEASE_TIMEOUT_ENV}"
    seconds = settings.seconds_or_nan(timeout)
    if not math.isfinite(seconds) or seconds < 0:
        raise pytest.UsageError(
            f"{source} must be a finite number of seconds >= 0 that a gpu test may wait for "
            f"GPUs held by other tests, got {timeout!r}"
        )
    return seconds


# --- the pytest side ----------------------------------------------------------------------

_REQUEST = pytest.StashKey[int | None]()  # what requested_gpus() said
_LEASE = pytest.StashKey[GpuLease]()
_SETUP_ERROR = pytest.StashKey[str]()  # the test errors at setup with this message
_GPUS_PROPERTY = "torch_hang_gpus"
_WAIT_PROPERTY = "torch_hang_gpu_wait_s"


def leased_gpus(item: pytest.Item) -> list[int] | None:
    """The GPUs leased to ``item`` while it runs, None when it has no ``gpu`` marker.

    Indices count the session's visible GPUs (0 is the first GPU pytest itself could see). From
    setup through teardown ``CUDA_VISIBLE_DEVICES`` names exactly these GPUs, in this order, so
    the test and its children see them as ``cuda:0`` .. ``cuda:n-1``: rank ``r`` of a
    distributed test belongs on ``cuda:r``, or on ``leased_devices(item)[r]`` alone. Empty while
    the test holds no lease (before setup, after teardown, or when it was skipped).
    """
    lease = item.stash.get(_LEASE, None)
    if lease is not None:
        return list(lease.indices)
    if item.get_closest_marker(GPU_MARKER) is None:
        return None
    return []


def leased_devices(item: pytest.Item) -> list[str] | None:
    """The ``CUDA_VISIBLE_DEVICES`` entries of the GPUs leased to ``item``, like ``leased_gpus``.

    ``",".join(leased_devices(item))`` is what ``CUDA_VISIBLE_DEVICES`` holds while the test
    runs; entry ``r`` alone is the value for a child that should see only rank ``r``'s GPU
    (indices are translated through any ``CUDA_VISIBLE_DEVICES`` pytest was started with, and
    may be UUIDs).
    """
    lease = item.stash.get(_LEASE, None)
    if lease is not None:
        return list(lease.devices)
    if item.get_closest_marker(GPU_MARKER) is None:
        return None
    return []


def cuda_initialized() -> bool:
    """Whether this process has initialised CUDA through torch; never imports or inits it."""
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    is_initialized = getattr(cuda, "is_initialized", None)
    try:
        return bool(is_initialized()) if callable(is_initialized) else False
    except Exception:  # a half-imported torch: nothing was initialised through it
        return False


@contextlib.contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def _skipped_by_mark(item: pytest.Item) -> bool:
    """Cheap look at skip marks, so a test that will not run does not wait for GPUs."""
    if item.get_closest_marker("skip") is not None:
        return True
    for mark in item.iter_markers("skipif"):
        conditions = mark.args or (mark.kwargs.get("condition"),)
        if any(condition is True for condition in conditions):
            return True
    return False


class DevicePlugin:
    """Hooks for the ``gpu``/``cpu`` markers; registered by ``plugin.pytest_configure``."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        fake_gpu_count(os.environ)  # a bad value is a usage error now, not at the first gpu test
        config.addinivalue_line("markers", _GPU_HELP)
        config.addinivalue_line("markers", _CPU_HELP)
        self._workerinput: dict[str, Any] | None = getattr(config, "workerinput", None)
        self.worker_id = str(self._workerinput["workerid"]) if self._workerinput else "main"
        self._inventory: GpuInventory | None = None
        self._lease_timeout: float | None = None
        self._lease_dir: str | None = None
        self._owns_lease_dir = False
        self._affinity: tuple[int, ...] = ()  # the GPUs of this process's last lease
        self._cuda_pin: tuple[tuple[int, ...], str] | None = None  # (GPUs, test) CUDA bound to
        self._warned_cuda = False

    # Registered during pytest_configure: pluggy replays the historic pytest_addoption and
    # pytest_configure calls for this instance then, in that order, so the ini key still counts
    # as known when pytest validates ini keys after collection.
    def pytest_addoption(self, parser: pytest.Parser) -> None:
        parser.addini(
            LEASE_TIMEOUT_INI,
            f"Seconds a gpu test may wait for GPUs held by other tests before it errors "
            f"(default {DEFAULT_LEASE_TIMEOUT_S:g}; env {LEASE_TIMEOUT_ENV})",
            default="",
        )

    def pytest_configure(self, config: pytest.Config) -> None:
        self._lease_timeout = lease_timeout(config)

    @property
    def inventory(self) -> GpuInventory:
        """The GPUs of this process, detected once (lazily: runs no process until needed)."""
        if self._inventory is None:
            self._inventory = detect_gpus()
        return self._inventory

    @property
    def leaser(self) -> GpuLeaser:
        """The leaser over this session's lock directory (shared with every xdist worker)."""
        if self._lease_dir is None:
            if self._workerinput is not None:
                self._lease_dir = self._workerinput.get(LEASE_DIR_KEY) or os.path.join(
                    tempfile.gettempdir(),
                    f"torchhang-gpu-leases-{self._workerinput['testrunuid']}",
                )
            else:
                self._lease_dir = tempfile.mkdtemp(prefix="torchhang-gpu-leases-")
                self._owns_lease_dir = True
        return GpuLeaser(self._lease_dir)

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node: Any) -> None:
        """xdist controller: every worker, a replacement included, gets the same lock directory."""
        node.workerinput[LEASE_DIR_KEY] = self.leaser.lock_dir

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        if self._owns_lease_dir and self._lease_dir:
            shutil.rmtree(self._lease_dir, ignore_errors=True)

    def pytest_report_header(self, config: pytest.Config) -> str:
        build = torch_build()
        inventory = self.inventory
        torch_text = f"torch {build.version}" if build.version else "torch not installed"
        gpus = f"GPUs: {inventory.count}"
        if inventory.fake or inventory.note:
            gpus += f" ({inventory.describe()})"
        session = settings.session_settings(config)
        timeout = (
            f"timeout {session.timeout:g}s (from {session.source})"
            if session.timeout > 0
            else "timeout off"
        )
        available = "yes" if inventory.count else "no"
        return f"torch-hang: {torch_text}, CUDA available: {available}, {gpus}, {timeout}"

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(
        self, collector: pytest.Collector
    ) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
        # A bad marker fails the collection of its module or class, as a syntax error would.
        # (A UsageError from a hook would do on a plain run, but pytest-xdist workers turn it
        # into an INTERNALERROR that loses the message.)
        report = yield
        return settings.fail_collection_on_bad_markers(report, requested_gpus, (MarkerError,))

    @pytest.hookimpl(trylast=True)  # last: see markers that other plugins add here
    def pytest_collection_modifyitems(
        self, config: pytest.Config, items: list[pytest.Item]
    ) -> None:
        for item in items:
            self._plan(item)

    def _plan(self, item: pytest.Item) -> int | None:
        """Decide once per item what it needs; a skip marker when it can never get its GPUs."""
        try:
            count = requested_gpus(item)
        except MarkerError as exc:  # only a marker added after collection gets this far
            item.stash[_SETUP_ERROR] = str(exc)
            return None
        item.stash[_REQUEST] = count
        if count:
            reason = skip_reason(count, self.inventory)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
        return count

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_protocol(
        self, item: pytest.Item, nextitem: pytest.Item | None
    ) -> Generator[None, object, object]:
        # Outermost, so that waiting for a lease is not counted against the test's hang timeout,
        # and the lease and CUDA_VISIBLE_DEVICES cover setup, call and teardown alike.
        count = item.stash[_REQUEST] if _REQUEST in item.stash else self._plan(item)
        if count == 0:
            with _environ(CUDA_VISIBLE_DEVICES, ""):
                return (yield)
        if count is None or _skipped_by_mark(item) or count > self.inventory.count:
            return (yield)
        with self._leased(item, count):
            return (yield)

    @contextlib.contextmanager
    def _leased(self, item: pytest.Item, count: int) -> Iterator[None]:
        inventory = self.inventory
        timeout_s = self._lease_timeout
        if timeout_s is None:
            timeout_s = self._lease_timeout = lease_timeout(self.config)
        cuda_before = cuda_initialized()
        candidates = self._candidates(item, count, inventory.count, cuda_before)
        lease: GpuLease | None = None
        if candidates is not None:
            holder = f"{self.worker_id} pid {os.getpid()} {item.nodeid}"
            try:
                lease = self.leaser.acquire(count, inventory.count, timeout_s, holder, candidates)
            except LeaseTimeout as exc:
                item.stash[_SETUP_ERROR] = str(exc)
        if lease is None:  # the setup hook turns the stashed message into the test's error
            try:
                yield
            finally:
                del item.stash[_SETUP_ERROR]
            return
        lease.devices = tuple(inventory.devices[i] for i in lease.indices)
        visible = ",".join(lease.devices)
        properties = [
            (_GPUS_PROPERTY, ",".join(map(str, lease.indices))),
            (_WAIT_PROPERTY, f"{lease.waited_s:.2f}"),
        ]
        item.user_properties.extend(properties)
        if lease.waited_s >= 1.0:
            item.add_report_section(
                "setup",
                "torch-hang",
                f"waited {lease.waited_s:.1f}s for GPUs {visible} held by other tests",
            )
        item.stash[_LEASE] = lease
        try:
            with _environ(CUDA_VISIBLE_DEVICES, visible):
                yield
        finally:
            del item.stash[_LEASE]
            self._affinity = lease.indices
            if not cuda_before and self._cuda_pin is None and cuda_initialized():
                # CUDA read CUDA_VISIBLE_DEVICES once, now: this process is bound to these GPUs.
                self._cuda_pin = (lease.indices, item.nodeid)
            lease.release()
            # A rerun of the item (pytest-rerunfailures) must not report two leases.
            for prop in properties:
                with contextlib.suppress(ValueError):
                    item.user_properties.remove(prop)

    def _candidates(
        self, item: pytest.Item, count: int, total: int, cuda_before: bool
    ) -> list[int] | None:
        """The GPUs this test may lease, in order of preference; None (and a stashed error)
        when CUDA in this very process already rules the request out."""
        if self._cuda_pin is not None:
            pinned, by = self._cuda_pin
            if len(pinned) == count:
                return list(pinned)
            item.stash[_SETUP_ERROR] = (
                f"CUDA was initialised in this pytest process ({self.worker_id}) during {by}, "
                f"with GPU(s) {','.join(map(str, pinned))} of its lease; CUDA reads "
                f"{CUDA_VISIBLE_DEVICES} once per process, so this gpu({count}) test cannot get "
                f"{count} GPU(s) of its own here. Run CUDA work in child processes (the "
                "torch_hang fixture, @pytest.mark.torch_hang(isolate=True)) or give tests of "
                "one GPU count a session of their own"
            )
            return None
        if cuda_before and not self._warned_cuda:
            self._warned_cuda = True
            item.warn(
                pytest.PytestWarning(
                    f"CUDA was initialised in this pytest process ({self.worker_id}) outside a "
                    f"gpu test, with whatever {CUDA_VISIBLE_DEVICES} was then; the GPUs leased "
                    "to gpu tests reach their child processes, but CUDA work in this process "
                    "may share a GPU with other tests"
                )
            )
        # Prefer the GPUs this process had last: a worker that keeps its GPU keeps in-process
        # CUDA (bound to the first lease) consistent with its later leases.
        return [*self._affinity, *(i for i in range(total) if i not in self._affinity)]

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        message = item.stash.get(_SETUP_ERROR, None)
        if message is not None:
            pytest.fail(f"{item.nodeid}: {message}", pytrace=False)

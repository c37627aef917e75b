"""Pytest hooks for the gpu and cpu markers: skips, GPU leases, CUDA_VISIBLE_DEVICES per test."""

from __future__ import annotations

import contextlib
import operator
import os
import shutil
import tempfile
from collections.abc import Generator, Iterator
from typing import Any

import pytest

from .. import settings
from .build import torch_build
from .detect import (
    CUDA_VISIBLE_DEVICES,
    GpuInventory,
    cuda_initialized,
    detect_gpus,
    fake_gpu_count,
)
from .leases import (
    DEFAULT_LEASE_TIMEOUT_S,
    LEASE_TIMEOUT_ENV,
    LEASE_TIMEOUT_INI,
    GpuLease,
    GpuLeaser,
    LeaseTimeout,
    lease_timeout,
)

GPU_MARKER = "gpu"
CPU_MARKER = "cpu"
#: Key of the lease directory in an xdist worker's ``workerinput``.
LEASE_DIR_KEY = "torch_hang_gpu_lease_dir"

_GPU_HELP = (
    f"{GPU_MARKER}(count=1): the test needs count CUDA GPUs of its own; skipped where fewer are "
    f"visible, otherwise leased exclusively for the test and named in {CUDA_VISIBLE_DEVICES} "
    "for its process tree (pytest-torchhang)"
)
_CPU_HELP = (
    f"{CPU_MARKER}: the test must not touch a GPU; CUDA is hidden from it and its child "
    f'processes ({CUDA_VISIBLE_DEVICES}="") so a stray .cuda() fails fast (pytest-torchhang)'
)


class MarkerError(ValueError):
    """A ``gpu`` or ``cpu`` marker with arguments that make no sense; a collection error."""


def requested_gpus(item: pytest.Item) -> int | None:
    """GPUs the test's markers ask for: n for ``gpu(n)``, 0 for ``cpu``, None for neither.

    Raises ``MarkerError`` naming the test and the marker when the arguments are invalid.
    """
    gpu = cpu = None
    for mark in item.iter_markers():  # one walk of the node chain (closest first), not two
        if mark.name == GPU_MARKER:
            gpu = gpu or mark
        elif mark.name == CPU_MARKER:
            cpu = cpu or mark
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


_REQUEST = pytest.StashKey[int | None]()  # what requested_gpus() said
_LEASE = pytest.StashKey[GpuLease]()
_SETUP_ERROR = pytest.StashKey[str]()  # the test errors at setup with this message
_PER_TEST = "torchhang-devices-per-test"
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
        theirs = settings.pytest_timeout_seconds(config)
        timeout = (
            f"timeout {session.timeout:g}s (from {session.source})"
            if session.timeout > 0
            else "timeout off"
        )
        if theirs > 0:  # taken over: the tree report and cleanup apply to it too
            timeout += f", pytest-timeout's {theirs:g}s (whole-tree report)"
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
        needed = [self._plan(item) is not None or _SETUP_ERROR in item.stash for item in items]
        # Tests without a gpu or cpu marker need nothing per test: the hooks that lease GPUs
        # are registered only in sessions that have such tests.
        if any(needed) and not config.pluginmanager.has_plugin(_PER_TEST):
            config.pluginmanager.register(_MarkedTestHooks(self), _PER_TEST)

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

    def protocol(self, item: pytest.Item) -> Generator[None, object, object]:
        """The whole test under its lease (or with CUDA hidden, for the cpu marker)."""
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


class _MarkedTestHooks:
    """Per-test hooks for sessions with gpu or cpu tests; see ``DevicePlugin``."""

    def __init__(self, devices: DevicePlugin) -> None:
        self.devices = devices

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_protocol(
        self, item: pytest.Item, nextitem: pytest.Item | None
    ) -> Generator[None, object, object]:
        # Outermost, so that waiting for a lease is not counted against the test's hang timeout,
        # and the lease and CUDA_VISIBLE_DEVICES cover setup, call and teardown alike.
        return (yield from self.devices.protocol(item))

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        message = item.stash.get(_SETUP_ERROR, None)
        if message is not None:
            pytest.fail(f"{item.nodeid}: {message}", pytrace=False)

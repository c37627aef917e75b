"""GPU leases: a flock per GPU, so one GPU serves one test at a time across the processes."""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from .. import clock, settings

LEASE_TIMEOUT_INI = "torch_hang_gpu_lease_timeout"
LEASE_TIMEOUT_ENV = "PYTEST_TORCH_HANG_GPU_LEASE_TIMEOUT"
#: A test waits this long for GPUs held by other tests before it errors. Tests that hold GPUs
#: are themselves bounded by --torch-hang-timeout, so a long wait is contention, not a hang.
DEFAULT_LEASE_TIMEOUT_S = 300.0
_POLL_S = 0.05


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
        started = clock.monotonic()
        deadline = started + timeout_s
        queue_fd = _open_lock(self._path("queue.lock"))
        try:
            while not _try_lock(queue_fd):
                if clock.monotonic() >= deadline:
                    raise LeaseTimeout(
                        self._timeout_text(count, order, total, timeout_s)
                        + f"; queued behind {_read_holder(self._path('queue.lock'))}"
                    )
                _pause()
            _write_holder(queue_fd, f"{holder}, which waits for {count} GPU(s)")
            while True:
                lease = self._try_gpus(count, order, holder)
                if lease is not None:
                    lease.waited_s = clock.monotonic() - started
                    return lease
                if clock.monotonic() >= deadline:
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
    clock.sleep(_POLL_S * (1.0 + random.random()))


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

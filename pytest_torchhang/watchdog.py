"""Deadlines that fire whatever the main thread is doing.

A watchdog thread runs the guard pipeline at the deadline and interrupts the main thread. When
the main thread holds the GIL in C code, that thread cannot run: a small monitor process (see
``monitor.py``), told of every deadline through a pipe, then does the capture and the kill from
outside, the pytest process included.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import guard
from ._hook import DUMP_DIR_ENV
from .report import HangReport

#: Sent to the pytest main thread to raise HangError where it is blocked.
INTERRUPT_SIGNAL = signal.SIGRTMIN + 6
#: After a fire: how often and how many times the main thread is interrupted again.
INTERRUPT_EVERY_S = 1.0
INTERRUPTS = 5
#: Full fires (capture + kill) per test at most; then the monitor's hard stop applies.
MAX_FIRES = 3


@dataclass
class ItemGuard:
    """The state of one guarded test."""

    target: guard.GuardTarget
    deadline: float
    main_thread: int
    fires: int = 0
    interrupts: int = 0
    report: HangReport | None = None
    done: threading.Event = field(default_factory=threading.Event)
    in_phase: bool = False
    raised: bool = False
    attached: bool = False
    disarmed: bool = False
    item: Any = None  # the pytest item, for hooks that get none (pytest_enter_pdb)


class MonitorClient:
    """The pytest side of the monitor process: started on first use, told of deadlines by a pipe."""

    def __init__(self, dump_dir: str, stderr_fd: int, report_dir: str | None) -> None:
        self._dump_dir = dump_dir
        self._stderr_fd = stderr_fd
        self._report_dir = report_dir
        self._proc: subprocess.Popen[bytes] | None = None
        self._write_fd: int | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _start(self) -> None:
        read_fd, write_fd = os.pipe()
        env = {k: v for k, v in os.environ.items() if k != DUMP_DIR_ENV}
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pytest_torchhang.monitor",
                str(os.getpid()),
                str(read_fd),
                self._dump_dir,
                self._report_dir or "",
            ],
            pass_fds=(read_fd,),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._stderr_fd,
            env=env,
            close_fds=True,
        )
        os.close(read_fd)
        os.set_inheritable(write_fd, False)
        self._write_fd = write_fd

    def ensure_started(self) -> int:
        """Start the monitor if it is not running; returns its pid."""
        if self._proc is None or self._proc.poll() is not None:
            self._close_pipe()
            self._start()
        assert self._proc is not None
        return self._proc.pid

    def send(self, line: str) -> None:
        """Tell the monitor ``line``; restart it once if it died."""
        for _ in range(2):
            self.ensure_started()
            assert self._write_fd is not None
            try:
                os.write(self._write_fd, (line + "\n").encode())
                return
            except OSError:
                self._close_pipe()
                self._proc = None

    def _close_pipe(self) -> None:
        if self._write_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._write_fd)
            self._write_fd = None

    def stop(self) -> None:
        """End the monitor: closing the pipe makes it exit; bounded wait, then kill."""
        self._close_pipe()
        if self._proc is not None:
            try:
                self._proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(timeout=2.0)
            self._proc = None


class Watchdog:
    """One thread per session; at most one armed test at a time (pytest runs them one by one)."""

    def __init__(
        self,
        monitor: MonitorClient,
        own_pids: Callable[[], set[int]] = set,
    ) -> None:
        self._own_pids = own_pids  # the plugin's processes now (a zygote may have started since)
        self._monitor = monitor
        self._cond = threading.Condition()
        self._current: ItemGuard | None = None
        self._wake_at = float("inf")  # when the thread next wakes by itself
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="torch-hang watchdog", daemon=True)
        self._thread.start()

    @property
    def thread_ident(self) -> int | None:
        return self._thread.ident

    def arm(self, item: ItemGuard) -> None:
        with self._cond:
            self._current = item
            # Wake the thread only when it would otherwise sleep past this deadline: tests
            # shorter than their timeout then cost no thread switch at all.
            if item.deadline < self._wake_at:
                self._cond.notify()
        self._monitor.send(
            f"ARM {item.deadline:.6f} {item.target.timeout_s:.6f} {item.target.test_id}"
        )

    def disarm(self) -> None:
        with self._cond:
            self._current = None  # the thread finds out when it next wakes
        self._monitor.send("DISARM")

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._current = None
            self._cond.notify()
        self._thread.join(timeout=5.0)

    def _next_due(self) -> ItemGuard | None:
        with self._cond:
            while not self._stopping:
                item = self._current
                if item is None:
                    self._wake_at = float("inf")
                    self._cond.wait()
                    continue
                remaining = item.deadline - time.monotonic()
                if remaining > 0:
                    self._wake_at = item.deadline
                    # no more fires for this test (deadline inf): wait to be told of the next
                    self._cond.wait(remaining if remaining != float("inf") else None)
                    continue
                return item
            return None

    def _run(self) -> None:
        while (item := self._next_due()) is not None:
            if item.fires == 0 or (item.interrupts >= INTERRUPTS and item.fires < MAX_FIRES):
                self._fire(item)
            if item.interrupts < INTERRUPTS:
                item.interrupts += 1
                if self._current is item:  # the test may have just ended
                    with contextlib.suppress(OSError, ValueError):
                        signal.pthread_kill(item.main_thread, INTERRUPT_SIGNAL)
                item.deadline = time.monotonic() + INTERRUPT_EVERY_S
            elif item.fires < MAX_FIRES:
                item.interrupts = 0
                item.deadline = time.monotonic() + INTERRUPT_EVERY_S
            else:
                item.deadline = float("inf")  # nothing more this thread can do; the monitor can

    def _fire(self, item: ItemGuard) -> None:
        item.fires += 1
        self._monitor.send("FIRED")
        if self._monitor.pid is not None:  # a restarted monitor has a new pid: never kill it
            item.target.exclude.add(self._monitor.pid)
        item.target.exclude |= self._own_pids()
        skip = {self._thread.ident} if self._thread.ident else set()
        try:
            report = guard.capture(item.target, skip_threads=skip)
            if item.report is None:
                item.report = report
            else:
                item.report.notes.append(
                    f"still running {report.elapsed_s:.1f}s after the deadline: the tree was captured "
                    f"and killed again ({report.headline})"
                )
            guard.kill(item.target, report)
            if report is not item.report and item.report is not None:
                item.report.killed += report.killed
                item.report.shm_removed += report.shm_removed
        finally:
            item.done.set()

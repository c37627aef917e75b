"""Deadlines that fire whatever the test's thread is doing, with one explicit state per test.

A watchdog thread runs the hang pipeline at the deadline and interrupts the test's thread. When
that thread holds the GIL in C code, the watchdog cannot run: the monitor process (see
``monitor.py``), told of every deadline through a pipe, then acts from outside.

One test's deadline moves through these states, each change made under one lock::

    ARMED --deadline, or no progress for the stall time--> FIRING --report ready--> FIRED
    FIRED --HangError raised or attached--> DELIVERED
    FIRED: interrupted again every second, the tree re-killed now and then
    DELIVERED --the test's teardown outlives its grace--> FIRING (a second hang, in teardown)
    any state --test over, or a debugger--> DISARMED

Only FIRED, while the test's own code runs (setup, call or teardown), allows an interrupt.
Once the test has its ``HangError``, the rest of it (teardown above all) gets a grace as long as
the timeout itself, and is interrupted only if it outlives that grace too.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import _progress, guard
from .exceptions import HangError
from .monitor import MonitorClient
from .processwide import INTERRUPT_SIGNAL
from .report import HangReport

#: While a fired test has not taken its HangError: interrupt it again this often ...
INTERRUPT_EVERY_S = 1.0
#: ... and kill its tree again every this many interrupts (it may have started new processes).
REKILL_EVERY = 5
#: At most this many kills of one tree per hang; then only the monitor's hard stop is left.
MAX_KILLS = 3
#: Stall detection looks at the progress board at least this often, keeping this many samples.
SAMPLE_EVERY_S = 5.0
MAX_SAMPLES = 120


class State(enum.Enum):
    """Where one test's deadline stands."""

    ARMED = "armed"
    FIRING = "firing"
    FIRED = "fired"
    DELIVERED = "delivered"
    DISARMED = "disarmed"


class Action(enum.Enum):
    """What the watchdog thread must do for a deadline now."""

    FIRE = "fire"
    INTERRUPT = "interrupt"
    REKILL = "rekill"


@dataclass
class TestDeadline:
    """The deadline of one guarded test and the hang reports it produced."""

    __test__ = False  # not a test class, whatever pytest's collection thinks of the name

    target: guard.GuardTarget
    deadline: float
    thread_id: int  # the thread that runs the test (pytest's main thread, or the one it runs in)
    item: Any = None  # the pytest item, for hooks that get none (pytest_enter_pdb)
    state: State = State.ARMED
    phase_running: bool = False  # the test's setup, call or teardown code is running now
    reports: list[HangReport] = field(default_factory=list)
    attached: int = 0  # how many of ``reports`` a pytest report carries already
    interrupts: int = 0
    kills: int = 0
    #: Set while no capture is in progress; made at the first fire (most tests never fire).
    done: threading.Event | None = None
    #: Stall detection: fail after this long without progress on the board (0: off).
    stall_s: float = 0.0
    board: _progress.Reader | None = None
    stall_base: float = field(default_factory=time.monotonic)  # progress counts from here
    paused: bool = False
    stalled: bool = False  # the hang being declared is a stall, not a timeout
    #: (seconds since the test began, beats per kind) every few seconds: the stall report's history
    samples: list[tuple[float, list[int]]] = field(default_factory=list)
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    @property
    def in_main_thread(self) -> bool:
        return self.thread_id == threading.main_thread().ident

    @property
    def fired(self) -> bool:
        """Whether a hang was declared for this test (reported or not yet)."""
        return bool(self.reports) or self.state is State.FIRING

    def step(self, now: float) -> tuple[Action | None, float]:
        """What to do now, and when to look again (called by the watchdog thread)."""
        with self._lock:
            if self.state is State.ARMED and self.stall_s and not self.paused:
                stall_at = self._stall_at(now)
                if now >= stall_at and stall_at < self.deadline:
                    self.stalled = True
                    self._firing()
                    return Action.FIRE, float("inf")
                # look again at the stall time, or sooner to keep the history going
                return None, min(self.deadline, stall_at, now + SAMPLE_EVERY_S)
            if now < self.deadline or self.state is State.DISARMED:
                return None, self.deadline if self.state is not State.DISARMED else float("inf")
            if self.state in (State.ARMED, State.DELIVERED):
                self.stalled = False  # past a deadline (a grace, after a stall too): a hang
                self._firing()
                return Action.FIRE, float("inf")
            if self.state is State.FIRED:
                self.interrupts += 1
                self.deadline = now + INTERRUPT_EVERY_S
                if self.interrupts % REKILL_EVERY == 0 and self.kills < MAX_KILLS:
                    return Action.REKILL, self.deadline
                return Action.INTERRUPT, self.deadline
            return None, float("inf")  # FIRING: the watchdog itself is at work

    def _stall_at(self, now: float) -> float:
        """When the tree will have gone ``stall_s`` without progress; samples the board."""
        last = self.stall_base
        if self.board is not None:
            last = max(last, self.board.last())
            counts = self.board.snapshot().counts
            if not self.samples or now - self.target.started - self.samples[-1][0] >= 1.0:
                self.samples.append((now - self.target.started, counts))
                del self.samples[:-MAX_SAMPLES]
        return last + self.stall_s

    def first_check(self) -> float:
        """When the watchdog must look at this deadline first: its time, or its stall time."""
        if self.stall_s and self.state is State.ARMED:
            return min(self.deadline, self.stall_base + self.stall_s)
        return self.deadline

    def _firing(self) -> None:
        if self.done is None:
            self.done = threading.Event()
        self.done.clear()  # before the state says FIRING: whoever sees FIRING finds the event
        self.state = State.FIRING

    def wait_for_capture(self, wait_s: float) -> None:
        """Until a capture in progress (capture and kill) is over, at most ``wait_s``."""
        done = self.done
        if done is not None:
            done.wait(wait_s)

    def fire_done(self, report: HangReport, now: float) -> None:
        """The tree was captured and killed: from now on the test is interrupted until it raises."""
        with self._lock:
            self.reports.append(report)
            self.kills += 1
            if self.state is State.FIRING:
                self.state = State.FIRED
                self.interrupts = 0
                self.deadline = now  # interrupt at once
            if self.done is not None:
                self.done.set()

    def take_error(self) -> HangError | None:
        """In the test's thread, at an interrupt: the HangError to raise there, if it is time."""
        with self._lock:
            if self.state is not State.FIRED or not self.phase_running or not self.reports:
                return None
            report = self.reports[-1]
            self._deliver()
        return HangError(report.headline, report)

    def take_reports(self, wait_s: float) -> list[HangReport]:
        """For a pytest report of this test: the hang reports no earlier report carries."""
        self.wait_for_capture(wait_s)
        with self._lock:
            fresh = self.reports[self.attached :]
            self.attached = len(self.reports)
            if fresh and self.state is State.FIRED:
                self._deliver()  # reported, even if the interrupt never landed: stop interrupting
            return fresh

    def _deliver(self) -> None:
        self.state = State.DELIVERED
        # The rest of the test (its teardown above all) gets a grace as long as the timeout.
        self.deadline = time.monotonic() + self.target.timeout_s

    def enter_phase(self, name: str) -> None:
        with self._lock:
            self.target.phase = name
            self.phase_running = True

    def leave_phase(self) -> None:
        with self._lock:
            self.phase_running = False
            if not self.in_main_thread and self.state is State.FIRED:
                _cancel_async_exception(self.thread_id)  # it must not land in pytest's own code

    def disarm(self) -> None:
        with self._lock:
            self.state = State.DISARMED
            self.deadline = float("inf")

    def pause(self) -> float:
        """Stop the clock (the zygote's start is the session's cost); returns what was left."""
        with self._lock:
            if self.state is not State.ARMED:
                return float("nan")
            left = self.deadline - time.monotonic()
            self.deadline = float("inf")
            self.paused = True
            return left

    def resume(self, left: float) -> None:
        with self._lock:
            self.paused = False
            self.stall_base = time.monotonic()  # the stall clock starts again, too
            if self.state is State.ARMED and left == left:  # NaN: it was not paused
                self.deadline = time.monotonic() + left

    def tighten(self, deadline: float, timeout_s: float) -> bool:
        """Move an armed deadline earlier (two plugins set one); False when nothing changed."""
        with self._lock:
            if self.state is not State.ARMED or deadline >= self.deadline:
                return False
            self.deadline = deadline
            self.target.timeout_s = min(self.target.timeout_s, timeout_s)
            return True

    def monitor_state(self) -> tuple[float, float] | str | None:
        """What the monitor must know of this deadline now: (deadline, timeout) while armed or
        in its grace (inf while paused), ``"disarmed"``, or None (firing: no change)."""
        with self._lock:
            if self.state in (State.ARMED, State.DELIVERED):
                return self.deadline, self.target.timeout_s
            if self.state is State.DISARMED:
                return "disarmed"
            return None


def _async_hang(report: HangReport, deadline: TestDeadline) -> type[HangError]:
    """A HangError class whose instance, raised in another thread, marks the hang delivered."""

    class AsyncHangError(HangError):
        def __init__(self) -> None:
            super().__init__(report.headline, report)
            with deadline._lock:
                if deadline.state is State.FIRED:
                    deadline._deliver()

    AsyncHangError.__name__ = AsyncHangError.__qualname__ = "HangError"
    return AsyncHangError


def _set_async_exception(thread_id: int, exc: type[BaseException] | None) -> None:
    set_async = ctypes.pythonapi.PyThreadState_SetAsyncExc
    set_async(ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc is not None else None)


def _cancel_async_exception(thread_id: int) -> None:
    with contextlib.suppress(Exception):
        _set_async_exception(thread_id, None)


class Watchdog:
    """One thread per session; at most one armed test at a time (pytest runs them one by one)."""

    def __init__(
        self, monitor: MonitorClient, own_pids: Callable[[], set[int]], notes: list[str]
    ) -> None:
        self._own_pids = own_pids  # the plugin's processes now (a zygote may have started since)
        self._monitor = monitor
        self._errors = notes  # the watchdog's own failures, for the session's summary
        self._cond = threading.Condition(threading.RLock())
        self._current: TestDeadline | None = None
        self._wake_at = float("inf")  # when the thread next wakes by itself
        # (id of the deadline, what the monitor was last told of it)
        self._told: tuple[int, tuple[float, float] | str | None, int] = (0, None, 0)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="torch-hang watchdog", daemon=True)
        self._thread.start()

    def arm(self, deadline: TestDeadline) -> None:
        """Watch ``deadline`` (the current test's), or look again at it after a change."""
        with self._cond:
            self._current = deadline
            # Wake the thread only when it would otherwise sleep past this deadline: tests
            # shorter than their timeout then cost no thread switch at all.
            if deadline.first_check() < self._wake_at:
                self._cond.notify()
        self._tell_monitor(deadline)

    def disarm(self, deadline: TestDeadline) -> None:
        deadline.disarm()
        with self._cond:
            if self._current is deadline:
                self._current = None  # the thread finds out when it next wakes
        self._tell_monitor(deadline)

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._current = None
            self._cond.notify()
        self._thread.join(timeout=5.0)

    def _tell_monitor(self, deadline: TestDeadline) -> None:
        state = deadline.monitor_state()
        told = (id(deadline), state, len(deadline.target.before or ()))
        if state is None or self._told == told:
            return
        self._told = told
        if isinstance(state, str):
            self._monitor.board.disarm()
        else:
            target = deadline.target
            self._monitor.board.arm(*state, target.before or (), target.test_id)

    def _next(self) -> tuple[TestDeadline, Action] | None:
        with self._cond:
            while not self._stopping:
                current = self._current
                if current is None:
                    self._wake_at = float("inf")
                    self._cond.wait()
                    continue
                action, wake = current.step(time.monotonic())
                if action is not None:
                    return current, action
                self._tell_monitor(current)  # e.g. a grace after the test took its HangError
                self._wake_at = wake
                timeout = wake - time.monotonic()
                self._cond.wait(timeout if timeout != float("inf") else None)
            return None

    def _run(self) -> None:
        while (due := self._next()) is not None:
            deadline, action = due
            try:
                if action is Action.FIRE:
                    self._fire(deadline)
                elif action is Action.REKILL:
                    deadline.kills += 1
                    guard.kill(deadline.target)
                self._interrupt(deadline)
            except Exception as exc:  # the watchdog must outlive its own failures
                self._errors.append(f"the watchdog failed on {deadline.target.test_id}: {exc!r}")
                if deadline.state is State.FIRING:
                    deadline.fire_done(_failed_report(deadline, exc), time.monotonic())

    def _fire(self, deadline: TestDeadline) -> None:
        self._monitor.send("FIRED")
        self._told = (id(deadline), None, 0)
        target = deadline.target
        if self._monitor.pid is not None:  # a restarted monitor has a new pid: never kill it
            target.exclude.add(self._monitor.pid)
        target.exclude |= self._own_pids()
        skip = {self._thread.ident} if self._thread.ident else set()
        try:
            report = guard.capture(target, skip_threads=skip)
        except Exception as exc:  # report what is known, and still kill the tree
            report = _failed_report(deadline, exc)
        if deadline.stalled:
            _as_stall(report, deadline)
        try:
            guard.kill(target, report)
        except Exception as exc:
            report.notes.append(f"pytest-torchhang could not kill the tree: {exc!r}")
        deadline.fire_done(report, time.monotonic())

    def _interrupt(self, deadline: TestDeadline) -> None:
        """Make the test's thread raise its HangError where it is (if it runs its own code)."""
        with deadline._lock:
            if deadline.state is not State.FIRED or not deadline.phase_running:
                return
            if not deadline.in_main_thread:
                _set_async_exception(
                    deadline.thread_id, _async_hang(deadline.reports[-1], deadline)
                )
                return
        with contextlib.suppress(OSError, ValueError):
            signal.pthread_kill(deadline.thread_id, INTERRUPT_SIGNAL)


def _failed_report(deadline: TestDeadline, exc: BaseException) -> HangReport:
    target = deadline.target
    elapsed = time.monotonic() - target.started
    return HangReport(
        test_id=target.test_id,
        timeout_s=target.timeout_s,
        elapsed_s=elapsed,
        phase=target.phase,
        headline=f"HANG after {elapsed:.1f}s in {target.test_id}: the stacks could not be taken",
        notes=[f"pytest-torchhang's capture failed: {exc!r}; the tree was killed all the same"],
    )


def _duration(seconds: float) -> str:
    """``12.0s``, or ``3m12s`` from a minute on."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}m{rest:02d}s"


_RATE_UNITS = ("batches/s", "optimizer steps/s", "collectives/s", "progress() calls/s")


def _as_stall(report: HangReport, deadline: TestDeadline) -> None:
    """Make the report a stall's: its headline says what progress looked like and when it stopped.

    ``STALL after 3m12s in test_x: no progress for 30.0s (last: DataLoader batch 812 of epoch
    3 at 2m42s; before that 6.1 batches/s and 3.0 optimizer steps/s)``
    """
    target = deadline.target
    snapshot = deadline.board.snapshot() if deadline.board is not None else None
    if snapshot is None or snapshot.kind < 0:
        progress = "no progress at all since the test began"
    else:
        at = max(0.0, snapshot.last - target.started)
        progress = f"last: {snapshot.describe_last()} at {_duration(at)}"
        rates = [
            f"{rate:.1f} {unit}"
            for kind, unit in enumerate(_RATE_UNITS)
            if (rate := snapshot.rate(kind)) is not None
        ]
        if rates:
            progress += "; before that " + " and ".join(rates)
    where = target.test_id + (f" (during {target.phase})" if target.phase != "call" else "")
    silent = report.elapsed_s - (
        max(snapshot.last, deadline.stall_base) - target.started
        if snapshot is not None and snapshot.kind >= 0
        else deadline.stall_base - target.started
    )
    report.headline = (
        f"STALL after {_duration(report.elapsed_s)} in {where}: no progress for "
        f"{min(silent, report.elapsed_s):.1f}s ({progress})"
    )
    report.kind = "stall"
    report.progress = {
        "stall_s": deadline.stall_s,
        "kinds": list(_progress.KINDS),
        "counts": snapshot.counts if snapshot is not None else [],
        "last": progress,
        "history": [{"t": round(t, 3), "counts": counts} for t, counts in deadline.samples],
    }

"""The shell around the deadline model: a thread that executes what ``deadline.py`` decides.

One watchdog thread per session runs the hang's path (``hang/``) when a test's deadline fires,
interrupts the test's thread, and keeps the monitor (``monitor.py``, the GIL-independent last resort) told
of the next time it must have acted. Every change to a test's deadline, from whichever thread,
goes through ``TestDeadline.feed``: one lock, one pure decision; only this thread executes one.
"""

from __future__ import annotations

import contextlib
import itertools
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from . import clock, deadline, processwide
from .deadline import Action, Decision, Event, Kind, Phase, Source
from .exceptions import HangError
from .inject import hook, protocol
from .monitor.client import MonitorClient
from .processwide import INTERRUPT_SIGNAL

# The cold path (the capture, the report model and its rendering) is imported at the first fire.
if TYPE_CHECKING:
    from .capture.target import CaptureTarget
    from .inject import beats
    from .report.model import HangReport

#: Stall detection looks at the progress board at least this often, keeping this many samples.
SAMPLE_EVERY_S = 5.0
MAX_SAMPLES = 120
#: The cold path (capture, diagnosis, rendering) loads this long before a test's first deadline,
#: on this thread; a session whose tests end in time never loads it. It takes 0.2 s idle, 3.5 s
#: seen loaded (the fire is late, and the monitor allows it: ``busy``). Loading it earlier,
#: beside the test, left it half done under a test that took the GIL in C (a wrong report).
PRELOAD_S = 0.5
_COLD_PATH = __name__.rsplit(".", 1)[0] + ".hang.path"
#: The watchdog thread wakes at least this often, whatever is due (every wait is bounded).
MAX_WAIT_S = 60.0

_calls = itertools.count(1)


@dataclass
class TestDeadline:
    """The deadline of one guarded test (a ``deadline.State``) and the hang reports it produced."""

    __test__ = False  # not a test class, whatever pytest's collection thinks of the name

    target: CaptureTarget
    state: deadline.State
    thread_id: int  # the thread that runs the test (pytest's main thread, or the one it runs in)
    item: Any = None  # the pytest item, for hooks that get none (pytest_enter_pdb)
    reports: list[HangReport] = field(default_factory=list)
    attached: int = 0  # how many of ``reports`` a pytest report carries already
    #: Set while no capture is in progress; made at the first fire (most tests never fire).
    done: threading.Event | None = None
    board: beats.Reader | None = None
    #: (seconds since the test began, beats per kind) every few seconds: the stall report's history
    samples: list[tuple[float, list[int]]] = field(default_factory=list)
    #: decisions with an action taken on another thread than the watchdog's, for it to execute
    pending: list[Decision] = field(default_factory=list)
    wake: float = deadline.INF  # when the model wants to be looked at again
    #: pids of fixture calls' children in flight: a fire of the test captures and kills them too
    call_children: dict[int, list[int]] = field(default_factory=dict)
    #: asked when a deadline comes due: a note when a debugger holds the test (pytest-timeout's
    #: rule, ``debuggers.py``), else None; None: detection is off
    debugger: Callable[[], str | None] | None = None
    #: called with the target at a fire, before the capture: marks what the tree holds for
    #: wider-scoped fixtures (``target.spare``), to be captured but not killed
    before_capture: Callable[[CaptureTarget], CaptureTarget] | None = None
    #: the phase the test's code runs in now (setup, call, teardown): the capture's, at a fire
    phase_name: str = "call"
    #: The watchdog's one door: called (without the lock) after another thread queued an action
    #: or moved the wake earlier, so that no change waits for a wake nobody scheduled.
    door: Callable[[TestDeadline], None] | None = field(default=None, repr=False)
    #: How long the process was seen stopped (Ctrl-Z) between two times: the monitor's log,
    #: read only when something comes due; stops before ``stops_counted`` are in the model.
    stops: Callable[[float, float], float] | None = field(default=None, repr=False)
    stops_counted: float = -deadline.INF
    arm_ticks: int = 0  # when armed (``clock.boot_ticks``): ownership is settled at a fire
    #: The test's own code runs: stored without the lock while nothing fired; the model learns
    #: it whenever the lock is next taken (``_sync_running``), before it decides anything.
    running: bool = False
    # A plain lock, never re-entered: an interrupt that lands while its own thread holds it (in
    # the middle of ``feed``) must not change the state under that feed, which would then store
    # its own result over the interrupt's event. Code that may run at any bytecode (the signal
    # handler, an asynchronous HangError) never waits for it: it defers its event instead.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    #: events that found the lock taken, for its holder (or the next one) to apply
    _deferred: list[Event] = field(default_factory=list, repr=False)
    _knock: bool = field(default=False, repr=False)  # the door is to be called on release
    _interrupt_missed: bool = field(default=False, repr=False)  # send the interrupt again

    @property
    def in_main_thread(self) -> bool:
        return self.thread_id == threading.main_thread().ident

    @property
    def ask_trace(self) -> Callable[[], tuple[bool, object]] | None:
        """How to ask the test's thread for its own ``sys.gettrace()`` (the debugger check):
        only the main thread can be asked, by a signal; None for another."""
        return processwide.main_thread_trace if self.in_main_thread else None

    @property
    def fired(self) -> bool:
        """Whether a hang was declared for this test (reported or not yet)."""
        return bool(self.reports) or self.state.phase is Phase.FIRING

    @property
    def deadline(self) -> float:
        """When the test's tightest wall-clock limit is due (inf: none, or paused)."""
        state = self.state  # one immutable value: no lock needed to read it whole
        if state.paused or state.phase is not Phase.ARMED:
            return deadline.INF
        return min((limit.due for limit in state.limits), default=deadline.INF)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the test's lock; on release, apply deferred events and knock on the door."""
        self._lock.acquire()
        try:
            self._sync_running()
            yield
        finally:
            self._settle(clock.monotonic())
            knock, self._knock = self._knock, False
            self._lock.release()
        if knock and self.door is not None:
            self.door(self)

    def feed(self, event: Event, now: float | None = None, by_watchdog: bool = False) -> Decision:
        """Apply ``event`` to the model. Only the watchdog thread acts (``by_watchdog``): an
        action decided on another thread waits in ``pending`` for it, and the door wakes it."""
        with self.locked():
            return self._feed(event, now, by_watchdog)

    def start(self, now: float) -> None:
        """The model's first decision, before any other thread holds this deadline: no lock."""
        self.state, decision = deadline.decide(self.state, deadline.Tick(), now)
        self.wake = decision.wake
        if decision.action is not None:  # due at once: the watchdog's arm wakes its thread
            self.pending.append(decision)

    def _sync_running(self) -> None:
        """With the lock held: the model learns where the test's thread is (see ``running``)."""
        if self.running is not self.state.running:
            self.state = deadline.with_running(self.state, self.running, clock.monotonic())

    def _feed(self, event: Event, now: float | None, by_watchdog: bool) -> Decision:
        """``feed`` with the lock held."""
        at = clock.monotonic() if now is None else now
        self._settle(at)
        if at >= self.wake:  # something comes due: not if only because the process was stopped
            self._count_stops(at)
        if by_watchdog and isinstance(event, deadline.Tick):
            if self.pending:
                return self.pending.pop(0)
            if self.state.stall_s and self.board is not None:
                event = deadline.Progress(self._sample(at))
        return self._step(event, at, by_watchdog)

    def _step(self, event: Event, at: float, by_watchdog: bool) -> Decision:
        earlier = self.wake
        self.state, decision = deadline.decide(self.state, event, at)
        if decision.action is Action.FIRE:
            self._firing()
        self.wake = decision.wake
        if not by_watchdog and (decision.action is not None or decision.wake < earlier):
            if decision.action is not None:
                self.pending.append(decision)
            self._knock = True
        return decision

    def _count_stops(self, at: float) -> None:
        """With the lock held: move the clocks on by the time the process was stopped (Ctrl-Z)
        since last asked. A stopped process is paused, not hung; only the monitor, which was
        not stopped, saw how long (its log overstates a stop by at most its polling interval:
        a deadline comes at most that much late, never early)."""
        if self.stops is None:
            return
        since = max(self.stops_counted, self.state.started)
        try:
            stopped = self.stops(since, at)
        except Exception:  # the page is unreadable: the deadline stands as it is
            return
        self.stops_counted = at
        if stopped > 0:
            self._step(deadline.Stopped(stopped), at, by_watchdog=False)

    def _settle(self, at: float) -> None:
        """With the lock held: apply the events deferred while it was taken, and queue the
        interrupt that found it taken."""
        while self._deferred:
            self._step(self._deferred.pop(0), at, by_watchdog=False)
        if self._interrupt_missed:
            self._interrupt_missed = False
            if self.state.phase is Phase.FIRED and self.state.running:
                self.pending.append(Decision(Action.INTERRUPT, self.wake))
                self._knock = True

    def deliver_later(self) -> None:
        """The test has its HangError: from code that may run while its thread holds the lock
        (an asynchronous exception lands at any bytecode), so it never waits for the lock."""
        if not self._lock.acquire(blocking=False):
            self._deferred.append(deadline.Delivered())  # for the holder, as it releases it
            return
        try:
            self._sync_running()
            self._step(deadline.Delivered(), clock.monotonic(), by_watchdog=False)
        finally:
            self._lock.release()  # the door is knocked on at the next release

    def _sample(self, now: float) -> float:
        """The board's last beat; keeps a bounded history of its counts for the stall report."""
        assert self.board is not None
        counts = self.board.snapshot().counts
        if not self.samples or now - self.target.started - self.samples[-1][0] >= 1.0:
            self.samples.append((now - self.target.started, counts))
            del self.samples[:-MAX_SAMPLES]
        return self.board.last()

    def _firing(self) -> None:
        if self.done is None:
            self.done = threading.Event()
        self.done.clear()  # before anyone sees FIRING: whoever does finds the event

    def wait_for_capture(self, wait_s: float) -> None:
        """Until a capture in progress (capture and kill) is over, at most ``wait_s``."""
        done = self.done
        if done is not None:
            done.wait(wait_s)

    def fire_done(self, report: HangReport) -> None:
        """The tree was captured and killed: from now on the test is interrupted until it raises.

        The first capture of a hang is its report: a later one in the same phase (a ``with``
        block's cleanup that blocks after the interrupt) becomes a note of it, never a new one.
        """
        with self.locked():
            unreported = self.reports[self.attached :]
            if unreported:
                from .hang.reports import follow_up_note  # loaded: this is a fire

                unreported[0].notes.append(follow_up_note(unreported[0], report))
            else:
                self.reports.append(report)
            self._feed(deadline.CaptureDone(), None, by_watchdog=True)  # the watchdog interrupts
            if self.done is not None:
                self.done.set()

    def take_error(self) -> HangError | None:
        """In the test's thread, at an interrupt (a signal handler): the HangError to raise
        there, if it is time. It never waits for the lock: if its own thread holds it (the
        signal landed inside ``feed``), it raises nothing now and the interrupt is sent again
        once the lock is released."""
        if not self._lock.acquire(blocking=False):
            self._interrupt_missed = True
            return None
        try:
            self._sync_running()
            state = self.state
            if state.phase is not Phase.FIRED or not state.running or not self.reports:
                return None
            report = self.reports[-1]
            # No door here (the next release knocks): the handler may have landed inside it.
            self._step(deadline.Delivered(), clock.monotonic(), by_watchdog=False)
        finally:
            self._lock.release()
        return HangError(report.headline, report)

    def take_reports(self, wait_s: float) -> list[HangReport]:
        """For a pytest report of this test: the hang reports no earlier report carries."""
        self.wait_for_capture(wait_s)
        with self.locked():
            fresh = self.reports[self.attached :]
            self.attached = len(self.reports)
            if fresh:
                self._feed(deadline.Delivered(), None, False)  # even if no interrupt landed
            return fresh

    def enter_phase(self, name: str) -> None:
        """The test's own code starts. While nothing fired, two stores and no event: a fire
        that begins after the look at the phase finds them; one that began before is seen."""
        self.phase_name = name
        self.running = True
        if self.state.phase is not Phase.ARMED:
            with self.locked():
                self._feed(deadline.PhaseStarted(name), None, False)

    def leave_phase(self) -> None:
        """pytest's own code runs again (see ``enter_phase``)."""
        self.running = False
        if self.state.phase is Phase.ARMED:
            return
        with self.locked():
            self._feed(deadline.PhaseEnded(), None, False)
            if not self.in_main_thread and self.state.phase is Phase.FIRED:
                processwide.cancel_async_exception(
                    self.thread_id
                )  # it must not land in pytest's own code

    def call_started(self, seconds: float, pids: list[int]) -> int:
        """A fixture call waits for ``pids`` up to ``seconds``; returns its key."""
        key = next(_calls)
        with self.locked():
            self.call_children[key] = list(pids)
            self._feed(deadline.CallStarted(key, seconds), None, False)
        return key

    def call_capturing(self, key: int) -> None:
        self.feed(deadline.CallCapturing(key))

    def call_ended(self, key: int, hung: bool) -> None:
        with self.locked():
            self.call_children.pop(key, None)
            self._feed(deadline.CallEnded(key, hung), None, False)

    def monitor_state(self) -> tuple[float, float] | str | None:
        """What the monitor must know of this deadline now: (deadline, timeout) while armed or
        in its grace (inf while paused), ``"disarmed"``, or None (firing: no change)."""
        with self._lock:  # no events applied here: it runs under the watchdog's lock
            state, wake = self.state, self.wake
        due = deadline.monitor_due(state, wake)
        if due is None:
            return None
        if due < 0:
            return "disarmed"
        return due, state.timeout_s


def _async_hang(report: HangReport, held: TestDeadline) -> type[HangError]:
    """A HangError class whose instance, raised in another thread, marks the hang delivered."""

    class AsyncHangError(HangError):
        def __init__(self) -> None:
            super().__init__(report.headline, report)
            held.deliver_later()

    AsyncHangError.__name__ = AsyncHangError.__qualname__ = "HangError"
    return AsyncHangError


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
        self._wake_at = deadline.INF  # when the thread next wakes by itself
        # (id of the deadline, what the monitor was last told of it, fixtures' processes)
        self._told: tuple[int, tuple[float, float] | str | None, int] = (0, None, 0)
        self._stopping = False
        self._preloaded = False  # the cold path, before the first deadline (see PRELOAD_S)
        self._native_id = 0  # the watchdog thread's, for the monitor (its /proc/PID/task/TID)
        self._stops = monitor.board.stopped_between  # bound once: armed with every test
        self._thread = threading.Thread(
            target=self._run, name=f"{protocol.THREAD_PREFIX}watchdog", daemon=True
        )
        self._thread.start()
        hook.name_thread(self._thread)

    def arm(self, held: TestDeadline, check: bool = True) -> None:
        """Watch ``held`` (the current test's), or look again at it after a change."""
        if check:  # a new test's arm checks at most once a second (``session.MONITOR_CHECK_S``)
            restarted = self._monitor.check()  # one waitpid: the backstop is alive
            if restarted:
                self._errors.append(restarted)
        held.door = self._door
        held.stops = self._stops
        with self._cond:
            self._current = held
            self._wake_if_due(held)
            self._tell_monitor(held)

    def _door(self, held: TestDeadline) -> None:
        """The one door in: another thread queued an action for this thread, or moved the wake
        earlier (called without ``held``'s lock: this lock is always taken first)."""
        with self._cond:
            if self._current is held:
                self._wake_if_due(held)

    def _wake_if_due(self, held: TestDeadline) -> None:
        # Wake the thread only when it would otherwise sleep past what is due (the cold path's
        # load included): tests shorter than their timeout then cost no thread switch at all.
        if held.pending or min(held.wake, self._preload_at(held)) < self._wake_at:
            self._cond.notify()

    def _preload_at(self, held: TestDeadline) -> float:
        """When to load the cold path for ``held`` (inf: loaded already)."""
        if self._preloaded or _COLD_PATH in sys.modules:
            return deadline.INF
        return held.deadline - PRELOAD_S

    def disarm(self, held: TestDeadline) -> None:
        """The test is over. The page of one that never fired is left as it is: this thread
        wakes by the time on it and clears it then (``_tell_idle``), seconds before the monitor
        would act; the next test's arm overwrites it first, or an unguarded test's start."""
        held.feed(deadline.Disarm())
        with self._cond:
            if self._current is held:
                self._current = None  # the thread finds out when it next wakes
            if held.state.fires:  # the monitor counts from the fire: it must forget it now
                self._tell_monitor(held)

    def idle(self) -> None:
        """No guarded test follows at once (an unguarded one, or the session's end)."""
        with self._cond:
            if self._current is None:
                self._tell_idle()

    def _tell_idle(self) -> None:
        """Under ``self._cond``, with no test armed: clear the monitor's page (once)."""
        if self._told[1] != "disarmed":
            self._told = (0, "disarmed", 0)
            self._monitor.board.disarm()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._current = None
            self._cond.notify()
        self._thread.join(timeout=5.0)

    def _tell_monitor(self, held: TestDeadline) -> None:
        """Write the monitor's page: only under ``self._cond``, so it has one writer at a time
        (the page is a single-writer seqlock), whichever thread changed the deadline."""
        state = held.monitor_state()
        told = (id(held), state, len(held.target.before or ()))
        if state is None or self._told == told:
            return
        self._told = told
        if isinstance(state, str):
            self._monitor.board.disarm()
        else:
            target = held.target
            self._monitor.board.arm(*state, target.before or (), target.test_id)

    def _next(self) -> tuple[TestDeadline, Decision | None] | None:
        """The next decision to execute, or None (with a test) to load the cold path first."""
        with self._cond:
            while not self._stopping:
                # the monitor's evidence that this thread runs (the GIL is not held for good)
                self._monitor.board.beat(clock.monotonic(), self._native_id)
                current = self._current
                if current is None:
                    self._tell_idle()
                    self._sleep(deadline.INF)
                    continue
                decision = current.feed(deadline.Tick(), by_watchdog=True)
                if decision.action is not None:
                    self._busy()
                    return current, decision
                self._tell_monitor(current)  # e.g. a grace after the test took its HangError
                wake = decision.wake
                if current.state.stall_s and current.state.phase is Phase.ARMED:
                    wake = min(wake, clock.monotonic() + SAMPLE_EVERY_S)  # the stall history
                preload_at = self._preload_at(current)
                if preload_at <= clock.monotonic():
                    self._busy()
                    return current, None
                self._sleep(min(wake, preload_at))
            return None

    def _busy(self) -> None:
        """Tell the monitor this thread goes on to act (until its next beat): a loaded machine's
        import of the cold path takes seconds, which it allows (``BUSY_GRACE_S``)."""
        self._monitor.board.beat(clock.monotonic(), self._native_id, busy=True)

    def _sleep(self, wake: float) -> None:
        """Under ``self._cond``: wait until ``wake`` or a knock, and at most ``MAX_WAIT_S``
        (``Condition.wait`` overflows past ``threading.TIMEOUT_MAX``, some 292 years)."""
        now = clock.monotonic()
        self._wake_at = min(wake, now + MAX_WAIT_S)
        if self._wake_at > now:
            self._cond.wait(self._wake_at - now)

    def _run(self) -> None:
        self._native_id = threading.get_native_id()
        while True:
            try:
                due = self._next()
            except Exception as exc:  # one decision failed: say so, and serve the next one
                self._failed(None, exc)
                with self._cond:
                    self._sleep(clock.monotonic() + deadline.INTERRUPT_EVERY_S)  # no spin
                continue
            if due is None:
                return
            held, decision = due
            if decision is None:
                self._preload()
                continue
            try:
                restarted = self._monitor.check()
                if restarted:
                    self._errors.append(restarted)
                if decision.action is Action.FIRE:
                    if self._held_for_debugger(held):
                        continue
                    self._fire(held, decision.kind is Kind.STALL)
                elif decision.action is Action.REKILL:
                    processwide.forget_torn_out_modules()
                    from .hang import path  # the cold path: loaded at the first fire

                    path.kill(held.target)
                self._interrupt(held)
            except Exception as exc:  # the watchdog must outlive its own failures
                self._failed(held, exc)
                if held.state.phase is Phase.FIRING:
                    held.fire_done(_failed_report(held, exc))

    def _failed(self, held: TestDeadline | None, exc: BaseException) -> None:
        """A note of the watchdog's own failure for the session's summary, each said once."""
        where = f" on {held.target.test_id}" if held is not None else ""
        note = f"the watchdog failed{where}: {exc!r}"
        if note not in self._errors:
            self._errors.append(note)

    def _preload(self) -> None:
        self._preloaded = True
        try:
            processwide.forget_torn_out_modules()
            from .hang import path  # noqa: F401  (the cold path: see PRELOAD_S)
        except Exception as exc:  # the fire imports it again, and reports what fails then
            self._errors.append(f"pytest-torchhang could not load its capture: {exc!r}")

    def _held_for_debugger(self, held: TestDeadline) -> bool:
        """A debugger holds the test as its deadline comes (pytest-timeout's rule): nothing is
        captured or killed, and the test runs on with no deadline, as pytest-timeout drops its
        timer then. The session's notes say so."""
        note = held.debugger() if held.debugger is not None else None
        if note is None:
            return False
        held.feed(deadline.Disarm(), by_watchdog=True)
        if held.done is not None:
            held.done.set()  # no capture is in progress after all
        with self._cond:
            self._tell_monitor(held)
        self._errors.append(note)
        return True

    def _fire(self, held: TestDeadline, stalled: bool) -> None:
        self._monitor.send("FIRED")
        with self._cond:
            self._told = (id(held), None, 0)
        processwide.forget_torn_out_modules()
        from .hang import path  # the cold path: loaded at the first fire

        exclude = set(self._own_pids())
        if self._monitor.pid is not None:  # a restarted monitor has a new pid: never kill it
            exclude.add(self._monitor.pid)
        with held.locked():
            calls = [pid for pids in held.call_children.values() for pid in pids]
            target = path.at_fire(
                held.target, held.state.timeout_s, held.phase_name, exclude, calls
            )
        if held.before_capture is not None:
            try:
                target = held.before_capture(target)
            except Exception as exc:  # the tree is still captured and killed, as before
                self._errors.append(f"pytest-torchhang could not read fixtures' pools: {exc!r}")
        with held.locked():
            held.target = target  # what a later kill of this test (REKILL) spares and includes
        skip = {t for t in (self._thread.ident, processwide.launcher_ident()) if t is not None}
        stall = None
        if stalled:
            state = held.state
            stall = path.Stall(held.board, state.stall_s, state.progress_at, held.samples)
        from_pytest_timeout = held.state.fire_source is Source.PYTEST_TIMEOUT
        held.fire_done(path.fire(target, skip, stall, from_pytest_timeout))

    def _interrupt(self, held: TestDeadline) -> None:
        """Make the test's thread raise its HangError where it is (if it runs its own code)."""
        with held.locked():
            if held.state.phase is not Phase.FIRED or not held.state.running or not held.reports:
                return
            if not held.in_main_thread:
                processwide.set_async_exception(held.thread_id, _async_hang(held.reports[-1], held))
                return
        with contextlib.suppress(OSError, ValueError):
            signal.pthread_kill(held.thread_id, INTERRUPT_SIGNAL)


def _failed_report(held: TestDeadline, exc: BaseException) -> HangReport:
    """What is known when the fire itself failed (its cold path could not even be loaded)."""
    from .hang.reports import failed_report

    # the fire may have failed before it made the capture's target: the model says the rest
    target = replace(held.target, timeout_s=held.state.timeout_s, phase=held.phase_name)
    return failed_report(target, exc)

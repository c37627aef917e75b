"""The plugin's clock and the watchdog's shell: a test that patches ``time`` moves no deadline,
every change from another thread wakes the watchdog at once, and no decision kills its thread.

The watchdog runs here for real (its thread, its lock, the monitor's page), without the monitor
process and without the capture: its fire step is replaced by one that records when it came.
"""

from __future__ import annotations

import ast
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import pytest_torchhang
from pytest_torchhang import clock, deadline, processwide, watchdog
from pytest_torchhang.capture.target import CaptureTarget
from pytest_torchhang.deadline import Action, Phase, Source
from pytest_torchhang.monitor.client import MonitorClient
from pytest_torchhang.report.model import HangReport

PACKAGE = Path(pytest_torchhang.__file__).parent

# --- no module reads time through the time module -------------------------------------------


def _time_reads(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, function) of each call of a function of the ``time`` module at run time (inside a
    function body), and of each binding of one by name at module level (``""``: freezegun
    replaces such an attribute)."""
    found = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "time":
            found.append((node.lineno, ""))
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for statement in func.body:
            for node in ast.walk(statement):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "time"
                ):
                    found.append((node.lineno, func.name))
    return found


#: Runs at interpreter start-up only, before any user code of its process can patch ``time``.
STARTUP_ONLY = {("inject/site/sitecustomize.py", "_note")}


def test_no_module_of_the_package_reads_the_time_module_at_run_time() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name == "clock.py":
            continue
        for line, function in _time_reads(ast.parse(path.read_text(), name)):
            if (name, function) not in STARTUP_ONLY:
                offenders.append(f"{name}:{line} in {function or 'the module'}")
    assert offenders == []


def test_the_check_finds_a_run_time_read_and_a_module_level_binding() -> None:
    source = "import time\nfrom time import monotonic\ndef f():\n    return time.monotonic()\n"
    assert _time_reads(ast.parse(source)) == [(2, ""), (4, "f")]


def test_the_clock_is_out_of_reach_of_patches_of_the_time_module(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_before, wall_before = clock.monotonic(), clock.wall()
    monkeypatch.setattr(time, "monotonic", lambda: 0.0)
    monkeypatch.setattr(time, "time", lambda: 0.0)
    monkeypatch.setattr(time, "sleep", _no_sleep)
    clock.sleep(0.01)
    assert clock.monotonic() - real_before >= 0.01
    assert clock.wall() - wall_before >= 0.01
    assert abs(clock.wall() - _real_wall()) < 1.0


def test_freezegun_does_not_reach_the_clock() -> None:
    freezegun = pytest.importorskip("freezegun")
    before, wall_before = clock.monotonic(), clock.wall()
    with freezegun.freeze_time("2001-01-01"):
        assert time.time() < 1e9  # frozen in 2001 ...
        clock.sleep(0.01)
        assert clock.monotonic() - before >= 0.01  # ... but not the plugin's clock
        assert clock.wall() - wall_before >= 0.01


def test_time_machine_does_not_reach_the_clock() -> None:
    time_machine = pytest.importorskip("time_machine")
    wall_before, boot_before = clock.wall(), clock.boottime()
    with time_machine.travel(0.0, tick=False):
        assert time.time() < 1.0
        clock.sleep(0.01)
        assert clock.wall() - wall_before >= 0.01
        assert abs(clock.wall() - (wall_before + clock.boottime() - boot_before)) < 0.1
    assert abs(clock.wall() - time.time()) < 0.01  # the host's again, once the test is done


def _no_sleep(seconds: float) -> None:
    raise AssertionError("the plugin called the test's time.sleep")


def _real_wall() -> float:
    return time.clock_gettime(time.CLOCK_REALTIME)


# --- the watchdog's shell, for real -----------------------------------------------------------


class Shell:
    """A real watchdog thread and the monitor's real page; the fire step records its time.

    Its tests stay between phases (nothing to interrupt) unless a handler of the interrupt
    signal is installed (``interrupts``): the signal's default action ends the process."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.fired: list[float] = []
        self.fire_seen = threading.Event()
        self.notes: list[str] = []
        self.monitor = MonitorClient(str(tmp_path), 2, None)  # its process starts on demand only
        self.dog = watchdog.Watchdog(self.monitor, set, self.notes)
        monkeypatch.setattr(self.dog, "_fire", self._fire)
        self.dog._preloaded = True  # the cold path (psutil, the capture) is not this test's

    def _fire(self, held: watchdog.TestDeadline, stalled: bool) -> None:
        self.fired.append(clock.monotonic())
        elapsed = clock.monotonic() - held.target.started
        held.fire_done(HangReport(held.target.test_id, held.state.timeout_s, elapsed, "call"))
        self.fire_seen.set()

    def held(self, limits: dict[Source, float], thread_id: int | None = None) -> Armed:
        now = clock.monotonic()
        target = CaptureTarget(test_id="t", timeout_s=0.0, root_pid=0, dump_dir=None, started=now)
        state = deadline.start(now, limits)
        held = watchdog.TestDeadline(target, state, thread_id or threading.get_ident())
        held.feed(deadline.Tick())
        return Armed(held, now)

    def arm(self, armed: Armed) -> None:
        self.dog.arm(armed.held)

    def stop(self) -> None:
        self.dog.stop()


class Armed:
    def __init__(self, held: watchdog.TestDeadline, at: float) -> None:
        self.held, self.at = held, at


@pytest.fixture
def shell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Shell]:
    running = Shell(tmp_path, monkeypatch)
    yield running
    running.stop()


PATCHES: dict[str, Callable[[float], float]] = {
    "frozen at 0": lambda real: 0.0,
    "moved on by 1000 s": lambda real: real + 1000.0,
    "running backwards": lambda real: -real,
}


@pytest.mark.parametrize("patch", list(PATCHES), ids=list(PATCHES))
def test_a_test_that_patches_time_neither_hastens_nor_holds_its_deadline(
    shell: Shell, monkeypatch: pytest.MonkeyPatch, patch: str
) -> None:
    armed = shell.held({Source.TIMEOUT: 0.5})
    shell.arm(armed)
    real = time.monotonic
    monkeypatch.setattr(time, "monotonic", lambda: PATCHES[patch](real()))
    monkeypatch.setattr(time, "time", lambda: 0.0)
    monkeypatch.setattr(time, "sleep", _no_sleep)
    monkeypatch.setattr(watchdog, "MAX_WAIT_S", 0.05)  # the thread looks at the clock often
    assert shell.fire_seen.wait(10.0), "the deadline never came"
    assert 0.45 <= shell.fired[0] - armed.at < 5.0
    assert armed.held.state.phase in (Phase.FIRED, Phase.DELIVERED)
    assert shell.notes == []


def test_an_action_queued_from_another_thread_wakes_the_watchdog_at_once(shell: Shell) -> None:
    armed = shell.held({Source.TIMEOUT: 100.0})
    shell.arm(armed)  # the thread sleeps until the limit, or a minute
    time.sleep(0.1)
    decided = armed.held.feed(deadline.Tick(), now=armed.at + 100.0)  # due: decided here
    assert decided.action is Action.FIRE
    assert shell.fire_seen.wait(5.0), "the fire waited for a wake nobody scheduled"
    assert shell.fired[0] - armed.at < 2.0


def test_a_limit_too_long_for_a_timed_wait_leaves_the_watchdog_serving(shell: Shell) -> None:
    first = shell.held({Source.PYTEST_TIMEOUT: 1e12})  # pytest-timeout's value, taken as is
    shell.arm(first)
    time.sleep(0.2)
    first.held.feed(deadline.Disarm())
    second = shell.held({Source.TIMEOUT: 0.3})
    shell.arm(second)
    assert shell.fire_seen.wait(5.0), "the watchdog thread is gone"
    assert shell.notes == []


def test_a_failed_decision_is_noted_and_the_watchdog_serves_the_next(
    shell: Shell, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_decide = deadline.decide
    failures = [OverflowError("timeout value is too large")]

    def decide(state: deadline.State, event: deadline.Event, now: float) -> object:
        if failures and threading.current_thread().name.endswith("watchdog"):
            raise failures.pop()
        return real_decide(state, event, now)

    monkeypatch.setattr(deadline, "decide", decide)
    armed = shell.held({Source.TIMEOUT: 0.3})
    shell.arm(armed)
    assert shell.fire_seen.wait(5.0), "the watchdog thread died of one failed decision"
    assert any("OverflowError('timeout value is too large')" in note for note in shell.notes)


# --- an interrupt that lands inside feed --------------------------------------------------


class Interrupts:
    """The plugin's interrupt signal, handled as the plugin does (the test's HangError, if it is
    its turn), while ``on``; what the handler raised, and the model's count of interrupts then."""

    def __init__(self, held: watchdog.TestDeadline) -> None:
        self.held = held
        self.on = False
        self.raised: list[tuple[BaseException, int]] = []

    def __call__(self, signum: int, frame: object) -> None:
        if not self.on:
            return
        error = self.held.take_error()
        if error is not None:
            self.raised.append((error, self.held.state.interrupts))
            raise error


@pytest.fixture
def interrupts(shell: Shell) -> Iterator[Interrupts]:
    """A test whose deadline fired and was captured between its phases (nothing to interrupt
    yet), on this thread, with the plugin's interrupt signal handled for real."""
    armed = shell.held({Source.TIMEOUT: 0.2}, thread_id=threading.main_thread().ident)
    handler = Interrupts(armed.held)
    previous = signal.signal(processwide.INTERRUPT_SIGNAL, handler)
    try:
        shell.arm(armed)
        assert shell.fire_seen.wait(5.0)
        yield handler
    finally:
        shell.stop()  # no interrupt after this test
        signal.signal(processwide.INTERRUPT_SIGNAL, previous)


def _signal_inside_feed(monkeypatch: pytest.MonkeyPatch, on: type[object]) -> None:
    """Interrupt this thread while ``feed`` holds the lock for an ``on`` event."""
    real_decide = deadline.decide

    def decide(state: deadline.State, event: deadline.Event, now: float) -> object:
        if isinstance(event, on) and threading.current_thread() is threading.main_thread():
            signal.pthread_kill(threading.get_ident(), processwide.INTERRUPT_SIGNAL)
            time.sleep(0.001)  # the handler runs here, inside feed
        return real_decide(state, event, now)

    monkeypatch.setattr(deadline, "decide", decide)


def test_an_interrupt_inside_feed_as_a_phase_ends_raises_nothing_and_loses_nothing(
    interrupts: Interrupts, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = interrupts.held
    held.enter_phase("teardown")  # the handler is off: the test runs, fired, not interrupted
    assert held.state.phase is Phase.FIRED and held.state.running
    _signal_inside_feed(monkeypatch, deadline.PhaseEnded)
    interrupts.on = True
    held.leave_phase()  # pytest's own code: nothing may be raised in it
    interrupts.on = False
    assert interrupts.raised == []
    assert held.state.phase is Phase.FIRED and not held.state.running  # the event was kept


def test_an_interrupt_that_found_feed_busy_is_sent_again_once_it_is_free(
    interrupts: Interrupts, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = interrupts.held
    monkeypatch.setattr(deadline, "INTERRUPT_EVERY_S", 60.0)  # the next periodic one: far off
    held.feed(deadline.Tick(), now=held.state.next_interrupt)  # as the watchdog's next look
    _signal_inside_feed(monkeypatch, deadline.PhaseStarted)
    interrupts.on = True
    sent_before = held.state.interrupts
    with pytest.raises(pytest_torchhang.HangError):
        held.enter_phase("teardown")
        threading.Event().wait(5.0)  # the test's own code, where the interrupt lands
    interrupts.on = False
    ((_, sent_then),) = interrupts.raised
    assert sent_then == sent_before  # the one sent again, not a periodic one
    assert held.state.phase is Phase.DELIVERED

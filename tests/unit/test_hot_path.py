"""What a passing guarded test costs the shell: one decision to arm, one to disarm, one write of
the monitor's page; its phases recorded without the lock, yet seen by a fire; ownership settled
at a fire from start times (a real watchdog thread and the monitor's real page, no torch)."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_torchhang import clock, deadline, watchdog
from pytest_torchhang.capture import procfs, tree
from pytest_torchhang.capture.target import CaptureTarget
from pytest_torchhang.deadline import Action, Phase, Source
from pytest_torchhang.monitor.client import MonitorClient
from pytest_torchhang.monitor.page import DeadlineBoard
from pytest_torchhang.report.model import HangReport


def _held(timeout_s: float, started: float | None = None) -> watchdog.TestDeadline:
    now = clock.monotonic() if started is None else started
    target = CaptureTarget(test_id="t", timeout_s=timeout_s, root_pid=0, dump_dir=None, started=now)
    held = watchdog.TestDeadline(
        target, deadline.start(now, {Source.TIMEOUT: timeout_s}), threading.get_ident()
    )
    held.start(now)
    return held


@pytest.fixture
def dog(tmp_path: Path) -> Iterator[watchdog.Watchdog]:
    monitor = MonitorClient(str(tmp_path), 2, None)  # its process starts on demand only
    running = watchdog.Watchdog(monitor, set, [])
    running._preloaded = True  # the cold path (psutil, the capture) is not this test's
    yield running
    running.stop()


def test_a_passing_test_makes_one_decision_to_arm_one_to_disarm_and_one_page_write(
    dog: watchdog.Watchdog, monkeypatch: pytest.MonkeyPatch
) -> None:
    me = threading.current_thread()
    decisions: list[str] = []
    writes: list[str] = []
    real_decide, real_write = deadline.decide, DeadlineBoard._write

    def decide(state: deadline.State, event: deadline.Event, now: float) -> object:
        if threading.current_thread() is me:
            decisions.append(type(event).__name__)
        return real_decide(state, event, now)

    def write(board: DeadlineBoard, *args: object, **kwargs: object) -> None:
        if threading.current_thread() is me:
            writes.append("page")
        real_write(board, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(deadline, "decide", decide)
    monkeypatch.setattr(DeadlineBoard, "_write", write)
    for _ in range(3):  # a session's passing tests, one after the other
        held = _held(60.0)
        dog.arm(held, check=False)
        for phase in ("setup", "call", "teardown"):
            held.enter_phase(phase)
            assert held.phase_name == phase
            held.leave_phase()
        dog.disarm(held)
        assert held.state.phase is Phase.DISARMED
    assert decisions == ["Tick", "Disarm"] * 3
    assert writes == ["page"] * 3


def test_a_phase_recorded_without_the_lock_is_what_a_fire_sees() -> None:
    start = clock.monotonic() - 2.0  # armed two seconds ago with a one-second limit: due
    held = _held(1.0, started=start)
    held.enter_phase("call")  # armed: two stores, no event
    assert held.running and not held.state.running
    decision = held.feed(deadline.Tick(), by_watchdog=True)
    assert decision.action is Action.FIRE
    assert held.state.running  # the model learnt it before it decided
    held.leave_phase()  # firing: the event goes through the lock
    assert not held.state.running
    held.fire_done(HangReport("t", 1.0, 2.0, "call"))
    assert held.state.phase is Phase.FIRED and held.pending == []  # pytest's code: no interrupt
    held.enter_phase("teardown")
    assert held.state.running and held.phase_name == "teardown"
    later = clock.monotonic() + deadline.INTERRUPT_EVERY_S
    decision = held.feed(deadline.Tick(), now=later, by_watchdog=True)
    assert decision.action is Action.INTERRUPT  # its own code runs: interrupted again


def test_a_phase_left_while_a_fire_decides_is_seen_before_the_interrupt() -> None:
    """The race the lock-free stores leave: the fire decides with the test's code running,
    then the test leaves it before the capture is done. The capture's end learns it."""
    held = _held(1.0, started=clock.monotonic() - 2.0)
    held.enter_phase("call")
    assert held.feed(deadline.Tick(), by_watchdog=True).action is Action.FIRE
    held.running = False  # the store of leave_phase, as if its look had come before the fire
    held.fire_done(HangReport("t", 1.0, 2.0, "call"))
    assert not held.state.running and held.pending == []


def test_the_monitor_s_page_is_cleared_by_the_watchdog_before_the_monitor_would_act(
    dog: watchdog.Watchdog,
) -> None:
    board = dog._monitor.board
    held = _held(0.3)
    dog.arm(held, check=False)
    assert board.read() is not None
    dog.disarm(held)
    assert board.read() is not None  # a passing test writes nothing at its end
    until = clock.monotonic() + 0.3 + 2.0  # the monitor acts GIL_GRACE_S (3 s) after 0.3 s
    while board.read() is not None and clock.monotonic() < until:
        time.sleep(0.02)
    assert board.read() is None, "the page still shows a test that is over"


def test_a_fired_test_s_end_clears_the_page_at_once(dog: watchdog.Watchdog) -> None:
    board = dog._monitor.board
    held = _held(60.0)
    dog.arm(held, check=False)
    held.feed(deadline.Tick(), now=held.target.started + 60.0, by_watchdog=True)  # fired
    dog.disarm(held)
    assert board.read() is None


@pytest.mark.parametrize(
    ("births", "ticks", "before"),
    [
        ({(1, 99), (2, 100), (3, 101)}, 100, {(1, 99)}),  # the arm's own tick: the test's
        ({(1, 99), (2, 100)}, 101, {(1, 99), (2, 100)}),
        ({(7, 5)}, 5, set()),
        (set(), 100, set()),
    ],
)
def test_what_started_before_the_arm_s_tick_is_context(
    births: set[tuple[int, int]], ticks: int, before: set[tuple[int, int]]
) -> None:
    assert tree.born_before(frozenset(births), ticks) == before


def test_the_arm_s_ticks_and_a_process_s_start_time_share_a_clock() -> None:
    before = clock.boot_ticks()
    child = subprocess.Popen(["sleep", "5"])
    try:
        info = procfs.stat(child.pid)
        after = clock.boot_ticks()
        assert info is not None
        assert before <= info.start_ticks <= after
    finally:
        child.kill()
        child.wait()


def test_the_page_keeps_the_run_s_context_written_once(tmp_path: Path) -> None:
    board = DeadlineBoard(str(tmp_path / "page"), create=True)
    context = frozenset({(11, 100), (12, 101)})
    board.arm(5.0, 1.0, context, "first")
    board.arm(6.0, 1.0, context, "second")  # the same object: its pairs are not written again
    assert board.read() == (2, 6.0, 1.0, context, "second")
    board.disarm()
    board.arm(7.0, 1.0, context, "third")
    assert board.read() == (3, 7.0, 1.0, context, "third")
    wider = context | {(13, 102)}
    board.arm(8.0, 1.0, wider, "fourth")
    assert board.read() == (4, 8.0, 1.0, wider, "fourth")
    board.arm(9.0, 1.0, frozenset(), "fifth")
    assert board.read() == (5, 9.0, 1.0, frozenset(), "fifth")

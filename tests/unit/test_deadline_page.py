"""The monitor's deadline page (a seqlock): no torn read while it is written, and its writers
take turns (the test's thread and the watchdog's both write it)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from pytest_torchhang.monitor.page import INF, DeadlineBoard, stopped_within

ROUNDS = 3000


def _write(board: DeadlineBoard, lock: threading.Lock, writer: int, stop: threading.Event) -> None:
    for i in range(ROUNDS):
        value = float(writer * 1_000_000 + i)
        # every field of one write says the same number: a read that mixes two writes shows it
        with lock:
            board.arm(value, value, [(writer, i)] * (i % 7 + 1), f"test-{value:.0f}")
    stop.set()


def test_reads_are_never_torn_while_two_threads_take_turns_writing(tmp_path: Path) -> None:
    path = str(tmp_path / "page")
    writer_side = DeadlineBoard(path, create=True)
    reader_side = DeadlineBoard(path)  # a second mapping, as the monitor process has
    lock = threading.Lock()
    stops = [threading.Event(), threading.Event()]
    threads = [
        threading.Thread(target=_write, args=(writer_side, lock, n + 1, stops[n])) for n in range(2)
    ]
    for thread in threads:
        thread.start()
    reads = 0
    while not all(stop.is_set() for stop in stops) or reads == 0:
        got = reader_side.read()
        if got is None:
            continue
        _, deadline, timeout, before, test_id = got
        assert deadline == timeout, got
        assert test_id == f"test-{deadline:.0f}", got
        writer = int(deadline) // 1_000_000
        assert {pair[0] for pair in before} == {writer}, got
        reads += 1
    for thread in threads:
        thread.join(timeout=30)
        assert not thread.is_alive()
    assert reads > 0


def test_a_disarmed_page_reads_as_nothing_and_a_new_arm_has_a_new_generation(
    tmp_path: Path,
) -> None:
    board = DeadlineBoard(str(tmp_path / "page"), create=True)
    assert board.read() is None
    board.arm(10.0, 5.0, [(1, 2)], "t::a")
    first = board.read()
    board.disarm()
    assert board.read() is None
    board.arm(20.0, 5.0, [], "t::b")
    second = board.read()
    assert first is not None and second is not None
    assert second[0] == first[0] + 1
    assert second[1:] == (20.0, 5.0, frozenset(), "t::b")


# --- the watchdog's heartbeat and the monitor's stop log ------------------------------------


def test_the_watchdogs_heartbeat_reaches_the_monitor(tmp_path: Path) -> None:
    path = str(tmp_path / "page")
    pytest_side = DeadlineBoard(path, create=True)
    monitor_side = DeadlineBoard(path)
    assert monitor_side.last_beat() is None  # before the watchdog's first run
    pytest_side.beat(12.5, 4242)
    pytest_side.beat(13.5, 4242)
    assert monitor_side.last_beat() == (4242, 13.5)
    assert monitor_side.busy_since() == 0.0
    pytest_side.beat(14.0, 4242, busy=True)  # it goes on to act: until its next beat
    assert monitor_side.busy_since() == 14.0 and monitor_side.last_beat() == (4242, 14.0)
    pytest_side.beat(17.5, 4242)
    assert monitor_side.busy_since() == 0.0


@pytest.mark.parametrize(
    ("stops", "since", "now", "expected"),
    [
        ([], 0.0, 10.0, 0.0),
        ([(2.0, 5.0)], 0.0, 10.0, 3.0),
        ([(2.0, 5.0)], 3.0, 10.0, 2.0),  # counted already up to 3
        ([(2.0, 5.0)], 6.0, 10.0, 0.0),  # over before
        ([(2.0, 5.0), (7.0, 8.5)], 0.0, 10.0, 4.5),
        ([(7.0, INF)], 0.0, 10.0, 3.0),  # not seen ending yet: the asker runs, so until now
        ([(7.0, INF)], 9.0, 10.0, 1.0),
    ],
)
def test_stopped_within_counts_the_stops_between_two_times(
    stops: list[tuple[float, float]], since: float, now: float, expected: float
) -> None:
    assert stopped_within(stops, since, now) == pytest.approx(expected)


def test_the_monitors_stop_log_reaches_the_watchdog(tmp_path: Path) -> None:
    path = str(tmp_path / "page")
    pytest_side = DeadlineBoard(path, create=True)
    monitor_side = DeadlineBoard(path)
    assert pytest_side.stopped_between(0.0, 100.0) == 0.0
    monitor_side.stop_began(10.0)
    assert pytest_side.stopped_between(0.0, 12.0) == 2.0  # still stopped, as far as it saw
    monitor_side.stop_ended(25.0)
    monitor_side.stop_ended(99.0)  # no stop under way: nothing to end
    assert pytest_side.stopped_between(0.0, 100.0) == 15.0
    # a monitor restarted (the first one died) goes on with the same log
    DeadlineBoard(path).stop_began(40.0)
    DeadlineBoard(path).stop_ended(41.0)
    assert pytest_side.stopped_between(0.0, 100.0) == 16.0
    # arming and disarming deadlines leaves the log alone
    pytest_side.arm(50.0, 5.0, [(1, 2)] * DeadlineBoard.MAX_PAIRS, "t::x")
    pytest_side.disarm()
    assert pytest_side.stopped_between(0.0, 100.0) == 16.0


def test_the_stop_log_keeps_the_latest_stops(tmp_path: Path) -> None:
    path = str(tmp_path / "page")
    pytest_side = DeadlineBoard(path, create=True)
    monitor_side = DeadlineBoard(path)
    for i in range(500):  # more than the ring holds: the oldest go
        monitor_side.stop_began(float(2 * i))
        monitor_side.stop_ended(float(2 * i + 1))
    assert pytest_side.stopped_between(979.0, 1000.0) == 10.0  # 980-981, ..., 998-999
    assert pytest_side.stopped_between(0.0, 1000.0) == 128.0  # the ring's 128, one second each

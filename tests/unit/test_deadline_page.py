"""The monitor's deadline page (a seqlock): no torn read while it is written, and its writers
take turns (the test's thread and the watchdog's both write it)."""

from __future__ import annotations

import threading
from pathlib import Path

from pytest_torchhang.monitor.page import DeadlineBoard

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

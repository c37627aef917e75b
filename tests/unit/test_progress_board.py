"""The progress board: beats counted right, never a torn read, and one board per test."""

from __future__ import annotations

import mmap
import os
import signal
import sys
import threading
import time
import types
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pytest_torchhang.inject import beats, hook
from pytest_torchhang.inject.beats import COLLECTIVE, DATALOADER, EXPLICIT, OPTIMIZER

SECOND = 1_000_000_000  # the board's clock counts nanoseconds
BOUND_S = 30.0  # how long anything here may take before the test gives up on it


@pytest.fixture
def boards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory for boards; afterwards this process beats into none and its environment
    names none (as the session leaves it between tests)."""
    monkeypatch.delenv(beats.PROGRESS_ENV, raising=False)
    monkeypatch.setattr(beats._Board, "failures", [])
    monkeypatch.setattr(beats._Board, "looked", None)
    yield tmp_path
    beats.detach()
    beats.end_session(str(tmp_path))  # as the session's end does


def clock(*seconds: float) -> Callable[[], int]:
    """A board clock that reads ``seconds`` one after the other."""
    times = iter(seconds)
    return lambda: int(next(times) * SECOND)


def wait_for(condition: Callable[[], bool], what: str) -> None:
    """Poll ``condition`` until it holds; fail after ``BOUND_S``."""
    deadline = time.monotonic() + BOUND_S
    while not condition():
        assert time.monotonic() < deadline, f"still waiting, after {BOUND_S}s, for {what}"
        time.sleep(0.001)


def fork(work: Callable[[], None]) -> int:
    """Run ``work`` in a forked child that exits when it returns (status 0) or raises (1)."""
    with warnings.catch_warnings():
        # the child runs only ``work``: pure Python on a page, needing no other thread's lock
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        code = 1
        try:
            work()
            code = 0
        finally:
            os._exit(code)
    return pid


def reap(pid: int, kill: bool = False) -> int:
    """The wait status of child ``pid`` (SIGKILLed first with ``kill``, or after ``BOUND_S``)."""
    if kill:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + BOUND_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            return os.waitpid(pid, 0)[1]
        time.sleep(0.001)


def beat_until_killed(kind: int) -> Callable[[], None]:
    """A child's work: beat ``kind`` into whatever board this process has, for ``BOUND_S`` at most."""

    def work() -> None:
        deadline = time.monotonic() + BOUND_S
        while time.monotonic() < deadline:
            for _ in range(100):
                beats.beat(kind)

    return work


def test_counts_first_and_last_times_are_those_of_the_beats(boards: Path) -> None:
    reader = beats.new_board(str(boards), 1)
    try:
        assert reader.snapshot().counts == [0, 0, 0, 0] and reader.last() == 0.0
        for at in (10.0, 10.5, 11.0):
            beats.beat(OPTIMIZER, _now=clock(at))
        beats.beat(DATALOADER, number=7, epoch=3, _now=clock(12.25))
        snapshot = reader.snapshot()
        assert snapshot.counts == [1, 3, 0, 0]
        assert snapshot.first[OPTIMIZER] == 10.0 and snapshot.latest[OPTIMIZER] == 11.0
        assert snapshot.first[DATALOADER] == snapshot.latest[DATALOADER] == 12.25
        assert snapshot.last == reader.last() == 12.25
        assert (snapshot.kind, snapshot.number, snapshot.epoch) == (DATALOADER, 7, 3)
        assert snapshot.pid == os.getpid()
    finally:
        beats.end_board(reader)


def test_a_beat_without_a_number_is_numbered_by_its_count(boards: Path) -> None:
    reader = beats.new_board(str(boards), 1)
    try:
        for _ in range(5):
            beats.beat(COLLECTIVE)
        snapshot = reader.snapshot()
        assert (snapshot.kind, snapshot.number, snapshot.counts[COLLECTIVE]) == (COLLECTIVE, 5, 5)
    finally:
        beats.end_board(reader)


def test_rates_are_beats_per_second_between_the_first_and_the_last(boards: Path) -> None:
    reader = beats.new_board(str(boards), 1)
    try:
        for step in range(11):  # 10 intervals over 2 s
            beats.beat(DATALOADER, number=step + 1, _now=clock(100.0 + step * 0.2))
        beats.beat(OPTIMIZER, _now=clock(101.0))
        beats.beat(COLLECTIVE, _now=clock(101.0))
        beats.beat(COLLECTIVE, _now=clock(101.0))
        snapshot = reader.snapshot()
        assert snapshot.rate(DATALOADER) == pytest.approx(5.0)
        assert snapshot.rate(OPTIMIZER) is None  # one beat: no interval yet
        assert snapshot.rate(COLLECTIVE) is None  # no time between them
        assert snapshot.rate(EXPLICIT) is None
    finally:
        beats.end_board(reader)


def test_describe_last_names_the_last_beat_and_its_process(boards: Path) -> None:
    reader = beats.new_board(str(boards), 1)
    me = os.getpid()
    try:
        assert reader.snapshot().describe_last() == ""
        beats.beat(DATALOADER, number=812, epoch=3)
        assert reader.snapshot().describe_last() == f"DataLoader batch 812 of epoch 3 (pid {me})"
        beats.beat(DATALOADER, number=4)  # no epoch known
        assert reader.snapshot().describe_last() == f"DataLoader batch 4 (pid {me})"
        beats.beat(OPTIMIZER)
        assert reader.snapshot().describe_last() == f"optimizer step 1 (pid {me})"
        beats.progress("epoch 3, step 120")
        assert reader.snapshot().describe_last() == f"progress('epoch 3, step 120') (pid {me})"
        beats.progress()  # no note: the last one still says where the loop was
        assert reader.snapshot().note == "epoch 3, step 120"
    finally:
        beats.end_board(reader)


def test_a_long_note_is_cut_to_its_slot_and_a_mismatched_one_is_not_shown(boards: Path) -> None:
    reader = beats.new_board(str(boards), 1)
    try:
        beats.progress("é" * 200)  # 400 bytes, cut inside a character
        note = reader.snapshot().note
        assert note.startswith("é" * 127) and len(note.encode()) <= 256 + 2
        beats.progress("short")
        assert reader.snapshot().note == "short"
        # another process's copy landing over this one's, half way: the text no longer
        # matches its CRC, and the reader says nothing rather than a mix of the two
        page = beats._Board.page
        assert page is not None
        start = beats._NOTE_AT + beats._NOTE_HEADER.size
        page[start : start + 3] = b"lon"
        assert reader.snapshot().note == ""
    finally:
        beats.end_board(reader)


def _consistent(snapshot: beats.Snapshot, writers: dict[int, tuple[int, int]]) -> str:
    """Why ``snapshot`` is torn ('' when it is not): its last beat must be one writer's whole
    beat (kind, epoch and the parity of the number are what that writer writes), and the
    last time must come with a count and a first time of the last beat's kind."""
    if snapshot.last == 0.0:
        return "" if snapshot.kind == -1 else f"a last beat {snapshot.kind} without a time"
    if snapshot.kind == EXPLICIT:
        return "" if snapshot.counts[EXPLICIT] >= 1 else "a note's beat without a count"
    if snapshot.kind not in writers:
        return f"a last beat of kind {snapshot.kind} nobody wrote"
    epoch, parity = writers[snapshot.kind]
    if (snapshot.epoch, snapshot.number % 2) != (epoch, parity):
        return f"beat mixed from two writers: {snapshot.describe_last()}"
    if snapshot.counts[snapshot.kind] < 1 or snapshot.first[snapshot.kind] <= 0:
        return f"a last beat whose kind has no count: {snapshot.counts}"
    return ""


def test_two_threads_beating_never_give_a_torn_read(boards: Path) -> None:
    reader = beats.new_board(str(boards), 1)
    writers = {DATALOADER: (1, 1), COLLECTIVE: (2, 0)}  # kind: (epoch, number parity)
    made = dict.fromkeys(writers, 0)
    stop = threading.Event()

    def write(kind: int) -> None:
        epoch, parity = writers[kind]
        deadline = time.monotonic() + BOUND_S
        i = 0
        while not stop.is_set() and time.monotonic() < deadline:
            for _ in range(100):
                i += 1
                beats.beat(kind, number=2 * i - parity, epoch=epoch)
            made[kind] = i

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads between any two stores of a beat
    threads = [threading.Thread(target=write, args=(k,), daemon=True) for k in writers]
    seen: dict[int, int] = {}  # kind -> reads that showed it as the last beat
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + BOUND_S
        while min(seen.get(k, 0) for k in writers) < 500 and time.monotonic() < deadline:
            snapshot = reader.snapshot()
            assert not (why := _consistent(snapshot, writers)), why
            seen[snapshot.kind] = seen.get(snapshot.kind, 0) + 1
        stop.set()
        for thread in threads:
            thread.join(BOUND_S)
        final = reader.snapshot()
    finally:
        stop.set()
        sys.setswitchinterval(interval)
        beats.end_board(reader)
    assert min(seen.get(k, 0) for k in writers) >= 500, f"the reads did not overlap both: {seen}"
    assert not _consistent(final, writers)
    for kind in writers:  # a lost count is possible, a count never made is not
        assert 1 <= final.counts[kind] <= made[kind]


def test_two_processes_beating_never_give_a_torn_read(boards: Path) -> None:
    reader = beats.new_board(str(boards), 1)
    writers = {DATALOADER: (1, 1), COLLECTIVE: (2, 0)}
    notes = {DATALOADER: "a" * 17, COLLECTIVE: "b" * 201}
    stop = mmap.mmap(-1, 1)  # shared with the children: a byte the reader sets when done

    def write(kind: int) -> Callable[[], None]:
        def work() -> None:
            epoch, parity = writers[kind]
            deadline = time.monotonic() + BOUND_S
            i = 0
            while stop[0] == 0 and time.monotonic() < deadline:
                for _ in range(100):
                    i += 1
                    beats.beat(kind, number=2 * i - parity, epoch=epoch)
                    beats.progress(notes[kind])

        return work

    pids = [fork(write(kind)) for kind in writers]  # each inherits this process's mapping
    seen_pids: dict[int, int] = {}
    seen_notes: set[str] = set()
    deadline = time.monotonic() + BOUND_S
    try:
        while (
            min(seen_pids.get(pid, 0) for pid in pids) < 500
            or not set(notes.values()) <= seen_notes
        ) and time.monotonic() < deadline:
            snapshot = reader.snapshot()
            assert not (why := _consistent(snapshot, writers)), why
            assert snapshot.note in {"", *notes.values()}, f"a torn note: {snapshot.note!r}"
            seen_pids[snapshot.pid] = seen_pids.get(snapshot.pid, 0) + 1
            seen_notes.add(snapshot.note)
    finally:
        stop[0] = 1
        statuses = [reap(pid) for pid in pids]
        beats.end_board(reader)
    assert statuses == [0, 0], statuses
    assert min(seen_pids.get(pid, 0) for pid in pids) >= 500, f"reads did not overlap: {seen_pids}"
    assert set(notes.values()) <= seen_notes


def test_a_new_board_is_not_fed_by_a_process_attached_to_the_previous_one(boards: Path) -> None:
    first = beats.new_board(str(boards), 1)
    left = fork(beat_until_killed(EXPLICIT))  # as a worker an earlier test left running
    try:
        watching = beats.Reader(first.path)  # stays readable after the file is gone
        wait_for(lambda: watching.snapshot().counts[EXPLICIT] >= 100, "the child's beats")
        beats.end_board(first)
        assert not os.path.exists(first.path)
        pointer = os.environ[beats.PROGRESS_ENV]  # set once: it names the session's pointer
        assert not os.path.lexists(pointer)  # which names no board between tests
        second = beats.new_board(str(boards), 2)
        assert os.environ[beats.PROGRESS_ENV] == pointer
        assert os.path.realpath(pointer) == os.path.realpath(second.path) != first.path
        after = watching.snapshot().counts[EXPLICIT]
        wait_for(
            lambda: watching.snapshot().counts[EXPLICIT] >= after + 1000,
            "the child to go on beating after the new board was made",
        )
        assert second.snapshot().counts == [0, 0, 0, 0]
        assert second.last() == 0.0
        beats.beat(OPTIMIZER)  # this process beats into the new board
        assert second.snapshot().counts == [0, 1, 0, 0]
        beats.end_board(second)
    finally:
        status = reap(left, kill=True)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status


def test_a_board_that_ended_keeps_its_last_state_for_a_late_report(boards: Path) -> None:
    reader = beats.new_board(str(boards), 1)
    beats.progress("last words")
    beats.end_board(reader)
    assert not beats.attach()  # nothing named any more, nothing beaten into
    beats.progress("after the test")
    assert reader.snapshot().note == "last words"
    assert reader.snapshot().counts == [0, 0, 0, 1] and reader.last() > 0


@pytest.mark.parametrize("make", ["new_board", "create"])
def test_a_process_beating_while_boards_are_made_never_dies_of_sigbus(
    boards: Path, make: str
) -> None:
    """The old ``create`` truncated the board to nothing and back: a child writing to it in
    between died of SIGBUS (signal 7) within about 1,500 boards here."""
    if make == "create":
        path = str(boards / "board")
        beats.create(path)
        assert beats.attach(path)
    else:  # the same name each time: a reused pid and serial
        path = beats.new_board(str(boards), 1).path
    watching = beats.Reader(path)
    writer = fork(beat_until_killed(DATALOADER))  # beats into this process's board, inherited
    made = 0
    try:
        wait_for(lambda: watching.snapshot().counts[DATALOADER] > 0, "the child's beats")
        deadline = time.monotonic() + 2.0
        while made < 20_000 and time.monotonic() < deadline:
            if make == "create":
                beats.create(path)
            else:
                beats.end_board(beats.new_board(str(boards), 1))
            made += 1
            if made % 100 == 0:
                assert os.waitpid(writer, os.WNOHANG)[0] == 0, f"the writer died after {made}"
        # still beating: into the wiped file, or into the first board's file, now unnamed
        before = watching.snapshot().counts[DATALOADER]
        wait_for(lambda: watching.snapshot().counts[DATALOADER] > before, "beats after that")
    finally:
        status = reap(writer, kill=True)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (status, made)


def test_a_patch_that_fails_is_noted_for_the_report_in_every_process(
    boards: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    notes = boards / "dumps"
    notes.mkdir()
    monkeypatch.setattr(hook._Registration, "dump_dir", str(notes))
    reader = beats.new_board(str(boards), 1)  # installed: fork children say it again
    try:
        # a torch whose DataLoader module lacks the iterator class the patch wraps
        beats._apply("torch.utils.data.dataloader", types.ModuleType("dataloader"))
        beats._apply("torch.optim.optimizer", types.ModuleType("optimizer"))
        child = fork(lambda: None)
        assert reap(child) == 0
    finally:
        beats.end_board(reader)
    # the next test's capture reads only notes written since it began: said again for it
    beats.end_board(beats.new_board(str(boards), 2))
    mine = Path(hook.notes_path(str(notes), os.getpid())).read_text()
    assert mine.count("could not patch torch.optim.optimizer") == 2, mine
    for pid in (os.getpid(), child):
        text = Path(hook.notes_path(str(notes), pid)).read_text()
        assert "could not patch torch.utils.data.dataloader (AttributeError" in text, text
        assert "DataLoader batches do not count as progress in this process" in text
        assert "could not patch torch.optim.optimizer" in text
        assert "optimizer steps do not count as progress" in text


def test_the_environment_is_set_once_a_session_not_once_a_test(
    boards: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A setenv per test races the native threads (OpenMP, CUDA) that read the environment."""
    writes: list[str] = []
    real_setitem = type(os.environ).__setitem__

    def setitem(env: os._Environ[str], key: str, value: str) -> None:
        writes.append(key)
        real_setitem(env, key, value)

    with monkeypatch.context() as patched:
        patched.setattr(type(os.environ), "__setitem__", setitem)
        for serial in range(1, 4):
            beats.end_board(beats.new_board(str(boards), serial))
    assert writes == [beats.PROGRESS_ENV]
    beats.end_session(str(boards))
    assert beats.PROGRESS_ENV not in os.environ


def test_a_process_that_found_no_board_never_joins_a_later_test_s(boards: Path) -> None:
    beats.end_board(beats.new_board(str(boards), 1))
    go_r, go_w = os.pipe()

    def between_tests() -> None:  # started between two tests, left running into the next
        assert not beats.attach()  # it looks: the pointer names no board now
        os.read(go_r, 1)  # the next test has begun
        beats.progress("from a process an earlier test left")
        beats.beat(EXPLICIT)

    left = fork(between_tests)
    try:
        second = beats.new_board(str(boards), 2)
    finally:
        os.write(go_w, b"x")
    try:
        assert os.waitstatus_to_exitcode(reap(left)) == 0
        assert second.snapshot().counts == [0, 0, 0, 0]
        beats.progress("from this test")  # this process's own new test: it looked again
        assert second.snapshot().counts[EXPLICIT] == 1
    finally:
        beats.end_board(second)
        os.close(go_r)
        os.close(go_w)

"""asyncio tasks: the snapshot of real running loops, their place in the report, and the rule
replayed on reports recorded from real pytest-asyncio hangs (``record_asyncio.py``)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from pytest_torchhang.capture import aio
from pytest_torchhang.diagnosis import engine, frames
from pytest_torchhang.diagnosis.rules.aio import hint_asyncio
from pytest_torchhang.inject import hook
from pytest_torchhang.report.model import HangReport, ProcessReport
from pytest_torchhang.report.text import _loop_lines, to_text

DATA = Path(__file__).parent / "data" / "asyncio"
RECORDED = sorted(DATA.glob("test_*.json"))


# --- the snapshot, read from real loops run in a thread --------------------------------------


@contextmanager
def running(
    main: Callable[[], Coroutine[Any, Any, object]], ready: Callable[[list[dict[str, Any]]], bool]
) -> Iterator[list[dict[str, Any]]]:
    """Run ``main()`` on a loop of its own thread, until ``ready(snapshot)``; yields that
    snapshot (taken from this thread, as the capture does), then cancels the loop's tasks."""
    box: dict[str, asyncio.AbstractEventLoop] = {}

    async def host() -> None:
        box["loop"] = asyncio.get_running_loop()
        with suppress(asyncio.CancelledError):
            await main()

    thread = threading.Thread(target=asyncio.run, args=(host(),), name="loop", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        snapshot = hook.asyncio_snapshot()
        while not ("loop" in box and ready(snapshot)):
            assert time.monotonic() < deadline, f"the loop never got ready: {snapshot}"
            time.sleep(0.01)
            snapshot = hook.asyncio_snapshot()
        yield snapshot
    finally:
        loop = box.get("loop")
        if loop is not None and not loop.is_closed():
            with_tasks = asyncio.all_tasks
            loop.call_soon_threadsafe(lambda: [t.cancel() for t in with_tasks(loop)])
        thread.join(10)
        assert not thread.is_alive()


def _task(snapshot: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    rows = [t for loop in snapshot for t in loop["tasks"] if t["name"] == name]
    return rows[0] if rows else None


def _awaiting(name: str, kind: str) -> Callable[[list[dict[str, Any]]], bool]:
    def ready(snapshot: list[dict[str, Any]]) -> bool:
        task = _task(snapshot, name)
        return task is not None and task["awaits"]["kind"] == kind

    return ready


def test_a_task_awaiting_an_event_shows_each_coroutine_frame_and_the_event() -> None:
    event = asyncio.Event()

    async def inner() -> None:
        await event.wait()

    async def main() -> None:
        await asyncio.create_task(inner(), name="inner")

    with running(main, _awaiting("inner", "Event")) as snapshot:
        (loop,) = snapshot
        task = _task(snapshot, "inner")
    assert loop["thread_name"] == "loop"
    text = "\n".join(
        _loop_lines(aio.loops_of(snapshot)[0], ProcessReport(0, 0, "", "", "", 0, 0, 0, 0, 0, "ok"))
    )
    assert text.startswith(f'    asyncio loop in thread {loop["thread"]} "loop" (asyncio.')
    assert (loop["ready"], loop["timers"], loop["fds"], loop["signal_handlers"]) == (0, 0, 0, 0)
    assert task is not None
    names = [frame[2] for frame in task["frames"]]  # most recent call first
    assert names[0].endswith("wait") and names[-1].endswith("inner")
    assert task["frames"][-1][0] == __file__
    assert task["awaits"]["call"] == "Event.wait()"
    assert task["awaits"]["detail"] == "not set"
    assert task["awaits"]["obj"] == id(event)
    assert task["timed"] is False and task["state"] == "pending"
    outer = next(t for t in loop["tasks"] if t["name"] != "inner")
    assert outer["awaits"]["kind"] == "task" and outer["awaits"]["tasks"] == ["inner"]


def test_a_queue_a_lock_and_a_gather_are_told_apart() -> None:
    queue: asyncio.Queue[int] = asyncio.Queue(maxsize=3)
    lock = asyncio.Lock()

    async def consume() -> int:
        return await queue.get()

    async def take(held: asyncio.Lock) -> None:
        async with held:
            pass

    async def main() -> None:
        async with lock:
            await asyncio.gather(
                asyncio.create_task(consume(), name="consumer"),
                asyncio.create_task(take(lock), name="taker"),
            )

    def ready(snapshot: list[dict[str, Any]]) -> bool:
        return _awaiting("consumer", "Queue")(snapshot) and _awaiting("taker", "Lock")(snapshot)

    with running(main, ready) as snapshot:
        consumer, taker = _task(snapshot, "consumer"), _task(snapshot, "taker")
        (gathering,) = [t for t in snapshot[0]["tasks"] if t["awaits"]["kind"] == "gather"]
    assert consumer is not None and taker is not None
    assert consumer["awaits"]["call"] == "Queue.get()"
    assert consumer["awaits"]["detail"] == "0 item(s) of 3"
    assert taker["awaits"]["call"] == "Lock.acquire()"
    assert taker["awaits"]["detail"] == "locked"
    assert sorted(gathering["awaits"]["tasks"]) == ["consumer", "taker"]
    # the task that holds the lock in a local: kept as a reference to an awaited primitive
    assert id(lock) in gathering["refs"] and id(lock) in taker["refs"]
    assert id(lock) not in consumer["refs"]


def test_a_queue_join_is_told_as_the_join_not_as_the_event_it_awaits_inside() -> None:
    queue: asyncio.Queue[int] = asyncio.Queue()

    async def main() -> None:
        queue.put_nowait(1)
        await queue.get()  # taken, never task_done()
        await asyncio.create_task(queue.join(), name="joiner")

    with running(main, _awaiting("joiner", "Queue")) as snapshot:
        joiner = _task(snapshot, "joiner")
    assert joiner is not None
    assert joiner["awaits"]["call"] == "Queue.join()"
    assert joiner["awaits"]["detail"] == "0 item(s) of unbounded, 1 not task_done()"
    assert [frame[2].rpartition(".")[2] for frame in joiner["frames"]] == ["wait", "join"]


def test_the_chain_goes_on_into_the_async_generator_a_frame_awaits() -> None:
    event = asyncio.Event()

    async def source() -> Any:
        await event.wait()
        yield 1

    async def iterates() -> None:
        async for _ in source():  # kept on the frame's value stack, not in a local
            pass

    generator = source()

    async def steps() -> object:  # pytest-asyncio's fixture setup: the generator in a cell
        return await generator.__anext__()

    async def main() -> None:
        await asyncio.gather(
            asyncio.create_task(iterates(), name="iterates"),
            asyncio.create_task(steps(), name="steps"),
        )

    def ready(snapshot: list[dict[str, Any]]) -> bool:
        return _awaiting("iterates", "Event")(snapshot) and _awaiting("steps", "Event")(snapshot)

    with running(main, ready) as snapshot:
        rows = [_task(snapshot, "iterates"), _task(snapshot, "steps")]
    for row, outer in zip(rows, ["iterates", "steps"], strict=True):
        assert row is not None
        names = [frame[2].rpartition(".")[2] for frame in row["frames"]]
        assert names == ["wait", "source", outer]


@pytest.mark.parametrize("how", ["sleep", "wait_for", "timeout"])
def test_a_wait_that_a_timer_of_the_loop_ends_is_timed(how: str) -> None:
    if how == "timeout" and sys.version_info < (3, 11):
        pytest.skip("asyncio.timeout() is new in 3.11")
    event = asyncio.Event()

    async def waits() -> None:
        if how == "sleep":
            await asyncio.sleep(600)
        elif how == "wait_for":
            await asyncio.wait_for(event.wait(), 600)
        else:
            async with asyncio.timeout(600):  # type: ignore[attr-defined,unused-ignore]
                await event.wait()

    async def main() -> None:
        await asyncio.create_task(waits(), name="waits")

    def ready(snapshot: list[dict[str, Any]]) -> bool:
        task = _task(snapshot, "waits")
        return task is not None and snapshot[0]["timers"] == 1

    with running(main, ready) as snapshot:
        task = _task(snapshot, "waits")
    assert task is not None and task["timed"] is True


def test_the_file_descriptors_a_loop_watches_count_as_what_could_wake_it() -> None:
    left, right = socket.socketpair()

    async def main() -> None:
        asyncio.get_running_loop().add_reader(left.fileno(), lambda: None)
        await asyncio.Event().wait()

    try:
        with running(main, lambda s: bool(s) and s[0]["fds"] == 1) as snapshot:
            (loop,) = snapshot
        assert (loop["ready"], loop["timers"], loop["fds"]) == (0, 0, 1)
    finally:
        left.close()
        right.close()


def test_a_python_signal_handler_of_the_users_counts_as_what_could_wake_the_loop() -> None:
    async def main() -> None:
        await asyncio.Event().wait()

    def users(signum: int, frame: object) -> None:
        pass

    with running(main, lambda s: bool(s)) as snapshot:
        before = snapshot[0]["signal_handlers"]
        previous = signal.signal(signal.SIGUSR2, users)
        try:
            after = hook.asyncio_snapshot()[0]["signal_handlers"]
        finally:
            signal.signal(signal.SIGUSR2, previous)
    assert after == before + 1


def test_a_snapshot_is_bounded_and_counts_the_tasks_it_leaves_out() -> None:
    many = hook.MAX_TASKS + 7

    async def main() -> None:
        event = asyncio.Event()
        await asyncio.gather(*(event.wait() for _ in range(many)))

    def ready(snapshot: list[dict[str, Any]]) -> bool:
        return bool(snapshot) and len(snapshot[0]["tasks"]) + snapshot[0]["tasks_left_out"] > many

    with running(main, ready) as snapshot:
        (loop,) = snapshot
    assert len(loop["tasks"]) == hook.MAX_TASKS
    assert loop["tasks_left_out"] == many + 1 - hook.MAX_TASKS  # the gathering task too


def test_a_loop_that_does_not_run_has_nothing_stuck() -> None:
    loop = asyncio.new_event_loop()
    try:
        task = loop.create_task(asyncio.Event().wait(), name="never run")
        assert all(t["name"] != "never run" for lp in hook.asyncio_snapshot() for t in lp["tasks"])
        task.cancel()
        loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
    finally:
        loop.close()


def test_the_python_half_of_the_dump_handler_is_never_put_in_place_of_a_users_handler() -> None:
    def users(signum: int, frame: object) -> None:
        pass

    if hook._Registration.file is not None:
        pytest.skip("this process answers the dump signal: its handler stays untouched")
    previous = signal.signal(hook.DUMP_SIGNAL, users)
    try:
        assert hook._chain_python_handler() is False
        assert signal.getsignal(hook.DUMP_SIGNAL) is users
    finally:
        signal.signal(hook.DUMP_SIGNAL, previous)


def test_the_python_half_of_the_dump_handler_is_installed_from_the_main_thread_only() -> None:
    if hook._Registration.file is not None:
        pytest.skip("this process answers the dump signal: its handler stays untouched")
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(hook._chain_python_handler()))
    thread.start()
    thread.join(10)
    assert result == [False]


def test_tasks_are_listed_as_pstree_does_each_above_the_tasks_it_awaits() -> None:
    from pytest_torchhang.report.model import AsyncTask

    leaf = AsyncTask("leaf", awaits="Event")
    middle = AsyncTask("middle", awaits="gather", awaits_tasks=["leaf", "other"])
    other = AsyncTask("other", awaits="Queue")
    root = AsyncTask("root", awaits="task", awaits_tasks=["middle"])
    loop_a = AsyncTask("a", awaits="task", awaits_tasks=["b"])  # a cycle: each listed once
    loop_b = AsyncTask("b", awaits="task", awaits_tasks=["a"])
    order = aio.tree_order([leaf, other, loop_a, middle, loop_b, root])
    assert [t.name for t in order] == ["root", "middle", "leaf", "other", "a", "b"]


def test_a_childs_answer_counts_only_when_written_since_the_capture_began_and_is_awaited_briefly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The answer is the one the dump handler's Python half writes (``_write_tasks``), read for
    a child of a recorded report (its pid, its stacks that run a loop)."""
    doc = json.loads((DATA / "test_a_child_process_whose_loop_is_stuck.json").read_text())
    child = next(p for p in HangReport.from_json(doc).processes if p.event_loops)
    event = asyncio.Event()

    async def main() -> None:
        await asyncio.create_task(event.wait(), name="answering")

    monkeypatch.setattr(hook._Registration, "dump_dir", str(tmp_path))
    with running(main, _awaiting("answering", "Event")):
        began = time.time()
        hook._write_tasks()
    Path(hook.tasks_path(str(tmp_path), os.getpid())).rename(
        hook.tasks_path(str(tmp_path), child.pid)
    )
    child.event_loops = []
    assert aio.add_tasks([child], str(tmp_path), began, 0.2) == []
    assert [t.name for loop in child.event_loops for t in loop.tasks][-1] == "answering"
    child.event_loops = []
    start = time.monotonic()
    (note,) = aio.add_tasks([child], str(tmp_path), time.time() + 60, 0.2)  # an older answer
    assert time.monotonic() - start < 2
    assert child.event_loops == [] and "its tasks did not come within 0.2s" in note


# --- reports recorded from real hangs --------------------------------------------------------


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], HangReport]:
    """A recorded report by its test's name, diagnosed as on the recording machine (its stdlib
    is the library: ``frames.is_library``)."""
    machine = json.loads((DATA / "recording.json").read_text())
    monkeypatch.setattr(frames, "STDLIB", machine["stdlib"])

    def load(name: str) -> HangReport:
        return HangReport.from_json(json.loads((DATA / f"{name}.json").read_text()))

    return load


def _hint(report: HangReport) -> str:
    (hint,) = hint_asyncio(report.processes)
    assert hint.rule == "asyncio"
    return hint.text


def test_the_recordings_are_the_plugins_own_documents_with_a_loop_each() -> None:
    assert len(RECORDED) >= 8
    for path in RECORDED:
        doc = json.loads(path.read_text())
        assert doc["schema"] == "pytest-torchhang/hang-report"
        assert doc["test_id"].split("::")[-1] == path.stem
        assert any(p.get("event_loops") for p in doc["processes"]), path.name


@pytest.mark.parametrize("path", RECORDED, ids=[p.stem for p in RECORDED])
def test_a_recorded_report_with_tasks_survives_the_round_trip(path: Path) -> None:
    doc = json.loads(path.read_text())
    report = HangReport.from_json(doc)
    assert report.to_json() == doc
    again = HangReport.from_json(json.loads(json.dumps(report.to_json())))
    assert again == report and to_text(again) == to_text(report)


@pytest.mark.parametrize("path", RECORDED, ids=[p.stem for p in RECORDED])
def test_the_rule_replayed_gives_the_hints_and_headline_the_capture_gave(
    path: Path, recorded: Callable[[str], HangReport]
) -> None:
    report = recorded(path.stem)
    assert [asdict(h) for h in engine.hints(report.processes)] == [asdict(h) for h in report.hints]
    root = next(p for p in report.processes if p.role == "pytest")
    test = report.test_id + (f" (during {report.phase})" if report.phase != "call" else "")
    assert engine.headline(test, report.elapsed_s, report.processes, root.pid) == report.headline


def test_an_event_nobody_can_set_is_said_so_and_the_generic_select_hint_stays_silent(
    recorded: Callable[[str], HangReport],
) -> None:
    report = recorded("test_awaits_an_event_nobody_sets")
    (hint,) = engine.hints(report.processes)
    assert hint.rule == "asyncio"
    assert (
        "test_awaits_an_event_nobody_sets awaits Event.wait() in task 'Task-1' at "
        "test_event.py:9 (the event is not set); nothing in the process will set it." in hint.text
    )
    assert report.headline.endswith("stuck in Event.wait() (asyncio task 'Task-1')")
    text = to_text(report)
    assert "    asyncio loop in main thread " in text
    assert "      task 'Task-1' (test_awaits_an_event_nobody_sets) awaits Event.wait()" in text


def test_another_thread_a_timer_or_a_running_task_keep_the_rule_from_saying_nothing_will(
    recorded: Callable[[str], HangReport],
) -> None:
    beside = _hint(recorded("test_awaits_an_event_beside_another_thread"))
    assert "nothing in the process will" not in beside
    # the other end of the wait, with what it is doing (issue 28, item 2)
    assert (
        "only another thread of the process could end the wait ('bystander' waits in Event.wait())"
        in beside
    )
    timed = _hint(recorded("test_awaits_an_event_with_a_long_timeout"))
    assert "nothing in the process will" not in timed
    assert timed.endswith("Its event loop may still be woken by 1 timer(s).")
    assert "at locks.py" not in timed  # a task without a frame of the user's has no place
    blocked = _hint(recorded("test_awaits_an_event_a_blocking_task_would_set"))
    assert "nothing in the process will" not in blocked
    assert "Its event loop is running task 'announcer' (announce)" in blocked


def test_a_task_that_awaits_a_locked_lock_gets_the_tasks_that_refer_to_it_never_a_holder(
    recorded: Callable[[str], HangReport],
) -> None:
    text = _hint(recorded("test_a_gather_where_one_task_awaits_the_others_lock"))
    assert "holder awaits Event.wait() in task 'holder' at test_gather_lock.py:9" in text
    assert "waiter awaits Lock.acquire() in task 'waiter' at test_gather_lock.py:14" in text
    assert "'holder', which awaits Event.wait() at test_gather_lock.py:9" in text
    assert "nothing in the process will release it" in text
    assert "holds the lock" not in text  # asyncio's Lock keeps no owner


def test_a_childs_tasks_are_read_from_its_own_answer_and_explain_it(
    recorded: Callable[[str], HangReport],
) -> None:
    for name, role in [
        ("test_a_child_process_whose_loop_is_stuck", "Python child"),
        ("test_a_forked_child_whose_loop_is_stuck", "multiprocessing.Process(target=forked_loop)"),
    ]:
        report = recorded(name)
        (child,) = [p for p in report.processes if p.event_loops]
        assert child.role == role and child.pid != os_getpid_of(report)
        (hint,) = [h for h in engine.hints(report.processes) if h.rule == "asyncio"]
        assert hint.pids == [child.pid, os_getpid_of(report)]  # and the parent waiting for it
        assert hint.text.startswith(f"{role} (pid {child.pid}): serve awaits Event.wait()")
        assert "nothing in the process will set it" in hint.text
        assert f"Waiting for it: pytest (pid {os_getpid_of(report)}) waits in " in hint.text


def os_getpid_of(report: HangReport) -> int:
    """The pytest process of a recorded report."""
    return next(p.pid for p in report.processes if p.role == "pytest")


@pytest.mark.parametrize("path", RECORDED, ids=[p.stem for p in RECORDED])
def test_every_asyncio_recording_draws_a_valid_flowchart_and_renders_as_markdown(
    path: Path,
) -> None:
    from pytest_torchhang.report import views

    from .mermaid_flowchart import parse

    hang = HangReport.from_json(json.loads(path.read_text()))
    chart = parse(views.to_mermaid(hang))  # a task's name in quotes, its call in parentheses
    assert list(chart.nodes) == [n.key for n in views.build_graph(hang).nodes]
    assert hang.headline.split(": ", 1)[0] in views.to_markdown(hang)

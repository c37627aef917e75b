"""asyncio hangs (pytest-asyncio): each pending task's coroutine stack in the report, a hint that
says nothing will end the wait only when nothing can, and a session that goes on.

Every scenario module runs in one inner session (``batch``), each test here reading its own
scenario's report from it: ten hangs of 2 s pay pytest's start-up once. The settings that differ
(pytest-timeout's option, xdist) get sessions of their own."""

from __future__ import annotations

import pytest

from asyncio_scenarios import (
    CHILD,
    EVENT,
    FIXTURE,
    GATHER_LOCK,
    INI,
    MODULE_LOOP,
    MODULES,
    OTHER_THREAD,
    QUEUE,
    SYNC_RUN,
)
from conftest import GuardedRunner, Session, assert_hang, batch_runner
from outcomes import assert_outcomes

#: Inner sessions without pytest-rerunfailures' server thread, which could end any wait.
ALONE = ("-p", "no:rerunfailures")
#: The batch's order: the scenario that leaves a thread running in pytest (a bystander that
#: could end any wait, which the other hints must not count on) comes last.
ORDER = sorted(MODULES, key=lambda name: name == "test_other_thread")
#: Hangs and passes of the whole batch, by scenario module.
HANGS = {"test_child": 2, "test_fixture": 2}
PASSES = {"test_event": 1, "test_module_loop": 1, "test_sync_run": 1}


def _line(source: str, text: str, after: str = "") -> int:
    """The line of ``text`` (the first after the line with ``after``) in ``source`` as pytester
    writes it (its blank edges stripped)."""
    lines = source.strip("\n").splitlines()
    start = next(n for n, line in enumerate(lines) if after in line) if after else 0
    return next(n for n, line in enumerate(lines, 1) if n > start and text in line)


def _session(guarded: GuardedRunner, source: str, *args: str, **kwargs: object) -> Session:
    guarded.pytester.makeini(INI)
    guarded.pytester.makepyfile(source)
    session = guarded.run(*args, **kwargs)  # type: ignore[arg-type]
    assert "PytestDeprecationWarning" not in session.text  # the loop scope is set: no warning
    return session


@pytest.fixture(scope="module")
def batch(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Session:
    """Every scenario module in one session, under ``--torch-hang-timeout=2``."""
    with batch_runner(request, tmp_path_factory) as guarded:
        guarded.pytester.makeini(INI)
        guarded.pytester.makepyfile(**MODULES)
        return guarded.run(*ALONE, "-v", *(f"{name}.py" for name in ORDER), wait_s=300)


def _passed(session: Session, module: str, test_name: str) -> None:
    assert session.passed(f"{module}.py::{test_name}"), session.text[-6000:]


def test_the_batch_hangs_each_scenario_once_runs_the_next_tests_and_leaves_nothing(
    batch: Session,
) -> None:
    assert "PytestDeprecationWarning" not in batch.text  # the loop scope is set: no warning
    assert_outcomes(
        batch.result,
        hang=sum(HANGS.get(name, 1) for name in MODULES),
        passed=sum(PASSES.values()),
    )
    batch.assert_clean()


def test_an_awaited_event_nobody_sets_is_a_hang_with_its_task_and_the_next_async_test_runs(
    batch: Session,
) -> None:
    line = _line(EVENT, "await event.wait()")
    _passed(batch, "test_event", "test_the_next_async_test_runs")
    assert_hang(
        batch,
        "test_awaits_an_event_nobody_sets",
        "hint: pytest (pid *): test_awaits_an_event_nobody_sets awaits Event.wait() in task "
        f"'Task-*' at test_*.py:{line} (the event is not set); nothing in the process will set "
        "it. Its event loop has nothing that could wake it*, and the process has no other Python "
        "thread.",
        "    asyncio loop in main thread 0x* 1 pending task(s); what could still wake it: nothing",
        "      task 'Task-*' (test_awaits_an_event_nobody_sets) awaits Event.wait() [[]not set[]] "
        "(most recent call first):",
        '        File "*/asyncio/locks.py", line *, in *wait',
        f'        File "*test_*.py", line {line}, in test_awaits_an_event_nobody_sets',
        "            await event.wait()",
    )


def test_another_thread_of_the_process_keeps_the_hint_from_saying_nothing_will_set_it(
    batch: Session,
) -> None:
    line = _line(OTHER_THREAD, "await asyncio.Event().wait()")
    report = assert_hang(
        batch,
        "test_awaits_an_event_beside_another_thread",
        "hint: pytest (pid *): test_awaits_an_event_beside_another_thread awaits Event.wait() in "
        f"task 'Task-*' at test_*.py:{line} (the event is not set). Its event loop has nothing "
        "that could wake it*: only another thread of the process could end the wait "
        "('bystander' waits in *).",
    )
    assert "nothing in the process will" not in report


def test_a_wait_with_a_timeout_is_not_called_endless(batch: Session) -> None:
    report = assert_hang(
        batch,
        "test_awaits_an_event_with_a_long_timeout",
        "hint: pytest (pid *): * awaits Event.wait()* (the event is not set). Its event loop may "
        "still be woken by 1 timer(s).",
        "      task 'Task-*' (test_awaits_an_event_with_a_long_timeout) * with a timeout *",
    )
    assert "nothing in the process will" not in report


def test_a_task_blocking_the_loops_thread_is_named_and_no_wait_is_called_endless(
    batch: Session,
) -> None:
    report = assert_hang(
        batch,
        "test_awaits_an_event_a_blocking_task_would_set",
        "hint: pytest (pid *): test_awaits_an_event_a_blocking_task_would_set awaits Event.wait() "
        "in task 'Task-*' at test_*.py:* (the event is not set). Its event loop is running task "
        "'announcer' (announce), and runs no other task until that one awaits or returns*",
        "      task 'announcer' (announce) is running (the stack of its loop's thread shows where)*",
        '        File "*test_*.py", line *, in announce',
    )
    assert "nothing in the process will" not in report


def test_a_hang_on_a_module_scoped_loop_leaves_it_running_the_next_test(
    batch: Session,
) -> None:
    _passed(batch, "test_module_loop", "test_the_module_loop_still_runs_the_next_test")
    assert_hang(
        batch,
        "test_awaits_an_event_on_the_module_loop",
        "hint: pytest (pid *): test_awaits_an_event_on_the_module_loop awaits Event.wait() in "
        f"task 'Task-*' at test_*.py:{_line(MODULE_LOOP, 'await asyncio.Event().wait()')} "
        "(the event is not set)*",
    )


def test_a_task_awaiting_a_queue_nobody_fills_is_shown_below_the_test_task_awaiting_it(
    batch: Session,
) -> None:
    report = assert_hang(
        batch,
        "test_awaits_a_queue_nobody_fills",
        "HANG after *s in *::test_awaits_a_queue_nobody_fills: 1 process, stuck in Queue.get() "
        "(asyncio task 'consumer')",
        "hint: pytest (pid *): consume awaits Queue.get() in task 'consumer' at "
        f"test_*.py:{_line(QUEUE, 'return await queue.get()')} (the queue is empty); nothing "
        "in the process will put an item in it.*",
        "      task 'Task-*' (test_awaits_a_queue_nobody_fills) awaits task 'consumer' *",
        "      task 'consumer' (consume) awaits Queue.get() [[]0 item(s) of unbounded[]] *",
    )
    tree = report[report.index("    asyncio loop in") :]  # pstree's order: the awaiter first
    assert tree.index("awaits task 'consumer'") < tree.index("task 'consumer' (consume) awaits")


def test_a_gather_where_one_task_awaits_the_others_lock_names_both_and_who_refers_to_it(
    batch: Session,
) -> None:
    held = _line(GATHER_LOCK, "await release.wait()")
    waits = _line(GATHER_LOCK, "async with lock:", "async def waiter")
    assert_hang(
        batch,
        "test_a_gather_where_one_task_awaits_the_others_lock",
        f"hint: pytest (pid *): holder awaits Event.wait() in task 'holder' at test_*.py:{held} "
        "(the event is not set); nothing in the process will set it; waiter awaits "
        f"Lock.acquire() in task 'waiter' at test_*.py:{waits} (the lock is locked; tasks that "
        f"refer to the lock: *'holder', which awaits Event.wait() at test_*.py:{held}); nothing "
        "in the process will release it.*",
        "      task 'Task-*' (test_a_gather_where_one_task_awaits_the_others_lock) awaits gather() "
        "of 'holder', 'waiter' *",
    )


def test_a_sync_test_whose_asyncio_run_hangs_is_a_hang_and_the_next_test_runs(
    batch: Session,
) -> None:
    _passed(batch, "test_sync_run", "test_the_next_test_runs")
    assert_hang(
        batch,
        "test_a_sync_test_whose_asyncio_run_hangs",
        "hint: pytest (pid *): wait_for_ever awaits Event.wait() in task 'Task-*' at "
        f"test_*.py:{_line(SYNC_RUN, 'await asyncio.Event().wait()')} (the event is not set); "
        "nothing in the process will set it.*",
    )


def test_an_async_fixture_stuck_in_setup_and_an_async_generator_show_their_own_frames(
    batch: Session,
) -> None:
    # a hang in setup counts as a hang: the batch's count holds it (HANGS)
    fixture = _line(FIXTURE, "await asyncio.Event().wait()")
    assert_hang(
        batch,
        "test_uses_a_fixture_that_never_connects",
        "HANG after *s in *::test_uses_a_fixture_that_never_connects (during setup): 1 process, "
        "stuck in Event.wait() (asyncio task 'Task-*')",
        f"hint: pytest (pid *): connection awaits Event.wait() in task 'Task-*' at "
        f"test_*.py:{fixture} (the event is not set); nothing in the process will set it.*",
        f'        File "*test_*.py", line {fixture}, in connection',
    )
    assert_hang(
        batch,
        "test_iterates_an_async_generator_that_never_yields",
        "hint: pytest (pid *): ticks awaits Queue.get() in task 'Task-*' at "
        f"test_*.py:{_line(FIXTURE, 'yield await queue.get()')} (the queue is empty)*",
        '        File "*test_*.py", line *, in test_iterates_an_async_generator_that_never_yields',
    )


def test_children_whose_loops_are_stuck_answer_with_their_tasks(batch: Session) -> None:
    assert_hang(
        batch,
        "test_a_child_process_whose_loop_is_stuck",
        "HANG after *s in *: 2 processes, 1 stuck in Python child Event.wait() (asyncio task "
        "'server')",
        "hint: Python child (pid *): serve awaits Event.wait() in task 'server' at <string>:5 (the "
        "event is not set); nothing in the process will set it.*",
        "      task 'server' (serve) awaits Event.wait() [[]not set[]] (most recent call first):",
    )
    assert_hang(
        batch,
        "test_a_forked_child_whose_loop_is_stuck",
        "hint: multiprocessing.Process(target=forked_loop) (pid *): serve awaits Event.wait() in "
        f"task 'Task-*' at test_*.py:{_line(CHILD, 'await ready.wait()', 'def test_a_child')} "
        "(the event is not set); nothing in the process will set it.*",
    )


def test_pytest_timeouts_option_shows_the_tasks_as_ours_does(
    guarded: GuardedRunner, batch: Session
) -> None:
    session = _session(guarded, EVENT, "--timeout=2", *ALONE, timeout=None)
    assert_outcomes(session.result, hang=1, passed=1)
    for each in (session, batch):  # the batch ran under --torch-hang-timeout=2
        assert_hang(
            each,
            "test_awaits_an_event_nobody_sets",
            "      task 'Task-*' (test_awaits_an_event_nobody_sets) awaits Event.wait() "
            "[[]not set[]]*",
        )


def test_under_xdist_the_workers_tasks_reach_the_controllers_report(guarded: GuardedRunner) -> None:
    session = _session(guarded, EVENT, "-n", "1")
    assert_outcomes(session.result, hang=1, passed=1)
    assert_hang(
        session,
        "test_awaits_an_event_nobody_sets",
        "hint: pytest (xdist worker gw0) (pid *): test_awaits_an_event_nobody_sets awaits "
        "Event.wait() in task 'Task-*' at test_*.py:* (the event is not set); nothing in the "
        "process will set it. Its event loop has nothing that could wake it*, and the process's "
        "other Python threads were running before this test began (thread 0x* started in *)*",
        "      task 'Task-*' (test_awaits_an_event_nobody_sets) awaits Event.wait() [[]not set[]]*",
    )

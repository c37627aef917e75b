"""The interaction matrix: every deadline source crossed with stall, xdist and where a test hangs."""

from __future__ import annotations

import re

import pytest

from conftest import GuardedRunner, Session, batch_runner
from matrix_scenarios import MODULE, Cell, Group, passed_tests, verdict
from outcomes import assert_outcomes

pytestmark = pytest.mark.needs_torch


def _marker(seconds: float) -> str:
    return f"@pytest.mark.timeout({seconds})"


#: Each group is one inner session (torch costs 3-6 s a session here); its cells are checked one
#: by one, so a failing cell never hides another's verdict. The groups' sessions mostly wait for
#: their deadlines, so they run AT_ONCE at a time (``sessions``). A session whose tests request the
#: torch_hang fixture is set up differently from one whose tests do not, so the two kinds of cell
#: never share a session: each is seen as a user would meet it alone. Deadlines sit well above
#: what a cell does before it hangs: torch is imported at collection, before any test's clock
#: starts, and the zygote's torch import pauses the clock of the test that starts it.
GROUPS = {
    "plugin-timeout": Group(
        args=(),
        plugin_timeout=4,
        cells=(
            Cell("test_main_thread", "main", "HANG", 4),
            Cell("test_teardown", "teardown", "HANG", 4),
            Cell("test_dataloader_worker", "dataloader", "HANG", 4),
        ),
    ),
    "pytest-timeout-option": Group(
        args=("--timeout=4",),
        cells=(
            Cell("test_main_thread", "main", "HANG", 4),
            Cell("test_teardown", "teardown", "HANG", 4),
            Cell("test_dataloader_worker", "dataloader", "HANG", 4),
        ),
    ),
    "pytest-timeout-option-xdist": Group(
        args=("-n", "2", "--timeout=6"),
        cells=(
            Cell("test_main_thread", "main", "HANG", 6),
            Cell("test_dataloader_worker", "dataloader", "HANG", 6),
        ),
    ),
    "pytest-timeout-marker": Group(
        args=(),
        cells=(
            Cell("test_main_thread", "main", "HANG", 4, mark=_marker(4)),
            Cell("test_teardown", "teardown", "HANG", 4, mark=_marker(4)),
            Cell("test_dataloader_worker", "dataloader", "HANG", 4, mark=_marker(4)),
        ),
    ),
    "pytest-timeout-marker-xdist": Group(
        args=("-n", "2"),
        cells=(
            Cell("test_main_thread", "main", "HANG", 4, mark=_marker(4)),
            Cell("test_teardown", "teardown", "HANG", 4, mark=_marker(4)),
        ),
    ),
    "fixture-under-the-test-deadline-xdist": Group(
        args=("-n", "2", "--timeout=6"),
        cells=(
            # a call without a timeout of its own inherits the test's: the option's, the marker's
            Cell("test_gloo_ranks", "gloo", "HANG", 6),
            Cell("test_fixture_child_under_a_marker", "child", "HANG", 4, mark=_marker(4)),
            # the test's deadline comes before the call's looser one
            Cell(
                "test_fixture_child_with_a_looser_call_timeout", "child", "HANG", 6, call_timeout=30
            ),
        ),
    ),
    "fixture-call-timeout": Group(
        args=(),
        plugin_timeout=30,
        cells=(
            Cell("test_fixture_child", "child", "HANG", 3, call_timeout=3),
            Cell("test_gloo_ranks", "gloo", "HANG", 5, call_timeout=5),
        ),
    ),
    "fixture-call-timeout-stall-xdist": Group(
        args=("-n", "2", "--torch-hang-stall=2"),
        cells=(
            # the child's beats hold the stall off: only the call's own timeout can fire
            Cell("test_fixture_child_beating", "child_beating", "HANG", 3, call_timeout=3),
            Cell("test_fixture_child_silent", "child", "STALL", 2, call_timeout=8),
            Cell("test_gloo_ranks_silent", "gloo", "STALL", 2, call_timeout=8),
        ),
    ),
    "stall-silent": Group(
        args=("--torch-hang-stall=3",),
        plugin_timeout=8,
        cells=(
            Cell("test_main_thread", "main", "STALL", 3),
            Cell("test_dataloader_worker", "dataloader", "STALL", 3),
            # pytest-timeout's marker comes before the stall
            Cell("test_main_thread_with_an_earlier_marker", "main", "HANG", 2, mark=_marker(2)),
        ),
    ),
    "stall-with-progress": Group(
        args=("--torch-hang-stall=2",),
        plugin_timeout=5,
        cells=(Cell("test_main_thread_beating", "main_beating", "HANG", 5),),
    ),
    "stall-with-progress-pytest-timeout-xdist": Group(
        args=("-n", "2", "--timeout=5", "--torch-hang-stall=2"),
        cells=(
            Cell("test_main_thread_beating", "main_beating", "HANG", 5),
            Cell("test_dataloader_worker", "dataloader", "STALL", 2),
        ),
    ),
}


def _run(guarded: GuardedRunner, module: str, *args: str, timeout: float | None) -> Session:
    guarded.pytester.makepyfile(**{MODULE: module})
    # -rA lists every passing test by name; the monitor's last resort ends a lost session
    # within about 25 s a hang, so 150 s bounds even a session whose every cell is lost
    return guarded.run("-p", "no:randomly", "-rA", *args, timeout=timeout, wait_s=150)


#: Groups' sessions run two at a time: each is a pytest (two more under xdist) that imports
#: torch at collection and then mostly waits. The groups whose cells use the torch_hang fixture
#: run alone, after the others: their zygote imports torch while a test's clock is paused, and
#: with another torch session beside it (seen: the stall fired in setup, a call's deadline came
#: at 0.7 s of its 4 s) their timing no longer held.
AT_ONCE = 2
ALONE = tuple(name for name in GROUPS if name.startswith("fixture-"))


@pytest.fixture(scope="module")
def sessions(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Session]:
    """Every group's session, each in a directory of its own (the cells' module has one name)."""
    with batch_runner(request, tmp_path_factory) as guarded:
        dirs, args = {}, {}
        for name, group in GROUPS.items():
            dirs[name] = guarded.pytester.mkdir(name)
            (dirs[name] / f"{MODULE}.py").write_text(group.module().strip() + "\n")
            timeout = (
                ()
                if group.plugin_timeout is None
                else (f"--torch-hang-timeout={group.plugin_timeout}",)
            )
            # as _run: -rA lists every passing test by name
            args[name] = ("-p", "no:randomly", "-rA", *timeout, *group.args)
        shared = {name: a for name, a in args.items() if name not in ALONE}
        sessions = guarded.run_many(shared, at_once=AT_ONCE, dirs=dirs, timeout=None, wait_s=150)
        alone = {name: args[name] for name in ALONE}
        sessions |= guarded.run_many(alone, at_once=1, dirs=dirs, timeout=None, wait_s=150)
        return sessions


@pytest.mark.parametrize("name", list(GROUPS))
def test_each_cell_fires_the_right_kind_on_time_once_with_its_frames_and_the_session_goes_on(
    sessions: dict[str, Session], name: str
) -> None:
    group = GROUPS[name]
    session = sessions[name]
    problems = verdict(session, group)
    assert not problems, f"{name} ({' '.join(group.args)}):\n{problems}"


ZYGOTE_OUTLIVES_ITS_THREAD = """
import os
import threading
import time


def child_pid():
    return os.getpid()


def child_waits_for_the_go(started, go):
    open(started, "w").close()
    deadline = time.monotonic() + 30
    while not os.path.exists(go):
        if time.monotonic() > deadline:
            raise TimeoutError("no go after 30 s")
        time.sleep(0.02)
    return "done"


def _wait_for(path, seconds=60):
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.02)


def test_a_call_in_flight_survives_the_end_of_the_thread_that_started_the_zygote(
    torch_hang, tmp_path
):
    started, go = str(tmp_path / "started"), str(tmp_path / "go")
    results = {}
    first_call_done = threading.Event()

    def first():
        results["first"] = torch_hang.run(child_pid)  # the session's first call: starts the zygote
        first_call_done.set()
        _wait_for(started)  # then this thread ends while the second call is in flight

    def second():
        results["second"] = torch_hang.run(child_waits_for_the_go, started, go)

    starter = threading.Thread(target=first)
    starter.start()
    assert first_call_done.wait(120), "the first call did not return"
    caller = threading.Thread(target=second)
    caller.start()
    starter.join(60)
    assert not starter.is_alive()
    open(go, "w").close()
    caller.join(60)
    assert not caller.is_alive()
    assert results["second"] == "done", results
    assert isinstance(torch_hang.run(child_pid), int)  # and the zygote still serves


def test_the_next_test_passes():
    pass
"""


def test_the_zygote_outlives_the_user_thread_that_started_it(guarded: GuardedRunner) -> None:
    session = _run(guarded, ZYGOTE_OUTLIVES_ITS_THREAD, timeout=90)
    assert "zygote exited unexpectedly" not in session.text, session.text[-3000:]
    assert_outcomes(session.result, passed=2)
    session.assert_clean()


POOL_WITH_A_KILLED_WORKER = '''
import multiprocessing
import os
import signal
import time


def square_or_kill(x, directory):
    """Task 1 returns and leaves its worker idle, holding the pool's queue lock in recv; task 0
    then kills that worker and itself: task 0's result never comes, and the lock stays held."""
    idle = os.path.join(directory, "idle")
    if x == 1:
        with open(idle + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(idle + ".tmp", idle)
        return x
    deadline = time.monotonic() + 30
    while not os.path.exists(idle) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # the idle worker is back in the queue's recv
    with open(idle) as f:
        os.kill(int(f.read()), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def test_pool_map_after_a_worker_was_killed(tmp_path):
    with multiprocessing.get_context("fork").Pool(2) as pool:
        pool.starmap(square_or_kill, [(0, str(tmp_path)), (1, str(tmp_path))], chunksize=1)


def test_the_next_test_passes():
    pass
'''


def test_the_first_capture_is_the_report_and_a_blocking_cleanup_is_a_note(
    guarded: GuardedRunner,
) -> None:
    session = _run(guarded, POOL_WITH_A_KILLED_WORKER, timeout=6)
    assert_outcomes(session.result, hang=1, passed=1)
    assert "test_the_next_test_passes" in passed_tests(session)
    report = session.report_of("test_pool_map_after_a_worker_was_killed")
    headlines = re.findall(r"^(?:HANG|STALL) after (\d+(?:\.\d+)?)s", report, re.M)
    assert len(headlines) == 1, report[:6000]
    assert 5.7 <= float(headlines[0]) <= 9.5, headlines  # the first fire, not the cleanup's
    # the first capture: the pytest main thread's stack, starmap -> get -> wait (most recent first)
    stack = _main_thread_stack(report)
    frames = [m.group(1) for line in stack if (m := re.search(r", in (\w+)$", line))]
    assert "_help_stuff_finish" not in frames, "\n".join(stack)
    called = [f for f in frames if f in ("wait", "get", "starmap")]
    assert called[-3:] == ["wait", "get", "starmap"], "\n".join(stack)
    # the cleanup that blocked afterwards (Pool.__exit__ -> terminate): a note, with its stack
    notes = report[report.index("\nnote:") :] if "\nnote:" in report else ""
    assert "_help_stuff_finish" in notes, report[:6000]
    session.assert_clean()


def _main_thread_stack(report: str) -> list[str]:
    """The lines of the pytest process's main thread in a report (the first capture)."""
    lines = report.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"--- process \d+ \[pytest\]", line))
    main = next(i for i in range(start, len(lines)) if lines[i].strip().startswith("main thread"))
    end = next(
        (i for i in range(main + 1, len(lines)) if re.match(r"(    thread |--- |\S)", lines[i])),
        len(lines),
    )
    return lines[main:end]

"""The plugins and tools users already run beside ours: debuggers, coverage, reruns, random order,
xdist, and the multiprocessing start methods. Each is installed for real in the inner session.

Each scenario is a short inner session (no torch; deadlines of 1 to 4 s) that mostly waits: all
but the three that need a debugger's stdin or an environment of their own run a few at a time in
one batch (``batch``), each in a directory of its own, and each test checks its own session.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import GuardedRunner, Session, assert_hang, batch_runner
from matrix_scenarios import LATE_S
from outcomes import assert_outcomes


def assert_fired_in_time(session: Session, test_name: str, due_s: float, *expected: str) -> str:
    """The test hung, and its headline's time is its deadline's (late by LATE_S at most on a
    loaded machine, never early)."""
    report = assert_hang(session, test_name, "HANG after *", *expected)
    assert_in_time(report, due_s)
    return report


def assert_in_time(text: str, due_s: float) -> None:
    fired = re.search(r"HANG after (\d+\.\d)s", text)
    assert fired, text[:2000]
    assert due_s <= float(fired.group(1)) <= due_s + LATE_S, fired.group(0)


#: Batched sessions at the same time: each is a pytest without torch that waits 1 to 4 s. Four
#: at a time under two CPU hogs at load 9 saw fires late enough to miss a 2.5 s window.
AT_ONCE = 2


@pytest.fixture(scope="module")
def batch(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Session, Path]]:
    """Each scenario of ``_scenarios`` run in its own directory: its session and that directory."""
    with batch_runner(request, tmp_path_factory) as guarded:
        dirs, args = {}, {}
        for name, (files, arguments) in _scenarios().items():
            dirs[name] = guarded.pytester.mkdir(re.sub(r"[^\w.-]+", "-", name))
            for file, source in files.items():
                (dirs[name] / file).write_text(source.strip() + "\n")
            args[name] = tuple(a.format(dir=dirs[name]) for a in arguments)
        sessions = guarded.run_many(args, at_once=AT_ONCE, dirs=dirs, timeout=None)
        return {name: (sessions[name], dirs[name]) for name in args}


# --- pytest-timeout --------------------------------------------------------------------------

FUNC_ONLY = """
import time


def test_hangs_in_its_call():
    time.sleep(30)


def test_the_next_one_runs():
    pass
"""


def test_pytest_timeouts_func_only_limit_interrupts_the_call(
    batch: dict[str, tuple[Session, Path]],
) -> None:
    session, _ = batch["func-only"]
    assert_outcomes(session.result, hang=1, passed=1)
    assert_fired_in_time(session, "test_hangs_in_its_call", 2.0)
    assert "pytest included" not in session.text  # the watchdog acted, not the last resort
    session.assert_clean()


# --- debuggers (pytest-timeout's rule: a debugger holds every deadline) ----------------------

#: A trace function from a module named as PyCharm's and VS Code's debugger is (debugpy runs a
#: vendored pydevd): it stops the test at a "breakpoint" for 3 s, as a user looking around would.
PYDEVD = """
import time


def trace_dispatch(frame, event, arg):
    if event == "line" and frame.f_code.co_name == "stop_here":
        time.sleep(3)
    return trace_dispatch
"""

AT_A_BREAKPOINT = """
import sys
import time

import pydevd
import pytest

{mark}


def stop_here():
    return 1


def test_sits_at_a_breakpoint():
    sys.settrace(pydevd.trace_dispatch)
    try:
        stop_here()
    finally:
        sys.settrace(None)


def test_hangs_without_a_debugger():
    time.sleep(30)
"""

DEADLINE_SOURCES = {
    "torch-hang-timeout": ((), 1.0, ""),
    "torch_hang marker": ((), None, "pytestmark = pytest.mark.torch_hang(timeout=1)"),
    "pytest-timeout option": (("--timeout=1",), None, ""),
    "pytest-timeout marker": ((), None, "pytestmark = pytest.mark.timeout(1)"),
}


@pytest.mark.parametrize("source", list(DEADLINE_SOURCES))
def test_a_debuggers_trace_function_holds_every_deadline_source(
    batch: dict[str, tuple[Session, Path]], source: str
) -> None:
    session, _ = batch[f"debugger-{source}"]
    assert_outcomes(session.result, passed=1, hang=1)  # the other test still hangs, and fails
    assert_fired_in_time(session, "test_hangs_without_a_debugger", 1.0)
    session.result.stdout.fnmatch_lines(
        [
            "*torch-hang: notes*",
            "test_dbg.py::test_sits_at_a_breakpoint: its deadline came while a debugger held the "
            "test (a trace function from pydevd)*",
        ]
    )
    session.assert_clean()


def test_a_debugger_holds_the_stall_time_too(batch: dict[str, tuple[Session, Path]]) -> None:
    session, _ = batch["debugger-stall"]
    assert_outcomes(session.result, passed=1, stall=1)
    headline = session.report_of("test_hangs_without_a_debugger").splitlines()[1]
    assert headline.startswith("STALL after "), headline
    session.result.stdout.fnmatch_lines(
        ["test_dbg.py::test_sits_at_a_breakpoint: its deadline came while a debugger held*"]
    )
    session.assert_clean()


def test_pytest_timeouts_switch_lets_the_deadline_interrupt_a_debugger(
    batch: dict[str, tuple[Session, Path]],
) -> None:
    session, _ = batch["debugger-switched-off"]
    assert_outcomes(session.result, hang=2)
    assert_fired_in_time(session, "test_sits_at_a_breakpoint", 1.0, "*in trace_dispatch*")
    assert "held the test" not in session.result.stdout.str()
    session.assert_clean()


#: A debugger's trace function set inside the test's body that traces no frame (pydevd returns
#: None for a frame without breakpoints), while the test waits in C: no frame of its stack
#: shows it; only the test's thread itself can say what its sys.gettrace() is.
SET_IN_THE_BODY = """
import sys
import threading
import time

import pydevd


def test_debugged_from_its_body():
    sys.settrace(pydevd.trace_dispatch)
    try:
        time.sleep(4)  # the deadline comes at 2 while the IDE would hold the test
    finally:
        sys.settrace(None)


def test_hangs_without_a_debugger():
    threading.Event().wait()
"""

PYDEVD_NO_FRAMES = """
def trace_dispatch(frame, event, arg):
    return None  # no frame of interest: none gets a local trace function
"""


@pytest.mark.parametrize("option", ["--timeout=2", "--torch-hang-timeout=2"])
def test_a_debugger_set_in_the_tests_body_holds_the_deadline(
    batch: dict[str, tuple[Session, Path]], option: str
) -> None:
    session, _ = batch[f"debugger-in-the-body{option}"]
    assert_outcomes(session.result, passed=1, hang=1)
    assert_fired_in_time(session, "test_hangs_without_a_debugger", 2.0)
    session.result.stdout.fnmatch_lines(
        [
            "test_body.py::test_debugged_from_its_body: its deadline came while a debugger held "
            "the test (a trace function from pydevd)*",
        ]
    )
    session.assert_clean()


IN_PDB = """
import pdb


def test_sits_in_pdb():
    pdb.Pdb().set_trace()  # pdb itself, not pytest's wrapper: no pytest_enter_pdb
    x = 1
"""


def test_pdb_set_outside_pytest_holds_the_deadline(guarded: GuardedRunner) -> None:
    guarded.pytester.makepyfile(test_pdb=IN_PDB)
    session = guarded.run("-s", timeout=1, stdin=b"import time; time.sleep(2.5)\ncontinue\n")
    assert_outcomes(session.result, passed=1)
    assert "HANG" not in session.result.stdout.str()
    session.result.stdout.fnmatch_lines(["*held the test (a trace function from bdb)*"])


POST_MORTEM = """
import time

import pytest


@pytest.fixture
def slow_to_tear_down():
    yield
    time.sleep(2.5)


def test_fails(slow_to_tear_down):
    assert 0
"""


def test_the_post_mortem_debugger_holds_the_rest_of_the_test(guarded: GuardedRunner) -> None:
    guarded.pytester.makepyfile(test_pm=POST_MORTEM)
    session = guarded.run("--pdb", timeout=1, stdin=b"continue\n")
    assert_outcomes(session.result, failed=1)  # its own failure: no hang
    assert "HANG" not in session.result.stdout.str()


@pytest.mark.parametrize("option", ["--torch-hang-timeout=1", "--timeout=1"])
def test_without_pdb_a_failing_tests_teardown_stays_bounded(
    batch: dict[str, tuple[Session, Path]], option: str
) -> None:
    session, _ = batch[f"teardown{option}"]
    assert_outcomes(session.result, failed=1, hang=1)  # the call's failure, the teardown's hang
    teardown = session.result.stdout.str().split("HANG at teardown of test_fails", 1)
    assert len(teardown) == 2, session.result.stdout.str()[-3000:]
    assert_in_time(teardown[1], 1.0)


# --- pytest-cov ----------------------------------------------------------------------------

HANGS_IN_A_CHILD = """
import subprocess
import sys


def add(a, b):
    return a + b


def test_passes():
    assert add(1, 2) == 3


def test_waits_for_a_child_forever():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]).wait()
"""


@pytest.mark.parametrize("option", ["--torch-hang-timeout=1", "--timeout=1"])
def test_under_coverage_a_hang_fires_and_the_coverage_report_is_written(
    batch: dict[str, tuple[Session, Path]], option: str
) -> None:
    session, directory = batch[f"coverage{option}"]
    xml = directory / "coverage.xml"
    assert_outcomes(session.result, passed=1, hang=1)
    assert_fired_in_time(
        session, "test_waits_for_a_child_forever", 1.0, "cleanup: killed 1 process*"
    )
    assert "held the test" not in session.result.stdout.str()  # coverage is no debugger
    assert xml.is_file() and 'filename="test_cov.py"' in xml.read_text()
    session.assert_clean()


# --- pytest-rerunfailures ---------------------------------------------------------------------

HANGS_EACH_ATTEMPT = """
import time


def test_hangs():
    with open("attempts.txt", "a") as out:
        out.write(f"{time.time()}\\n")
    time.sleep(30)
"""


@pytest.mark.parametrize(
    "options",
    [("--torch-hang-timeout=2",), ("--timeout=2", "-o", "timeout_func_only=true")],
    ids=["torch-hang-timeout", "pytest-timeout func_only"],
)
def test_each_rerun_of_a_hanging_test_is_bounded_and_reported(
    batch: dict[str, tuple[Session, Path]], options: tuple[str, ...]
) -> None:
    session, directory = batch[f"reruns{' '.join(options)}"]
    reports = directory / "hangs"
    assert session.result.parseoutcomes() == {"hang": 1, "rerun": 1}
    assert_fired_in_time(session, "test_hangs", 2.0)
    session.result.stdout.fnmatch_lines(
        ["*torch-hang summary*", "attempt 1, run again: HANG after *", "HANG after *"]
    )
    attempts = (directory / "attempts.txt").read_text().split()
    hangs = sorted((json.loads(p.read_text()) for p in reports.glob("*.json")), key=_created)
    assert len(attempts) == len(hangs) == 2, (attempts, hangs)
    for started, hang in zip(map(float, attempts), hangs, strict=True):
        assert_in_time(hang["headline"], 2.0)
        # its time counts from its own attempt's start, not from the first attempt's (in whose
        # teardown grace a rerun would otherwise run)
        assert hang["elapsed_s"] <= hang["created"] - started + 1.0, (started, hang)
    session.assert_clean()


def _created(hang: dict[str, float]) -> float:
    return hang["created"]


# --- pytest-randomly --------------------------------------------------------------------------

RANDOM = """
import random
import time

import pytest


@pytest.mark.parametrize("n", range(4))
def test_passes(n):
    random.random()


def test_hangs():
    time.sleep(30)
"""


def test_random_order_and_seeds_change_nothing_about_the_guard(
    guarded: GuardedRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTEST_ADDOPTS", "")  # this inner session runs pytest-randomly
    guarded.pytester.makepyfile(test_rand=RANDOM)
    session = guarded.run("-p", "randomly", "-v", timeout=1)
    assert_outcomes(session.result, passed=4, hang=1)
    assert "Using --randomly-seed=" in session.result.stdout.str()
    assert_fired_in_time(session, "test_hangs", 1.0)
    session.assert_clean()


# --- pytest-xdist, crossed with reruns and coverage -------------------------------------------


def test_under_xdist_with_reruns_and_coverage_each_attempt_is_bounded(
    batch: dict[str, tuple[Session, Path]],
) -> None:
    session, directory = batch["xdist-reruns-coverage"]
    xml = directory / "coverage.xml"
    assert session.result.parseoutcomes() == {"passed": 1, "hang": 1, "rerun": 1}
    assert_fired_in_time(session, "test_waits_for_a_child_forever", 1.0)
    assert xml.is_file()
    session.assert_clean()


# --- start methods: a session-wide forkserver, and spawn -------------------------------------

START_METHOD_CONFTEST = """
import multiprocessing as mp

mp.set_start_method("{method}")
"""

START_METHOD_TESTS = """
import multiprocessing as mp
import os
import time


def _square(x):
    return x * x


def _sleep_forever(_):
    time.sleep(60)


def test_starts_the_start_methods_helpers():
    with mp.Pool(1) as pool:
        assert pool.map(_square, [3]) == [9]


def test_workers_hang():
    with mp.Pool(2) as pool:
        pool.map(_sleep_forever, range(2))


def test_the_start_method_still_serves():
    with mp.Pool(1) as pool:
        assert pool.map(_square, [4]) == [16]
"""


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_the_workers_a_start_method_makes_for_a_hung_test_are_the_tests(
    batch: dict[str, tuple[Session, Path]], method: str
) -> None:
    session, _ = batch[f"start-method-{method}"]
    assert_outcomes(session.result, passed=2, hang=1)
    report = assert_fired_in_time(session, "test_workers_hang", 4.0)
    # identical workers are shown once, the others named below the block
    workers = re.findall(r"^--- process (\d+) \[Pool worker\]", report, re.M)
    workers += re.findall(
        r"^ +the same stacks, shown once: .*?pid (\d+) \[Pool worker\]", report, re.M
    )
    killed = re.search(r"^cleanup: killed \d+ process\(es\) \(([\d, ]+)\)", report, re.M)
    assert len(workers) == 2 and killed, report[:4000]
    assert set(workers) <= set(killed.group(1).split(", ")), killed.group(0)[:2000]
    if method == "forkserver":  # started by the first test, it outlives it: never killed
        forkserver = re.search(r"^--- process (\d+) \[forkserver\]", report, re.M)
        assert forkserver and forkserver.group(1) not in killed.group(1).split(", "), report
    session.assert_clean()


def _scenarios() -> dict[str, tuple[dict[str, str], tuple[str, ...]]]:
    """The batched sessions: name -> (files written in its directory, its pytest arguments;
    ``{dir}`` is that directory)."""
    scenarios: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {
        "func-only": (
            {"test_fo.py": FUNC_ONLY},
            ("--timeout=2", "-o", "timeout_func_only=true"),
        ),
        "debugger-stall": (
            {"pydevd.py": PYDEVD, "test_dbg.py": AT_A_BREAKPOINT.format(mark="")},
            ("--torch-hang-stall=1",),
        ),
        "debugger-switched-off": (
            {"pydevd.py": PYDEVD, "test_dbg.py": AT_A_BREAKPOINT.format(mark="")},
            ("--timeout=1", "--timeout-disable-debugger-detection"),
        ),
        "xdist-reruns-coverage": (
            {"test_x.py": HANGS_IN_A_CHILD},
            (
                "-n",
                "2",
                "--reruns",
                "1",
                "--cov=.",
                "--cov-report=xml:{dir}/coverage.xml",
                "--torch-hang-timeout=1",
            ),
        ),
    }
    for source, (args, timeout, mark) in DEADLINE_SOURCES.items():
        ours = (f"--torch-hang-timeout={timeout}",) if timeout is not None else ()
        files = {"pydevd.py": PYDEVD, "test_dbg.py": AT_A_BREAKPOINT.format(mark=mark)}
        scenarios[f"debugger-{source}"] = (files, (*args, *ours))
    for option in ("--timeout=2", "--torch-hang-timeout=2"):
        files = {"pydevd.py": PYDEVD_NO_FRAMES, "test_body.py": SET_IN_THE_BODY}
        scenarios[f"debugger-in-the-body{option}"] = (files, (option,))
    for option in ("--torch-hang-timeout=1", "--timeout=1"):
        scenarios[f"teardown{option}"] = ({"test_pm.py": POST_MORTEM}, (option,))
        scenarios[f"coverage{option}"] = (
            {"test_cov.py": HANGS_IN_A_CHILD},
            ("--cov=.", "--cov-report=xml:{dir}/coverage.xml", option),
        )
    for options in (("--torch-hang-timeout=2",), ("--timeout=2", "-o", "timeout_func_only=true")):
        scenarios[f"reruns{' '.join(options)}"] = (
            {"test_rr.py": HANGS_EACH_ATTEMPT},
            ("--reruns", "1", "--torch-hang-report-dir={dir}/hangs", *options),
        )
    for method in ("forkserver", "spawn"):
        files = {
            "conftest.py": START_METHOD_CONFTEST.format(method=method),
            "test_sm.py": START_METHOD_TESTS,
        }
        scenarios[f"start-method-{method}"] = (
            files,
            ("-p", "no:randomly", "--torch-hang-timeout=4"),
        )
    return scenarios

"""One report per hang: once the test has its HangError, teardown runs, with a grace of its own."""

from __future__ import annotations

from conftest import GuardedRunner, assert_hang
from outcomes import assert_outcomes

FLUSHING_TEARDOWN = """
import time

import pytest


@pytest.fixture
def checkpoint(tmp_path_factory):
    yield
    # a checkpoint flush that takes a while (less than the timeout): it must run to the end
    for _ in range(10):
        time.sleep(0.1)
    (tmp_path_factory.getbasetemp() / "flushed").write_text("yes")


def test_hangs(checkpoint):
    time.sleep(60)


def test_after(tmp_path_factory):
    assert (tmp_path_factory.getbasetemp() / "flushed").read_text() == "yes"
"""


def test_a_hang_is_reported_once_and_the_teardown_runs_to_its_end(guarded: GuardedRunner) -> None:
    guarded.pytester.makepyfile(test_flush=FLUSHING_TEARDOWN)
    session = guarded.run("-p", "no:randomly", timeout=2)
    assert_outcomes(session.result, passed=1, hang=1)
    assert_hang(session, "test_hangs", "*time.sleep(60)*")
    summary = session.result.stdout.str().split("short test summary info")[-1]
    assert [line for line in summary.splitlines() if line.startswith("HANG ")] == [
        line for line in summary.splitlines() if "test_hangs" in line
    ], summary  # one line, for the call: no second report for the teardown
    session.assert_clean()


SLOW_REPORTING = """
import time

import pytest


def pytest_runtest_logreport(report):
    if report.when == "call" and report.failed:
        time.sleep(4)  # a plugin that uploads each failure: pytest's own code, not the test's
"""


def test_pytests_own_slow_reporting_after_a_hang_is_not_a_second_hang(
    guarded: GuardedRunner,
) -> None:
    # Seen on a loaded machine: reporting the hang took longer than the grace (the timeout), and
    # the grace fired again in pytest's report hook: two hangs for one. The grace counts the
    # test's own code (its teardown), not pytest's between the phases.
    guarded.pytester.makeconftest(SLOW_REPORTING)
    guarded.pytester.makepyfile(test_flush=FLUSHING_TEARDOWN)
    session = guarded.run("-p", "no:randomly", timeout=2)
    assert_outcomes(session.result, passed=1, hang=1)
    out = session.result.stdout.str()
    assert "HANG at teardown" not in out, out
    session.assert_clean()


HANGING_TEARDOWN = """
import time

import pytest


@pytest.fixture
def stuck_teardown():
    yield
    time.sleep(120)  # the teardown hangs in turn


def test_hangs(stuck_teardown):
    time.sleep(120)


def test_after():
    pass
"""


def test_a_teardown_that_hangs_in_turn_is_interrupted_after_its_grace(
    guarded: GuardedRunner,
) -> None:
    guarded.pytester.makepyfile(test_stuck=HANGING_TEARDOWN)
    session = guarded.run("-p", "no:randomly", timeout=2)
    assert_outcomes(session.result, passed=1, hang=2)
    assert_hang(session, "test_hangs")
    out = session.result.stdout.str()
    assert "HANG at teardown of test_hangs" in out, out
    assert "HANG after" in out.split("HANG at teardown of test_hangs")[1], out
    assert "(during teardown)" in out, out
    assert session.wall_s < 60, session.wall_s  # two graces of 2 s, not two minutes
    session.assert_clean()


SWALLOWED = """
import time


def test_swallows_the_interrupt():
    for _ in range(3):
        try:
            time.sleep(60)
        except BaseException:
            pass  # a broad except in the code under test


def test_after():
    pass
"""


def test_a_swallowed_interrupt_still_fails_the_test_as_a_hang(guarded: GuardedRunner) -> None:
    guarded.pytester.makepyfile(test_swallow=SWALLOWED)
    session = guarded.run("-p", "no:randomly", timeout=1)
    assert_outcomes(session.result, passed=1, hang=1)
    assert_hang(session, "test_swallows_the_interrupt")

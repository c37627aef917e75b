"""HANG and STALL as pytest outcomes: their own counts, JUnit properties, exit code, and
``--torch-hang-rerun``, in real sessions (plain and under pytest-xdist)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from conftest import GuardedRunner, assert_hang
from outcomes import assert_outcomes

FOUR_OUTCOMES = """
import multiprocessing
import threading
import time

import pytest


def test_hangs_joining_a_sleeping_child():
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
    child.start()
    child.join()


@pytest.mark.torch_hang(stall=1)
def test_stalls():
    threading.Event().wait()


def test_fails():
    assert 1 == 2


def test_passes():
    pass
"""


def _properties(junit: str, name: str) -> dict[str, str]:
    case = next(c for c in ET.parse(junit).iter("testcase") if c.get("name") == name)
    return {p.get("name", ""): p.get("value", "") for p in case.iter("property")}


@pytest.mark.parametrize("xdist", [False, True], ids=["plain", "xdist"])
def test_a_hang_and_a_stall_have_their_own_counts_and_still_fail_the_session(
    guarded: GuardedRunner, xdist: bool
) -> None:
    guarded.pytester.makepyfile(test_four=FOUR_OUTCOMES)
    junit = guarded.pytester.path / "junit.xml"
    reports = guarded.pytester.path / "reports"
    args = ["-n", "2"] if xdist else []
    session = guarded.run(
        *args, "-rfE", f"--junitxml={junit}", f"--torch-hang-report-dir={reports}", timeout=3
    )
    assert_outcomes(session.result, failed=1, passed=1, hang=1, stall=1)
    assert session.result.ret == 1  # a hang is a failure: CI goes red
    # the reports are printed in full, under their own section
    assert_hang(session, "test_hangs_joining_a_sleeping_child", "hint: *", "cleanup: killed 1 *")
    stall = session.report_of("test_stalls")
    assert "STALL after " in stall, stall[:2000]
    # JUnit: still a <failure>, with the kind and the cause as properties
    hang_props = _properties(str(junit), "test_hangs_joining_a_sleeping_child")
    assert hang_props["torch_hang_kind"] == "hang"
    assert _properties(str(junit), "test_stalls")["torch_hang_kind"] == "stall"
    found = sorted(p.name for p in reports.glob("*.json"))
    matching = [reports / name for name in found if "sleeping_child" in name]
    assert len(matching) == 1, found
    path = matching[0]
    doc = json.loads(path.read_text())
    # the cause is the headline's hint: about the child the headline names, word for word
    assert doc["cause"] and doc["cause"] in [h["text"] for h in doc["hints"]]
    assert hang_props["torch_hang_cause"] == doc["cause"]
    (child,) = doc["killed"]  # the one process the test started
    cause = next(h for h in doc["hints"] if h["text"] == doc["cause"])
    # stable ids for dashboards: the cause's rule, and a signature without pids
    assert hang_props["torch_hang_rule"] == cause["rule"] != "none"
    signature = hang_props["torch_hang_signature"]
    assert "test_hangs_joining_a_sleeping_child" in signature and str(child) not in signature
    assert child in cause["pids"]
    failures = [c for c in ET.parse(junit).iter("testcase") if c.find("failure") is not None]
    assert len(failures) == 3
    session.assert_clean()


def test_a_hang_stops_the_session_under_maxfail(guarded: GuardedRunner) -> None:
    guarded.pytester.makepyfile(test_four=FOUR_OUTCOMES)
    session = guarded.run("-x", "-p", "no:randomly", timeout=3)  # the hang comes first
    assert_outcomes(session.result, hang=1)
    assert session.result.ret == 1


RERUN = """
import os
import threading


def test_first():
    pass


def test_hangs_until_fixed():
    if not os.path.exists("fixed"):
        threading.Event().wait()


def test_last():
    pass
"""


def test_rerun_runs_only_the_tests_that_hung_last_time_until_they_pass(
    guarded: GuardedRunner,
) -> None:
    guarded.pytester.makepyfile(test_rerun=RERUN)
    cache = ("-p", "cacheprovider")  # the runner turns pytest's cache off; this test needs it
    first = guarded.run(*cache, timeout=2)
    assert_outcomes(first.result, passed=2, hang=1)
    again = guarded.run(*cache, "--torch-hang-rerun", timeout=2)
    assert_outcomes(again.result, hang=1, deselected=2)
    again.result.stdout.fnmatch_lines(
        ["torch-hang rerun: 1 test(s) that hung last time selected, 2 deselected"]
    )
    (guarded.pytester.path / "fixed").write_text("")
    fixed = guarded.run(*cache, "--torch-hang-rerun", timeout=2)
    assert_outcomes(fixed.result, passed=1, deselected=2)
    # it passed: the record is empty, and a rerun runs everything, saying why
    after = guarded.run(*cache, "--torch-hang-rerun", "-n", "2", timeout=2)
    assert_outcomes(after.result, passed=3)
    after.result.stdout.fnmatch_lines(["torch-hang rerun: no test hung last time*"])
    for session in (first, again, fixed, after):
        session.assert_clean()


def test_under_xdist_the_controller_records_the_hangs_a_rerun_selects(
    guarded: GuardedRunner,
) -> None:
    guarded.pytester.makepyfile(test_rerun=RERUN)
    cache = ("-p", "cacheprovider")
    first = guarded.run(*cache, "-n", "2", timeout=2)
    assert_outcomes(first.result, passed=2, hang=1)
    again = guarded.run(*cache, "--torch-hang-rerun", "-n", "2", timeout=2)
    assert_outcomes(again.result, hang=1)
    again.result.stdout.fnmatch_lines(["torch-hang rerun: 1 test(s) hung last time*"])


def test_rerun_without_pytests_cache_is_a_usage_error_naming_the_option(
    guarded: GuardedRunner,
) -> None:
    guarded.pytester.makepyfile(test_rerun=RERUN)
    session = guarded.run("--torch-hang-rerun", timeout=2)
    assert session.result.ret == pytest.ExitCode.USAGE_ERROR
    session.result.stderr.fnmatch_lines(["*--torch-hang-rerun*cacheprovider plugin is disabled*"])

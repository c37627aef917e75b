"""Hang hunting: rerun a test N times, and show each distinct way it hangs once, with its count."""

from __future__ import annotations

import json

import pytest

from conftest import GuardedRunner
from outcomes import assert_outcomes

RACES = """
import os
import random
import threading
import time

LOCK_A = threading.Lock()
LOCK_B = threading.Lock()


def holder(lock, stop):
    # holds its lock about a tenth of the time: 0.5 ms of every 5 ms
    while not stop.is_set():
        with lock:
            time.sleep(0.0005)
        time.sleep(0.0045)


def fork_and_take_a():
    pid = os.fork()
    if pid == 0:
        with LOCK_A:  # a lock copied while another thread held it stays held in the child
            pass
        os._exit(0)
    os.waitpid(pid, 0)


def fork_and_take_b():
    pid = os.fork()
    if pid == 0:
        with LOCK_B:
            pass
        os._exit(0)
    os.waitpid(pid, 0)


def holding(*locks):
    stop = threading.Event()
    for lock in locks:
        threading.Thread(target=holder, args=(lock, stop), daemon=True).start()
    return stop


def test_one_rare_deadlock():
    stop = holding(LOCK_A)
    try:
        time.sleep(random.random() * 0.02)  # fork at a random moment of the holder's cycle
        fork_and_take_a()
    finally:
        stop.set()


def test_two_rare_deadlocks():
    stop = holding(LOCK_A, LOCK_B)
    try:
        time.sleep(random.random() * 0.02)
        fork_and_take_a()
        time.sleep(random.random() * 0.02)
        fork_and_take_b()
    finally:
        stop.set()


def test_never_hangs():
    time.sleep(0.001)
"""


def _summary(session_text: str) -> str:
    return session_text.split("torch-hang hunt ")[1].split("torch-hang summary")[0]


def test_a_rare_deadlock_is_found_and_each_way_it_hangs_is_shown_once(
    guarded: GuardedRunner,
) -> None:
    guarded.pytester.makepyfile(test_races=RACES)
    session = guarded.run(
        "-p",
        "no:randomly",
        "--torch-hang-hunt=80",
        "--torch-hang-hunt-all",
        "--torch-hang-report-dir=reports",
        timeout=1,
        wait_s=600,
    )
    assert "INTERNALERROR" not in session.text, session.text[-3000:]
    summary = _summary(session.result.stdout.str())
    lines = summary.splitlines()
    one = next(line for line in lines if line.startswith("test_races.py::test_one_rare_deadlock:"))
    two = next(line for line in lines if line.startswith("test_races.py::test_two_rare_deadlocks:"))
    never = next(line for line in lines if line.startswith("test_races.py::test_never_hangs:"))
    assert " of 80 runs (" in one and one.endswith(", 1 distinct signature"), one
    assert not one.startswith("test_races.py::test_one_rare_deadlock: hung 0 "), one
    assert two.endswith(", 2 distinct signatures"), two
    assert never.startswith("test_races.py::test_never_hangs: hung 0 of 80 runs (0.0%"), never
    # each signature once, with its runs and its first report in full
    signatures = [line for line in lines if line.startswith("signature ")]
    assert len(signatures) == 3, signatures
    assert any("fork_and_take_a" in s for s in signatures if "two_rare" in s)
    assert any("fork_and_take_b" in s for s in signatures if "two_rare" in s)
    assert summary.count("first report in full:") == 3
    # JSON: one summary per hunted test, pointing at the first report of each signature
    summaries = {
        json.loads(p.read_text())["test_id"]: json.loads(p.read_text())
        for p in (guarded.pytester.path / "reports").glob("*-hunt.json")
    }
    assert summaries["test_races.py::test_never_hangs"]["hangs"] == 0
    two_rare = summaries["test_races.py::test_two_rare_deadlocks"]
    assert two_rare["runs"] == 80 and len(two_rare["signatures"]) == 2
    assert sum(s["count"] for s in two_rare["signatures"]) == two_rare["hangs"]
    for sig in two_rare["signatures"]:
        assert sig["report"] and (guarded.pytester.path / "reports" / sig["report"]).exists()
    session.assert_clean()


def test_by_default_a_hunt_stops_at_the_first_hang_and_xdist_spreads_the_runs(
    guarded: GuardedRunner,
) -> None:
    guarded.pytester.makepyfile(test_races=RACES)
    session = guarded.run(
        "-p",
        "no:randomly",
        "-n",
        "2",
        "--torch-hang-hunt=100",
        "-k",
        "one_rare or never",
        timeout=1,
        wait_s=600,
    )
    summary = _summary(session.result.stdout.str())
    one = next(line for line in summary.splitlines() if "test_one_rare_deadlock:" in line)
    assert "distinct signature" in one and "more run(s) not needed after its first hang" in one
    assert "hung 0 of" not in one, one
    ran, skipped = int(one.split(" of ")[1].split()[0]), int(one.split("; ")[-1].split()[0])
    assert ran + skipped == 100, one  # every run counted once, as run or as not needed
    assert "test_races.py::test_never_hangs: hung 0 of 100 runs" in summary
    assert session.result.ret == 1


def test_a_hunt_needs_a_bound(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("--torch-hang-hunt=5")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*--torch-hang-hunt needs a bound for each run*--torch-hang-timeout=SECONDS*"]
    )


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_a_bad_run_count_is_a_usage_error(pytester: pytest.Pytester, value: str) -> None:
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess(f"--torch-hang-hunt={value}", "--torch-hang-timeout=5")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [f"*--torch-hang-hunt must be a whole number of runs >= 1*{value}*"]
    )


STRESSED = """
import os
import subprocess
import sys


def test_sees_the_pressure():
    assert sys.getswitchinterval() < 1e-3
    assert len(os.sched_getaffinity(0)) == 1
    child = subprocess.run(
        [sys.executable, "-c", "import sys; print(sys.getswitchinterval())"],
        capture_output=True, text=True, check=True,
    )
    assert float(child.stdout) < 1e-3  # every process of the tree
"""


def test_stress_changes_timing_in_every_process_of_the_tree(guarded: GuardedRunner) -> None:
    guarded.pytester.makepyfile(test_stressed=STRESSED)
    session = guarded.run("--torch-hang-hunt=3", "--torch-hang-hunt-stress", timeout=30)
    assert_outcomes(session.result, passed=3)

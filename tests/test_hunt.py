"""Hang hunting: rerun a test N times, and show each distinct way it hangs once, with its count."""

from __future__ import annotations

import json
import os
from pathlib import Path

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
    return session_text.split("= torch-hang hunt =")[1].split("torch-hang summary")[0]


def test_a_rare_deadlock_is_found_and_each_way_it_hangs_is_shown_once(
    guarded: GuardedRunner,
) -> None:
    guarded.pytester.makepyfile(test_races=RACES)
    # Two hunts at the same time, each with its own report directory: their hung runs wait out
    # their 1 s deadline (about 8 and 15 of 80), and plain forks start in milliseconds.
    hunt = ("-p", "no:randomly", "--torch-hang-hunt=80", "--torch-hang-hunt-all")
    sessions = guarded.run_many(
        {
            "one": (
                *hunt,
                "--torch-hang-report-dir=reports-one",
                "test_races.py::test_one_rare_deadlock",
                "test_races.py::test_never_hangs",
            ),
            "two": (
                *hunt,
                "--torch-hang-report-dir=reports-two",
                "test_races.py::test_two_rare_deadlocks",
            ),
        },
        at_once=2,
        timeout=1,
        wait_s=600,
    )
    for session in sessions.values():
        assert "INTERNALERROR" not in session.text, session.text[-3000:]
    summary = "".join(_summary(s.result.stdout.str()) for s in sessions.values())
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
    reports = {name: guarded.pytester.path / f"reports-{name}" for name in sessions}
    summaries = {
        json.loads(p.read_text())["test_id"]: json.loads(p.read_text())
        for directory in reports.values()
        for p in directory.glob("*-hunt.json")
    }
    assert summaries["test_races.py::test_never_hangs"]["hangs"] == 0
    two_rare = summaries["test_races.py::test_two_rare_deadlocks"]
    assert two_rare["runs"] == 80 and len(two_rare["signatures"]) == 2
    assert sum(s["count"] for s in two_rare["signatures"]) == two_rare["hangs"]
    for sig in two_rare["signatures"]:
        assert sig["report"] and (reports["two"] / sig["report"]).exists()
    for session in sessions.values():
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


#: One value through a real session: the fast tier checks every bad count's message
#: (tests/unit/test_settings.py, test_a_bad_hunt_count_is_a_usage_error).
@pytest.mark.parametrize("value", ["many"])
def test_a_bad_run_count_is_a_usage_error(pytester: pytest.Pytester, value: str) -> None:
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess(f"--torch-hang-hunt={value}", "--torch-hang-timeout=5")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [f"*--torch-hang-hunt must be a whole number of runs >= 1*{value}*"]
    )


@pytest.mark.parametrize("value", ["-1", "soon"])
def test_a_bad_seed_is_a_usage_error_naming_the_option(
    pytester: pytest.Pytester, value: str
) -> None:
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess(
        "--torch-hang-hunt=2", f"--torch-hang-hunt-seed={value}", "--torch-hang-timeout=5"
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--torch-hang-hunt-seed must be a whole number >= 0*{value}*"])


def test_a_seed_without_a_hunt_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("--torch-hang-hunt-seed=7", "--torch-hang-timeout=5")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--torch-hang-hunt-seed goes with --torch-hang-hunt=N*"])


STRESSED = f"""
import os
import subprocess
import sys

import pytest

CPUS = {len(os.sched_getaffinity(0))}
LOADED = "pytest_torchhang.inject.stress"


def test_sees_the_pressure_in_every_process_and_only_in_stressed_runs():
    with open(os.environ["PYTEST_TORCH_HANG_STRESS"]) as switch:  # set once a session
        stressed = bool(switch.read())  # this run's seed, or nothing
    assert len(os.sched_getaffinity(0)) == CPUS  # no CPU pinning: races need every CPU
    here = sys.modules.get(LOADED)
    assert (here is not None and here._State.active) is stressed
    assert (sys.getswitchinterval() < 1e-3) is stressed
    child = subprocess.run(
        [sys.executable, "-c", f"import sys; print({{LOADED!r}} in sys.modules)"],
        capture_output=True, text=True, check=True,
    )
    assert child.stdout.strip() == str(stressed)  # the start-up hook of every process
"""


def test_stress_reaches_every_process_of_the_tree_in_odd_runs_and_plain_runs_stay_plain(
    guarded: GuardedRunner,
) -> None:
    guarded.pytester.makepyfile(test_stressed=STRESSED)
    session = guarded.run("--torch-hang-hunt=4", "--torch-hang-hunt-stress", timeout=30)
    assert_outcomes(session.result, passed=4)
    summary = _summary(session.result.stdout.str())
    assert "plain: hung 0 of 2 runs (0.0%, 95% CI 0.0%-65.8%)" in summary, summary
    assert "stressed: hung 0 of 2 runs (0.0%, 95% CI 0.0%-65.8%)" in summary, summary
    assert "as long" in summary, summary  # what a stressed run costs


def test_a_hunt_without_stress_never_loads_it(guarded: GuardedRunner) -> None:
    guarded.pytester.makepyfile(
        test_plain="import sys\n\n\ndef test_plain():\n"
        "    assert 'pytest_torchhang.inject.stress' not in sys.modules\n"
    )
    session = guarded.run("--torch-hang-hunt=2", timeout=30)
    assert_outcomes(session.result, passed=2)
    assert "stressed:" not in session.result.stdout.str()


SEEDED = """
import multiprocessing as mp
import threading

FORK = mp.get_context("fork")
SPAWN = mp.get_context("spawn")


def _child(queue, counter):
    for item in range(5):
        queue.put(item)
        with counter.get_lock():
            counter.value += 1


def _spawned(event):
    event.set()


def test_a_fixed_round_of_meetings():
    queue, counter = FORK.Queue(), FORK.Value("i", 0)
    children = [FORK.Process(target=_child, args=(queue, counter)) for _ in range(2)]
    for child in children:
        child.start()
    assert sorted(queue.get() for _ in range(10)) == sorted(list(range(5)) * 2)
    for child in children:
        child.join()
    assert counter.value == 10
    event = threading.Event()
    thread = threading.Thread(target=event.set)
    thread.start()
    event.wait()
    thread.join()
    spawned_event = SPAWN.Event()
    spawned = SPAWN.Process(target=_spawned, args=(spawned_event,))
    spawned.start()
    spawned_event.wait()
    spawned.join()
"""


def _schedules(directory: Path) -> dict[str, list[str]]:
    """Each process's decisions, by process, then each thread's in its order (threads'
    lines interleave in a process's file as they ran)."""
    out: dict[str, list[str]] = {}
    for path in sorted(directory.glob("*.schedule")):
        lines = path.read_text().splitlines()
        out[path.stem] = sorted(lines, key=lambda line: (line.split()[0], int(line.split()[1])))
    return out


def _deterministic(schedules: dict[str, list[str]]) -> dict[str, list[str]]:
    """The threads whose operations are the same in every run: the main threads (a queue's
    feeder thread loops as often as its buffer happens to be empty)."""
    return {
        process: [line for line in lines if line.startswith("main ")]
        for process, lines in schedules.items()
    }


def test_a_seed_replays_the_same_schedule_in_every_process_and_another_seed_does_not(
    guarded: GuardedRunner,
) -> None:
    guarded.pytester.makepyfile(test_seeded=SEEDED)
    runs = {}
    for name, seed in (("first", "4242"), ("again", "4242"), ("other", "77")):
        record = guarded.pytester.path / f"schedule-{name}"
        record.mkdir()
        guarded.monkeypatch.setenv("PYTEST_TORCH_HANG_STRESS_RECORD", str(record))
        session = guarded.run(
            "-p",
            "no:randomly",
            "--torch-hang-hunt=1",
            f"--torch-hang-hunt-seed={seed}",
            timeout=30,
        )
        assert_outcomes(session.result, passed=1)
        runs[name] = _schedules(record)
    # the pytest process, its two forks, and the child spawned by its third Process.start
    # (its place handed over through the environment)
    assert {"0", "0.1", "0.2", "0.s3"} <= set(runs["first"]), sorted(runs["first"])
    first, again, other = (_deterministic(runs[n]) for n in ("first", "again", "other"))
    assert all(first[p] for p in ("0.1", "0.2", "0.s3")), first
    for process in ("0.1", "0.2", "0.s3"):
        assert first[process] == again[process], process
    assert first["0"] == again["0"]
    assert first != other

"""The monitor's evidence: it holds a stopped pytest, and names the GIL only when it is shown."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from pytest_torchhang import clock
from pytest_torchhang.monitor import evidence
from pytest_torchhang.monitor.evidence import Evidence, Why


@pytest.mark.parametrize(
    ("state", "before", "stopped"),
    [
        ("T", "", True),  # Ctrl-Z or SIGSTOP: at once
        ("T", "S", True),
        ("t", "t", True),  # a debugger holding it across two looks
        ("t", "S", False),  # strace stops it for an instant at every system call
        ("S", "T", False),
        ("R", "", False),
        ("D", "D", False),
        ("", "T", False),  # gone
    ],
)
def test_a_process_is_stopped_by_job_control_or_a_tracer_that_holds_it(
    state: str, before: str, stopped: bool
) -> None:
    assert evidence.is_stopped(state, before) is stopped


FRESH, STALE = 0.8, 10.0


@pytest.mark.parametrize(
    ("seen", "why"),
    [
        # fired, and the watchdog still runs: the test's thread sits in a call no signal ends
        (Evidence(True, FRESH), Why.UNINTERRUPTIBLE),
        (Evidence(True, FRESH, watchdog_switches=80), Why.UNINTERRUPTIBLE),
        # the watchdog has not run for long, and asks for the GIL every few ms: shown
        (Evidence(True, STALE, watchdog_switches=60), Why.GIL_HELD),
        (Evidence(False, STALE, watchdog_switches=60), Why.GIL_HELD),
        # it has not run, but does not ask for the GIL: not shown
        (Evidence(False, STALE, watchdog_switches=1), Why.UNKNOWN),
        (Evidence(False, STALE), Why.UNKNOWN),
        (Evidence(False, None), Why.UNKNOWN),
        (Evidence(True, STALE), Why.UNKNOWN),
        # it ran after the deadline, and still did not fire
        (Evidence(False, FRESH, ran_since_deadline=True), Why.WATCHDOG_RUNS),
        # it began to act (its cold path's import, the debugger check) and did not finish
        (Evidence(False, STALE, busy_s=21.0), Why.WATCHDOG_BUSY),
        (Evidence(False, FRESH, ran_since_deadline=True, busy_s=21.0), Why.WATCHDOG_BUSY),
        (Evidence(False, STALE, watchdog_switches=60, busy_s=21.0), Why.GIL_HELD),
        # it switches as often, but runs: it shares the GIL (an import beside a busy test)
        (Evidence(False, STALE, watchdog_switches=60, watchdog_cpu_s=0.12), Why.UNKNOWN),
        (
            Evidence(False, STALE, watchdog_switches=60, watchdog_cpu_s=0.12, busy_s=21.0),
            Why.WATCHDOG_BUSY,
        ),
        (Evidence(False, STALE, watchdog_switches=60, watchdog_cpu_s=0.002), Why.GIL_HELD),
        (Evidence(True, STALE, busy_s=21.0), Why.UNKNOWN),  # fired: busy no longer counts
    ],
)
def test_the_reason_is_only_what_the_evidence_shows(seen: Evidence, why: Why) -> None:
    assert seen.why is why
    text = evidence.sentence(seen, "main thread", "test_x.py:3 in test_x", "the session ends")
    assert ("holds the GIL" in text) is (why is Why.GIL_HELD), text
    assert "holding the GIL" not in text, text
    assert "test_x.py:3 in test_x" in text, text
    if why is Why.UNINTERRUPTIBLE:
        assert "The GIL is free" in text and "isolate=True" in text, text
    if why in (Why.UNKNOWN, Why.WATCHDOG_BUSY):
        assert "the GIL is not known to be held" in text, text
    if why is Why.WATCHDOG_BUSY:
        assert "began to act on it 21.0s ago" in text, text


@pytest.fixture
def waiting_thread() -> Iterator[int]:
    """A thread of this process in a long timed wait of its own (as the watchdog sleeps)."""
    ready, release = threading.Event(), threading.Event()
    tid: list[int] = []

    def wait() -> None:
        tid.append(threading.get_native_id())
        ready.set()
        release.wait(30)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    ready.wait(10)
    yield tid[0]
    release.set()
    thread.join(10)


def test_a_thread_in_a_timed_wait_of_its_own_is_not_taken_for_a_gil_waiter(
    waiting_thread: int,
) -> None:
    seen = evidence.gather(os.getpid(), False, clock.monotonic(), (waiting_thread, 0.0))
    assert seen.watchdog_switches is not None and seen.watchdog_switches < 3, seen
    assert seen.why is Why.UNKNOWN and seen.watchdog_state == "S", seen


#: A process whose main thread holds the GIL in C (a PyDLL call keeps it) while another Python
#: thread wants to run: that thread's id on stdout, then 10 s of the GIL held.
GIL_HOLDER = """
import ctypes, sys, threading, time

started = threading.Event()
ids = []


def wants_to_run():
    ids.append(threading.get_native_id())
    started.set()
    while True:
        time.sleep(0.01)


threading.Thread(target=wants_to_run, daemon=True).start()
started.wait()
print(ids[0], flush=True)
ctypes.PyDLL(None).sleep(10)
"""


def test_a_thread_waiting_for_the_gil_is_seen_asking_for_it() -> None:
    proc = subprocess.Popen([sys.executable, "-c", GIL_HOLDER], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        tid = int(proc.stdout.readline())
        clock.sleep(0.3)  # its next sleep ends: from then on it waits for the GIL
        seen = evidence.gather(proc.pid, False, clock.monotonic(), (tid, 0.0))
        assert seen.why is Why.GIL_HELD, seen
    finally:
        proc.kill()
        proc.wait()


#: Two Python threads that both compute: each asks for the GIL every switch interval, and gets
#: it half of the time (the watchdog importing its cold path beside a busy test).
GIL_SHARED = """
import sys, threading

ids = []
ready = threading.Event()


def computes():
    ids.append(threading.get_native_id())
    ready.set()
    while True:
        sum(range(1000))


threading.Thread(target=computes, daemon=True).start()
ready.wait()
print(ids[0], flush=True)
while True:
    sum(range(1000))
"""


def test_a_thread_that_shares_the_gil_and_runs_is_not_taken_for_a_gil_waiter() -> None:
    proc = subprocess.Popen([sys.executable, "-c", GIL_SHARED], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        tid = int(proc.stdout.readline())
        switches, cpu = evidence.sample_gil(proc.pid, tid)
        assert switches is not None and switches >= evidence.GIL_WAIT_SWITCHES, switches
        assert cpu is not None and cpu >= evidence.GIL_WAIT_CPU_S, cpu
        assert not evidence.waits_for_gil(switches, cpu)
    finally:
        proc.kill()
        proc.wait()

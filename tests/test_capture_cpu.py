"""Busy or waiting: the CPU a process used during a capture, and the second look at it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psutil

from conftest import GuardedRunner

from pytest_torchhang.capture import pipeline, waitgraph
from pytest_torchhang.diagnosis.roles import is_busy
from pytest_torchhang.report.model import ProcessReport

#: Blocks on stdin; each byte it reads, it computes for 0.1 s of CPU (as a DataLoader worker
#: still starting when the deadline falls), then blocks again.
SETTLES = """
import os, time
while os.read(0, 1):
    end = time.process_time() + 0.1
    while time.process_time() < end:
        pass
"""
SPINS = "while True: pass"


@contextmanager
def _child(code: str) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _blocked_in_read(pid: int) -> None:
    deadline = time.monotonic() + 60  # its start and its CPU, on a loaded machine
    while waitgraph.read([pid]).members[pid].tasks[0].call != "read":
        assert time.monotonic() < deadline, "the child never blocked in read"
        time.sleep(0.02)


def _captured(pid: int, meanwhile: Callable[[], None]) -> ProcessReport:
    """The process's report as a capture's first sample leaves it: its CPU before and after
    ``meanwhile`` (what the process did during the capture)."""
    proc = psutil.Process(pid)
    before = sum(proc.cpu_times()[:2])
    meanwhile()
    cpu = sum(proc.cpu_times()[:2])
    return ProcessReport(
        pid=pid,
        ppid=proc.ppid(),
        role="",
        cmdline="",
        state=proc.status(),
        cpu_s=cpu,
        cpu_delta_s=cpu - before,
        rss_bytes=0,
        num_threads=1,
        age_s=time.time() - proc.create_time(),
        dump_status="ok",
    )


def test_a_process_that_reached_its_wait_during_the_capture_is_not_called_busy() -> None:
    with _child(SETTLES) as child:
        _blocked_in_read(child.pid)

        def computes_then_waits() -> None:
            assert child.stdin is not None
            proc = psutil.Process(child.pid)
            start = sum(proc.cpu_times()[:2])
            os.write(child.stdin.fileno(), b"x")
            deadline = time.monotonic() + 60
            while sum(proc.cpu_times()[:2]) - start < 0.09:  # its 0.1 s, however long it takes
                assert time.monotonic() < deadline, "the child never computed"
                time.sleep(0.01)
            _blocked_in_read(child.pid)

        report = _captured(child.pid, computes_then_waits)
        assert is_busy(report), report.cpu_delta_s  # the first sample alone calls it busy
        pipeline._second_look([report])
        assert report.cpu_delta_s < 0.02 and not is_busy(report)


def test_a_spinning_process_stays_busy_after_the_second_look() -> None:
    with _child(SPINS) as child:
        report = _captured(child.pid, lambda: time.sleep(0.5))
        pipeline._second_look([report])
        assert is_busy(report)


GIL_HELD_SLEEP = """
import ctypes


def test_sleeps_in_c_holding_the_gil():
    ctypes.PyDLL(None).sleep(60)  # a PyDLL call keeps the GIL: the watchdog thread cannot run
"""


def test_a_process_asleep_in_c_holding_the_gil_is_not_called_busy_by_the_monitor(
    guarded: GuardedRunner,
) -> None:
    guarded.pytester.makepyfile(test_gil_sleep=GIL_HELD_SLEEP)
    session = guarded.run(timeout=2)
    text = session.text
    assert "pytest-torchhang: session stopped" in text  # the monitor captured, from outside
    pytest_line = next(line for line in text.splitlines() if "[pytest]" in line)
    assert pytest_line.startswith("--- process "), pytest_line
    # answering the dump signal costs the process CPU: that is not the test's
    assert "(busy)" not in pytest_line, pytest_line
    assert "computing or spinning" not in text
    assert "clock_nanosleep" in text
    # the plugin's own threads (watchdog, launcher) are one line, not stuck threads of the test
    assert "[torch-hang watchdog] (most recent call first)" not in text
    assert "thread(s) of pytest-torchhang itself, not shown: torch-hang watchdog" in text
    session.assert_clean()

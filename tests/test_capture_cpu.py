"""Busy or waiting: the CPU a process used during a capture, and the second look at it."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psutil

from pytest_torchhang.capture import pipeline, waitgraph
from pytest_torchhang.diagnosis.roles import is_busy
from pytest_torchhang.report.model import ProcessReport

#: Computes for a moment, as a DataLoader worker still starting, then blocks on stdin for good.
SETTLES = "import sys, time\nend = time.process_time() + 0.2\nwhile time.process_time() < end: pass\nsys.stdin.read()"
SPINS = "while True: pass"


@contextmanager
def _child(code: str) -> Iterator[psutil.Process]:
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
    try:
        yield psutil.Process(proc.pid)
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _seen_busy(proc: psutil.Process) -> ProcessReport:
    """The process's report as a capture that saw it use CPU (more than the busy mark) leaves it."""
    times = proc.cpu_times()
    return ProcessReport(
        pid=proc.pid,
        ppid=proc.ppid(),
        role="",
        cmdline="",
        state=proc.status(),
        cpu_s=times.user + times.system,
        cpu_delta_s=0.05,
        rss_bytes=0,
        num_threads=1,
        age_s=time.time() - proc.create_time(),
        dump_status="ok",
    )


def test_a_process_that_reached_its_wait_during_the_capture_is_not_called_busy() -> None:
    with _child(SETTLES) as proc:
        deadline = time.monotonic() + 60  # its start and its 0.2 s of CPU, on a loaded machine
        while waitgraph.read([proc.pid]).members[proc.pid].tasks[0].call != "read":
            assert time.monotonic() < deadline, "the child never blocked in read"
            time.sleep(0.02)
        report = _seen_busy(proc)
        assert is_busy(report)
        pipeline._second_look([report])
        assert report.cpu_delta_s < 0.02 and not is_busy(report)


def test_a_spinning_process_stays_busy_after_the_second_look() -> None:
    with _child(SPINS) as proc:
        deadline = time.monotonic() + 60
        while proc.cpu_times().user < 0.1:
            assert time.monotonic() < deadline, "the child never ran"
            time.sleep(0.02)
        report = _seen_busy(proc)
        pipeline._second_look([report])
        assert is_busy(report)

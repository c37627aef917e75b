"""A soak: 60 hangs in a row in one session, every one reported, the pytest process kept flat."""

from __future__ import annotations

import json
import re

from conftest import GuardedRunner, assert_hang
from outcomes import assert_outcomes

KINDS = ("lock", "subprocess", "mp_fork", "setsid_fork")

SOAK = """
import json
import multiprocessing
import os
import subprocess
import threading
import time

import psutil
import pytest

KINDS = ("lock", "subprocess", "mp_fork", "setsid_fork")


def _sleep():
    time.sleep(1000)


def hang(kind):
    if kind == "lock":  # the main thread itself is blocked
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()
    elif kind == "subprocess":
        subprocess.Popen(["sleep", "1000"]).wait()
    elif kind == "mp_fork":
        child = multiprocessing.get_context("fork").Process(target=_sleep)
        child.start()
        child.join()
    else:
        pid = os.fork()
        if pid == 0:
            os.setsid()
            time.sleep(1000)
            os._exit(0)
        os.waitpid(pid, 0)


def measure(label):
    me = psutil.Process()
    children = me.children()
    sample = {
        "label": label,
        "fds": me.num_fds(),
        "threads": me.num_threads(),
        "rss": me.memory_info().rss,
        "children": len(children),
        "zombies": sum(1 for c in children if c.status() == psutil.STATUS_ZOMBIE),
        "thread_names": sorted(t.name for t in threading.enumerate()),
    }
    with open("soak.jsonl", "a") as out:
        out.write(json.dumps(sample) + "\\n")


@pytest.mark.parametrize("n", range(10))
def test_hang_early(n):
    hang(KINDS[n % 4])


def test_measure_after_10_hangs():
    measure("after 10")


@pytest.mark.parametrize("n", range(10, 60))
def test_hang_late(n):
    hang(KINDS[n % 4])


def test_measure_after_60_hangs():
    measure("after 60")


@pytest.mark.parametrize("n", range(5))
def test_passes_after_the_hangs(n):
    assert multiprocessing.active_children() == []
"""


def test_sixty_hangs_in_a_row_are_all_reported_and_leak_nothing(guarded: GuardedRunner) -> None:
    guarded.pytester.makepyfile(test_soak=SOAK)
    session = guarded.run(timeout=0.5, wait_s=600)
    assert_outcomes(session.result, hang=60, passed=7)
    out = session.result.stdout.str()

    # every hang has its report and its line in the summary
    hung = re.findall(r"^HANG test_soak\.py::test_hang_(?:early|late)\[(\d+)\] ", out, re.M)
    assert sorted(map(int, hung)) == list(range(60))
    summary = out.split("torch-hang summary", 1)[1]
    assert len(re.findall(r"^HANG after \d+\.\ds in test_soak\.py::", summary, re.M)) == 60
    # the last hang of each kind is as complete as the first
    for n in (0, 1, 2, 3, 56, 57, 58, 59):
        group = "early" if n < 10 else "late"
        expected = {
            "lock": ["*lock.acquire()", "cleanup: killed 0 process(es)*"],
            "subprocess": ["*cmdline: sleep 1000", "cleanup: killed 1 process(es)*"],
            "mp_fork": ["*[[]multiprocessing.Process(target=_sleep)[]]*", "cleanup: killed 1 *"],
            "setsid_fork": ["*time.sleep(1000)", "cleanup: killed 1 process(es)*"],
        }[KINDS[n % 4]]
        report = assert_hang(session, f"test_hang_{group}[{n}]", "HANG after *", *expected)
        assert "COULD NOT KILL" not in report

    # the pytest process stayed flat from hang 10 to hang 60
    lines = (guarded.pytester.path / "soak.jsonl").read_text().splitlines()
    after_10, after_60 = (json.loads(line) for line in lines)
    assert after_60["fds"] <= after_10["fds"] + 10, (after_10, after_60)
    assert after_60["threads"] <= after_10["threads"] + 2, (after_10, after_60)
    assert after_60["rss"] - after_10["rss"] < 50 << 20, (after_10, after_60)
    assert after_60["zombies"] == after_10["zombies"] == 0, (after_10, after_60)
    assert after_60["children"] <= after_10["children"], (after_10, after_60)
    assert after_60["thread_names"] == after_10["thread_names"], (after_10, after_60)
    session.assert_clean()  # nothing left running, /dev/shm as it was

"""Under pytest-xdist, a hang in one worker neither crashes that worker nor delays the other."""

from __future__ import annotations

import json

from conftest import GuardedRunner, assert_hang
from outcomes import assert_outcomes

HANG_TIMEOUT_S = 8.0  # long enough for the other worker to run two quick tests on a busy machine

RECORD = """
import json
import os


def record(**fields):
    fields["worker"] = os.environ.get("PYTEST_XDIST_WORKER", "")
    fields["pid"] = os.getpid()
    with open("timeline.jsonl", "a") as out:
        out.write(json.dumps(fields) + "\\n")
"""

HANGS_HERE = """
import subprocess
import threading
import time

from timeline import record


def test_hang_in_this_worker():
    record(event="hang", at=time.time())
    subprocess.Popen(["sleep", "1000"])
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()


def test_this_worker_goes_on_after_the_hang():
    record(event="after hang", at=time.time())
"""

# Each test has a child of its own running, some of them while the other worker's tree is killed.
QUICK_THERE = """
import subprocess
import time

import pytest

from timeline import record


@pytest.mark.parametrize("n", range(12))
def test_quick(n):
    start = time.time()
    assert subprocess.run(["sleep", "0.4"]).returncode == 0
    record(event="quick", start=start, end=time.time())
"""


def test_a_hang_in_one_worker_spares_the_worker_and_the_other_one(guarded: GuardedRunner) -> None:
    guarded.pytester.makepyfile(
        timeline=RECORD, test_hangs_here=HANGS_HERE, test_quick_there=QUICK_THERE
    )
    # loadfile: one file per worker
    session = guarded.run("-n", "2", "--dist", "loadfile", "-rA", timeout=HANG_TIMEOUT_S)
    assert_outcomes(session.result, hang=1, passed=13)
    text = session.text
    assert "crashed" not in text and "replacing" not in text, text[-3000:]

    # the controller got the whole report from the worker
    assert_hang(
        session,
        "test_hang_in_this_worker",
        "HANG after *s in test_hangs_here.py::test_hang_in_this_worker: 2 processes*",
        "*lock.acquire()",
        "*cmdline: sleep 1000",
        "cleanup: killed 1 process(es)*",
    )
    session.result.stdout.fnmatch_lines(["*torch-hang summary*", "HANG after *"])

    events = [
        json.loads(line)
        for line in (guarded.pytester.path / "timeline.jsonl").read_text().splitlines()
    ]
    (hang,) = (e for e in events if e["event"] == "hang")
    (after,) = (e for e in events if e["event"] == "after hang")
    quick = [e for e in events if e["event"] == "quick"]
    # the hung worker is the same process afterwards: it survived
    assert after["pid"] == hang["pid"] and after["at"] >= hang["at"] + HANG_TIMEOUT_S
    assert len(quick) == 12 and hang["pid"] not in {e["pid"] for e in quick}
    # the other worker went on while the hang lasted, and was not held up by it
    hang_end = hang["at"] + HANG_TIMEOUT_S
    during = [e for e in quick if e["start"] >= hang["at"] and e["end"] <= hang_end]
    assert len(during) >= 2, (hang, quick)
    assert session.wall_s < HANG_TIMEOUT_S + 60, session.wall_s
    session.assert_clean()

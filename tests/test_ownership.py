"""A hang kills only what the hung test started: fixtures' processes before it are context."""

from __future__ import annotations

import pytest

from conftest import GuardedRunner, assert_hang
from outcomes import assert_outcomes

SERVER = """
import os
import signal
import subprocess
import sys
import time

import pytest

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


@pytest.fixture(scope="session")
def server():
    # a session-scoped service, with a worker of its own (a grandchild of pytest)
    proc = subprocess.Popen(
        [sys.executable, "-c",
         "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
         "'import time; time.sleep(120)']); time.sleep(120)"],
        start_new_session=True,
    )
    time.sleep(0.5)
    yield proc
    assert proc.poll() is None, f"the session's server was killed: poll() -> {proc.poll()}"
    os.killpg(proc.pid, signal.SIGKILL)  # the server and its worker
    proc.wait()


def test_uses_the_server(server):
    assert server.poll() is None


def test_hangs_with_a_child_of_its_own(server):
    mine = subprocess.Popen(SLEEPER)
    try:
        time.sleep(60)
    finally:
        # the plugin killed it and left its exit status to its owner
        assert mine.wait(timeout=10) == -signal.SIGKILL, mine.returncode


def test_the_server_is_still_there(server):
    assert server.poll() is None
"""


def test_a_session_fixture_server_survives_an_unrelated_hang(guarded: GuardedRunner) -> None:
    guarded.pytester.makepyfile(test_server=SERVER)
    session = guarded.run("-p", "no:randomly", timeout=2)
    assert_outcomes(session.result, passed=2, hang=1)
    report = assert_hang(
        session,
        "test_hangs_with_a_child_of_its_own",
        "*process * [started before this test*",
        "*neither signalled nor killed*",
        "cleanup: killed 1 process(es)*",
    )
    assert "INTERNALERROR" not in session.text
    # the server and its worker are reported, and only the test's own sleeper was killed
    assert report.count("[started before this test") == 2, report
    session.assert_clean()


LEFTOVERS = """
import subprocess
import sys
import time

import pytest

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]
SERVICE = []


@pytest.fixture(scope="session")
def service():
    # started by a session fixture and, carelessly, never stopped: not the plugin's to kill
    SERVICE.append(subprocess.Popen(SLEEPER + ["service"]))
    yield


def test_leaves_a_child_running(service):
    subprocess.Popen(SLEEPER + ["leftover"])


def test_passes(service):
    time.sleep(0.1)
"""


def test_session_end_kills_what_tests_left_and_spares_what_fixtures_started(
    guarded: GuardedRunner,
) -> None:
    guarded.pytester.makepyfile(test_leftovers=LEFTOVERS)
    session = guarded.run(timeout=5, grace_s=1)
    assert_outcomes(session.result, passed=2)
    session.result.stdout.fnmatch_lines(
        [
            "*torch-hang: processes left running by tests*",
            "*time.sleep(120) leftover",
            "killed 1 process(es) at session end: tests started them*",
        ]
    )
    assert "service" not in session.result.stdout.str().split("left running by tests")[1]
    # what the session fixture started is still there after pytest exited: its to stop, not ours
    assert [line for line in session.leftovers if line.endswith("service")], session.leftovers
    assert not [line for line in session.leftovers if line.endswith("leftover")]


PERSISTENT_WORKERS = """
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset


class Squares(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.tensor([i * i])


@pytest.fixture(scope="module")
def loader():
    return DataLoader(Squares(), batch_size=2, num_workers=2, persistent_workers=True)


def test_first_epoch(loader):
    assert sum(int(b.sum()) for b in loader) == 140


def test_an_unrelated_hang(loader):
    time.sleep(60)


def test_second_epoch_uses_the_same_workers(loader):
    assert sum(int(b.sum()) for b in loader) == 140
"""


@pytest.mark.timeout(300)
def test_module_scoped_persistent_workers_survive_a_later_tests_hang(
    guarded: GuardedRunner,
) -> None:
    guarded.pytester.makepyfile(test_persistent=PERSISTENT_WORKERS)
    # the loader's workers are forked (torch is imported at collection) and serve 8 items in
    # the first test: 4 s is wide on a busy machine, and the hung test waits all of it
    session = guarded.run("-p", "no:randomly", timeout=4)
    assert_outcomes(session.result, passed=2, hang=1)
    report = session.report_of("test_an_unrelated_hang")
    assert "killed 0 process(es)" in report, report
    assert report.count("[started before this test") == 2, report
    session.assert_clean()

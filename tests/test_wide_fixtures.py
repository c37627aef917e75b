"""Fixtures wider than one test: one hang in their setup counts once, a value whose wait the
kill ended is never handed on, and the workers their pools start during a test stay theirs.

pytest caches a module-, class- or session-scoped fixture's value, or its setup's failure, for
every later test of its scope. Each scenario is a real session with a real hang: the count of
outcomes, of JSON reports, the next test's success and what is left running are asserted.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import GuardedRunner, assert_hang
from outcomes import assert_outcomes

HUNG_SETUP = """
import threading

import pytest


@pytest.fixture(scope="{scope}")
def stuck():
    threading.Event().wait()  # never set: the fixture's setup hangs


@pytest.fixture
def through(stuck):
    return stuck


class TestUsers:
    @pytest.mark.parametrize("i", range(3))
    def test_uses(self, stuck, i):
        pass

    def test_uses_it_through_another_fixture(self, through):
        pass


def test_does_not_use_it():
    pass
"""


@pytest.mark.parametrize(
    ("scope", "option"),
    [
        ("session", "--torch-hang-timeout=2"),
        ("module", "--torch-hang-timeout=2"),
        ("class", "--torch-hang-timeout=2"),
        ("session", "--timeout=2"),  # pytest-timeout's deadline, taken over
    ],
)
def test_a_hang_in_a_wider_fixtures_setup_counts_once(
    guarded: GuardedRunner, tmp_path: Path, scope: str, option: str
) -> None:
    guarded.pytester.makepyfile(test_hung_setup=HUNG_SETUP.format(scope=scope))
    reports = tmp_path / "reports"
    session = guarded.run(
        "-p", "no:randomly", option, f"--torch-hang-report-dir={reports}", timeout=None
    )
    # one hang, in the setup of the first test that used it; the later ones get pytest's
    # setup error for that fixture, and the test that does not use it passes
    assert_outcomes(session.result, passed=1, errors=3, hang=1)
    assert_hang(session, "TestUsers.test_uses[0]", "*in stuck*")
    assert len(list(reports.glob("*.json"))) == 1, sorted(reports.iterdir())
    out = session.result.stdout.str()
    for later in (
        "TestUsers.test_uses[1]",
        "TestUsers.test_uses[2]",
        "TestUsers.test_uses_it_through_another_fixture",
    ):
        error = session.report_of(later)
        assert error.lstrip("_ ").startswith(f"ERROR at setup of {later}"), error
        assert (
            f"the {scope}-scoped fixture 'stuck' hung in the setup of "
            "test_hung_setup.py::TestUsers::test_uses[0]: that hang is reported there, once"
        ) in error, error
    # its report's headline and its line in the torch-hang summary, once each
    headlines = [line for line in out.splitlines() if line.startswith("HANG after")]
    assert len(headlines) == 2, out[-3000:]
    assert "INTERNALERROR" not in session.text
    session.assert_clean()


SERVER = """
import subprocess
import sys

import pytest


@pytest.fixture(scope="session")
def server():
    # waits for a "ready" line that never comes: once the server is killed, the read ends (EOF)
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"], stdout=subprocess.PIPE
    )
    line = proc.stdout.readline()
    if {checks} and not line:
        raise RuntimeError("the server exited before it was ready")
    yield proc
    proc.kill()
    proc.wait()


def test_first(server):
    assert server.poll() is None, f"handed a dead server: {{server.poll()}}"


def test_second(server):
    assert server.poll() is None, f"handed a dead server: {{server.poll()}}"


def test_does_not_use_it():
    pass
"""


@pytest.mark.parametrize("checks", [False, True], ids=["returns-after-eof", "raises-after-eof"])
def test_a_fixture_whose_wait_the_kill_ended_is_not_handed_on(
    guarded: GuardedRunner, tmp_path: Path, checks: bool
) -> None:
    guarded.pytester.makepyfile(test_server=SERVER.format(checks=checks))
    reports = tmp_path / "reports"
    session = guarded.run("-p", "no:randomly", f"--torch-hang-report-dir={reports}", timeout=2)
    # the setup fails as the hang it was; the next test gets that failure, not a dead server
    assert_outcomes(session.result, passed=1, errors=1, hang=1)
    assert "handed a dead server" not in session.text, session.text[-4000:]
    report = assert_hang(session, "test_first", "cleanup: killed 1 process(es)*")
    assert "(during setup)" in report.splitlines()[1], report[:2000]
    assert "hung in the setup of test_server.py::test_first" in session.report_of("test_second")
    assert len(list(reports.glob("*.json"))) == 1, sorted(reports.iterdir())
    assert "INTERNALERROR" not in session.text
    session.assert_clean()


POOLS = """
import concurrent.futures
import multiprocessing
import subprocess
import sys
import threading

import pytest


@pytest.fixture(scope="session")
def executor():
    with concurrent.futures.ProcessPoolExecutor(2) as pool:  # its workers start at first use
        yield pool


@pytest.fixture(scope="module")
def pools():
    # a pool held inside the fixture's value, and processes a test starts and merely files here
    with multiprocessing.get_context("fork").Pool(2, maxtasksperchild=1) as pool:
        yield {"pool": pool, "filed": []}


def test_first_use_then_a_hang(executor, pools):
    assert sum(executor.map(abs, [-1, -2, -3])) == 6
    assert pools["pool"].apply(abs, (-4,)) == 4  # a worker replaced during this test
    pools["filed"].append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
    threading.Event().wait()


def test_the_same_pools_serve_the_next_test(executor, pools):
    assert sum(executor.map(abs, [-1, -2, -3])) == 6
    assert pools["pool"].apply(abs, (-4,)) == 4
    # the process the hung test started itself was its own: killed
    assert pools["filed"][0].wait(timeout=10) == -9
"""


def test_the_workers_of_a_wider_fixtures_pool_are_spared_and_shown(
    guarded: GuardedRunner, tmp_path: Path
) -> None:
    guarded.pytester.makepyfile(test_pools=POOLS)
    reports = tmp_path / "reports"
    session = guarded.run("-p", "no:randomly", f"--torch-hang-report-dir={reports}", timeout=3)
    assert_outcomes(session.result, passed=1, hang=1)
    report = assert_hang(
        session,
        "test_first_use_then_a_hang",
        "note: spared * worker process(es) * the workers of the ProcessPoolExecutor of the "
        "session-scoped fixture 'executor', the multiprocessing.Pool of the module-scoped "
        "fixture 'pools', which outlive this test*",
        "--- process * [[]fixture-owned worker (multiprocessing.Process(target=_process_worker))]*",
        "--- process * [[]fixture-owned worker (Pool worker)]*",
        "cleanup: killed 1 process(es)*",
    )
    # their stacks are shown, for context; the headline names the test, not an idle worker
    assert "_process_worker" in report and "in test_first_use_then_a_hang" in report, report
    assert "left running by tests" not in session.text, session.text[-3000:]
    assert len(list(reports.glob("*.json"))) == 1, sorted(reports.iterdir())
    session.assert_clean()


PERSISTENT_WORKERS = """
import threading

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


def test_first_epoch_then_a_hang(loader):
    # the workers start here, at the first epoch, and belong to the module's loader
    assert sum(int(b.sum()) for b in loader) == 140
    threading.Event().wait()


def test_second_epoch_uses_the_same_workers(loader):
    assert sum(int(b.sum()) for b in loader) == 140
"""


@pytest.mark.timeout(300)
def test_persistent_dataloader_workers_started_in_a_hung_test_stay_the_loaders(
    guarded: GuardedRunner, tmp_path: Path
) -> None:
    guarded.pytester.makepyfile(test_persistent=PERSISTENT_WORKERS)
    reports = tmp_path / "reports"
    # the first epoch forks two workers (torch is imported at collection: they start in
    # milliseconds) before the hang begins; 5 s is wide on a busy machine too, and the hung
    # test waits all of it
    session = guarded.run("-p", "no:randomly", f"--torch-hang-report-dir={reports}", timeout=5)
    assert_outcomes(session.result, passed=1, hang=1)
    report = assert_hang(
        session,
        "test_first_epoch_then_a_hang",
        "note: spared 2 worker process(es) * the workers of the persistent DataLoader of the "
        "module-scoped fixture 'loader'*",
        "--- process * [[]fixture-owned worker (DataLoader worker 0/2*",
        "cleanup: killed 0 process(es)*",
    )
    assert "_worker_loop" in report, report  # the workers' stacks, for context
    assert "in test_first_epoch_then_a_hang" in report.splitlines()[1], report[:2000]
    assert "worker exited unexpectedly" not in session.text
    assert "left running by tests" not in session.text, session.text[-3000:]
    assert len(list(reports.glob("*.json"))) == 1, sorted(reports.iterdir())
    session.assert_clean()

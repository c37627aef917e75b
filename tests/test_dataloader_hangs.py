"""DataLoader workers that hang: deadlocked in __getitem__ (fork, spawn, forkserver), or reading a pipe."""

from __future__ import annotations

import subprocess
import sys

from conftest import GuardedRunner, assert_hang
from outcomes import assert_outcomes

DEADLOCKED_WORKERS = '''
import os
import threading

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

_LOCK = None
# spawn and forkserver workers import torch (3 s idle, 2-3x that on a busy machine) before
# their first sample: their deadline covers that with a wide margin
SLOW_START = pytest.mark.torch_hang(timeout=25)


class SelfDeadlockingDataset(Dataset):
    """Takes a plain Lock twice: every worker blocks in __getitem__ forever."""

    def __len__(self):
        return 8

    def __getitem__(self, index):
        global _LOCK
        if _LOCK is None:
            _LOCK = threading.Lock()
        with _LOCK:
            with _LOCK:
                return torch.tensor([index])


@pytest.mark.parametrize(
    "context",
    ["fork", pytest.param("spawn", marks=SLOW_START), pytest.param("forkserver", marks=SLOW_START)],
)
def test_worker_deadlock(context):
    for _ in DataLoader(SelfDeadlockingDataset(), num_workers=2, multiprocessing_context=context):
        pass


def test_next_test_runs():
    assert sum(DataLoader(list(range(4)), batch_size=2).__iter__().__next__()) == 1
'''

FORK_LOCK = """
import threading

import torch
from torch.utils.data import DataLoader, Dataset

LOCK = threading.Lock()


class LockedDataset(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        with LOCK:
            return torch.tensor([index])


def test_lock_held_at_fork():
    LOCK.acquire()  # another thread's lock, held while the workers fork
    try:
        for _ in DataLoader(LockedDataset(), num_workers=2, multiprocessing_context="fork"):
            pass
    finally:
        LOCK.release()


def test_next_test_runs():
    pass
"""

PIPE_READER = """
import os

from torch.utils.data import DataLoader, Dataset

READ_FD, WRITE_FD = os.pipe()  # nobody ever writes


class PipeDataset(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        return os.read(READ_FD, 1)


def test_worker_reads_a_silent_pipe():
    for _ in DataLoader(PipeDataset(), num_workers=1, multiprocessing_context="fork"):
        pass


def test_next_test_runs():
    pass
"""


#: Four workers, of which one is stuck in __getitem__ and three go idle: the report names the odd
#: one out (tests/unit/record.py records it for tests/unit/recorded_views/).
ONE_STUCK_OF_FOUR = """
import time

import torch
from torch.utils.data import DataLoader, Dataset


class OneSlowIndex(Dataset):
    \"\"\"Index 1 never returns: its worker waits in __getitem__, the other three go idle.\"\"\"

    def __len__(self):
        return 64

    def __getitem__(self, index):
        if index == 1:
            time.sleep(3600)
        return torch.tensor([index])


def test_one_worker_of_four_hangs():
    for _ in DataLoader(OneSlowIndex(), num_workers=4, multiprocessing_context="fork"):
        pass
"""


#: The other way round: three workers deadlock in __getitem__ and one goes idle. The idle one
#: differs from the crowd, but the crowd is the story: the headline must not name the idle one.
THREE_STUCK_ONE_IDLE = """
import threading

import torch
from torch.utils.data import DataLoader, Dataset

_LOCK = None


class MostIndicesDeadlock(Dataset):
    \"\"\"Every index but those of worker 0 takes a plain lock twice.\"\"\"

    def __len__(self):
        return 64

    def __getitem__(self, index):
        global _LOCK
        if _LOCK is None:
            _LOCK = threading.Lock()
        if index % 4:
            with _LOCK:
                with _LOCK:
                    pass
        return torch.tensor([index])


def test_three_workers_of_four_deadlock():
    for _ in DataLoader(MostIndicesDeadlock(), num_workers=4, multiprocessing_context="fork"):
        pass
"""


def test_deadlocked_workers_a_lock_held_at_fork_and_a_silent_pipe_each_get_their_hint(
    guarded: GuardedRunner,
) -> None:
    guarded.pytester.makepyfile(
        test_loader=DEADLOCKED_WORKERS, test_fork_lock=FORK_LOCK, test_pipe=PIPE_READER
    )
    # The spawn and forkserver hangs each wait their 25 s deadline (their workers import torch
    # first); the forked scenarios take 3 s each. Three sessions, two at a time, each mostly
    # waiting: the forked ones beside the spawn one, then the forkserver one (so the spawn and
    # forkserver workers' torch imports do not meet): about 25 s saved a run.
    loader = "test_loader.py::test_worker_deadlock"
    sessions = guarded.run_many(
        {
            "fork": (
                f"{loader}[fork]",
                "test_loader.py::test_next_test_runs",
                "test_fork_lock.py",
                "test_pipe.py",
            ),
            "spawn": (f"{loader}[spawn]",),
            "forkserver": (f"{loader}[forkserver]",),
        },
        at_once=2,
        timeout=3,
    )
    session = sessions["fork"]
    assert_outcomes(session.result, hang=3, passed=3)
    for context in ("spawn", "forkserver"):
        assert_outcomes(sessions[context].result, hang=1)
    for context in ("fork", "spawn", "forkserver"):
        report = assert_hang(
            sessions[context],
            f"test_worker_deadlock[{context}]",
            "HANG after * 2 stuck in DataLoader worker __getitem__",
            "*[[]DataLoader worker 0/2 (dataset SelfDeadlockingDataset)[]]*",
            "*[[]DataLoader worker 1/2 (dataset SelfDeadlockingDataset)[]]*",
            '*File "*test_loader.py", line *, in __getitem__',
            "*with _LOCK:",
            "hint: 2 DataLoader worker(s) wait for a lock*",
            "cleanup: killed *",
        )
        assert "COULD NOT KILL" not in report
    # a lock held by another thread when the workers were forked
    assert_hang(
        session,
        "test_lock_held_at_fork",
        "*held by another thread when the workers were forked*multiprocessing_context='spawn'*",
        "*with LOCK:",
    )
    # a worker reading a pipe nobody writes to
    assert_hang(
        session,
        "test_worker_reads_a_silent_pipe",
        "*1 stuck in DataLoader worker __getitem__",
        "*return os.read(READ_FD, 1)",
        "hint: 1 process(es) block reading a pipe*",
    )
    for each in sessions.values():
        each.assert_clean()


def test_of_four_workers_the_one_stuck_in_getitem_is_named_first_and_the_idle_three_folded(
    guarded: GuardedRunner,
) -> None:
    guarded.pytester.makepyfile(test_odd=ONE_STUCK_OF_FOUR)
    session = guarded.run(timeout=3)
    assert_outcomes(session.result, hang=1)
    report = assert_hang(
        session,
        "test_one_worker_of_four_hangs",
        "HANG after * 5 processes, DataLoader worker ?/4 (dataset OneSlowIndex) (pid *) stuck in "
        "__getitem__ (3 other DataLoader workers wait in _worker_loop -> queues.get*)",
        "processes, the odd one out first:",
        "  3 DataLoader workers (pids *, *, *): _worker_loop -> queues.get*",
        "    the same stacks, shown once: pid * [[]DataLoader worker ?/4[]], pid * [[]*",
        "*time.sleep(3600)",
        "        ... multiprocessing's start-up frames cut",
    )
    lines = report.splitlines()
    first = lines[2] if lines[1].startswith("[gw") else lines[1]
    stuck = next(line for line in lines if line.startswith("--- process "))
    # the first block is the stuck worker's, the three idle ones are one block
    assert "(dataset OneSlowIndex)" in stuck and stuck.split()[2] in first, (stuck, first)
    assert sum(line.startswith("--- process ") for line in lines) == 3  # stuck, pytest, idle
    assert "multiprocessing/popen_fork.py" not in report  # the fork's frames are cut
    # the plugin's own threads in pytest (the /proc reader) are one line, not a stack
    assert "thread(s) of pytest-torchhang itself, not shown:" in report
    assert "pytest_torchhang/capture/procfs.py" not in report
    session.assert_clean()


FILE_SYSTEM_SHARING = """
import threading

import torch
import torch.multiprocessing as tmp
from torch.utils.data import DataLoader, Dataset

tmp.set_sharing_strategy("file_system")
_LOCK = threading.Lock()


class FirstBatchOnly(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        if index >= 8:
            with _LOCK:
                with _LOCK:
                    pass
        return torch.ones(3, 32, 32)


def test_hangs_after_the_first_batch():
    batches = []
    for batch in DataLoader(FirstBatchOnly(), batch_size=8, num_workers=1):
        batches.append(batch)  # the test holds a batch in shared memory


def test_next_test_runs():
    pass
"""


def test_file_system_sharing_leaves_no_segment_behind(guarded: GuardedRunner) -> None:
    # The test still maps a batch served by the worker's torch_shm_manager: the manager is
    # spared (killing it would make freeing the batch abort pytest) and cleans up at exit.
    guarded.pytester.makepyfile(test_fs=FILE_SYSTEM_SHARING)
    session = guarded.run(timeout=3)
    assert_outcomes(session.result, hang=1, passed=1)
    assert_hang(
        session,
        "test_hangs_after_the_first_batch",
        "*[[]torch_shm_manager[]]*",
        "hint: 1 DataLoader worker(s) wait for a lock that nothing in the worker will release*",
        "cleanup: killed 1 process(es)*left * running*",
    )
    session.assert_clean()


KILLED_FROM_A_THREAD = """
import os
import signal
import threading
import time

from torch.utils.data import DataLoader, Dataset

from pytest_torchhang.capture import kill


class Stuck(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        time.sleep(1000)


def python_in_the_main_thread(seconds):
    # as pytest's hooks run after a hang: where torch's SIGCHLD handler raises, if it does
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.01)


def outcome(who, seconds=3):
    try:
        python_in_the_main_thread(seconds)
        print(f"{who}: quiet", flush=True)
    except RuntimeError as exc:
        print(f"{who}: {exc}", flush=True)


hung = iter(DataLoader(Stuck(), num_workers=2, multiprocessing_context="fork"))
killer = threading.Thread(target=kill.kill_tree, args=(os.getpid(),))  # as the watchdog does
killer.start()
outcome("killed by the guard")
killer.join()
other = iter(DataLoader(Stuck(), num_workers=1, multiprocessing_context="fork"))
os.kill(other._workers[0].pid, signal.SIGKILL)
outcome("killed by someone else")
os._exit(0)
"""


def test_workers_the_guard_kills_never_make_torchs_sigchld_handler_raise_in_pytest() -> None:
    # A worker's SIGCHLD that came after the test had ended raised torch's "DataLoader worker
    # (pid N) is killed by signal" inside pytest's report hook: INTERNALERROR, the session over.
    done = subprocess.run(
        [sys.executable, "-c", KILLED_FROM_A_THREAD],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    lines = done.stdout.splitlines()
    assert lines[0] == "killed by the guard: quiet", done.stdout + done.stderr
    # a worker that died otherwise is still torch's error to raise
    assert lines[1].startswith("killed by someone else: DataLoader worker (pid"), lines
    assert "is killed by signal: Killed" in lines[1]

"""multiprocessing hangs: a Process joined before its Queue is drained, a Manager lock never released."""

from __future__ import annotations

from conftest import GuardedRunner, assert_hang
from outcomes import assert_outcomes

SCENARIOS = """
import multiprocessing as mp

import pytest


def _put_a_lot(queue):
    queue.put(b"x" * (4 << 20))  # larger than a pipe buffer: the feeder thread blocks at exit


def test_join_before_drain():
    queue = mp.Queue()
    child = mp.Process(target=_put_a_lot, args=(queue,))
    child.start()
    child.join()
    queue.get()


def _take(lock):
    lock.acquire()


def test_manager_lock_never_released():
    with mp.Manager() as manager:
        lock = manager.Lock()
        lock.acquire()
        child = mp.Process(target=_take, args=(lock,))
        child.start()
        child.join()


def _square(x):
    import time
    time.sleep(1000)


@pytest.mark.torch_hang(timeout=6)  # both spawned workers reach _square, even on a busy machine
def test_pool_worker_never_returns():
    with mp.get_context("spawn").Pool(2) as pool:
        pool.map(_square, range(2))


def test_next_test_runs():
    assert mp.active_children() == []
"""


def test_multiprocessing_hangs_are_caught_with_their_hints(guarded: GuardedRunner) -> None:
    guarded.pytester.makepyfile(test_mp=SCENARIOS)
    session = guarded.run(timeout=2)
    assert_outcomes(session.result, hang=3, passed=1)
    assert_hang(
        session,
        "test_join_before_drain",
        "*[[]queue feeder thread[]]*",
        "*in _finalize_join",
        "*in test_join_before_drain",
        "*child.join()",
        "hint: pid * joins a process that cannot exit until its multiprocessing Queue is flushed*",
    )
    assert_hang(
        session,
        "test_manager_lock_never_released",
        "*[[]Manager server[]]*",
        "*[[]multiprocessing.Process(target=_take)[]]*",
        "*lock.acquire()",
        "hint: 1 process(es) wait on a Manager proxy call while the Manager server is blocked*",
    )
    assert_hang(
        session,
        "test_pool_worker_never_returns",
        "*2 stuck in Pool worker _square",
        "*[[]Pool worker[]]*",
        "*time.sleep(1000)",
    )
    session.assert_clean()

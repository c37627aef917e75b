"""The parent ignores SIGTERM (to survive its launcher's shutdown) before it forks a worker: the
disposition is inherited, so terminate() does nothing and join() waits forever."""

import multiprocessing
import signal
import time

import pytest

CTX = multiprocessing.get_context("fork")


def serve():
    while True:
        time.sleep(0.05)


@pytest.fixture
def restore_sigterm():
    old = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, old)


def test_stop_worker_of_a_parent_that_ignores_sigterm(restore_sigterm):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    worker = CTX.Process(target=serve, name="cache-server")
    worker.start()
    time.sleep(0.2)
    worker.terminate()
    worker.join()
    assert worker.exitcode == -signal.SIGTERM


def test_stop_worker(restore_sigterm):
    worker = CTX.Process(target=serve, name="cache-server")
    worker.start()
    time.sleep(0.2)
    worker.terminate()
    worker.join()
    assert worker.exitcode == -signal.SIGTERM

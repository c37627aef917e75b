"""The parent blocks SIGTERM in its main thread (so that only a dedicated thread would take it) and
then forks a worker: the child inherits the blocked signal mask, so terminate()'s SIGTERM stays
pending in the worker and join() waits forever."""

import multiprocessing
import signal
import time

import pytest

CTX = multiprocessing.get_context("fork")


def serve():
    while True:
        time.sleep(0.05)


@pytest.fixture
def restore_mask():
    yield
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def start_and_stop(block):
    if block:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    worker = CTX.Process(target=serve, name="metrics-server")
    worker.start()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    time.sleep(0.2)
    worker.terminate()
    worker.join()
    return worker.exitcode


def test_stop_a_worker_forked_with_sigterm_blocked(restore_mask):
    assert start_and_stop(block=True) == -signal.SIGTERM


def test_stop_a_worker(restore_mask):
    assert start_and_stop(block=False) == -signal.SIGTERM

"""A supervisor installs a SIGCHLD handler that reaps every exited child (waitpid(-1)); it steals the exit
status multiprocessing needs, so Process.is_alive() stays True forever and the supervisor's wait loop
never ends."""

import multiprocessing
import os
import signal
import time

import pytest

CTX = multiprocessing.get_context("fork")


def job():
    time.sleep(0.1)


def reap_all(signum, frame):
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


@pytest.fixture
def restore_sigchld():
    old = signal.getsignal(signal.SIGCHLD)
    yield
    signal.signal(signal.SIGCHLD, old)


def supervise(reaper):
    if reaper:
        signal.signal(signal.SIGCHLD, reap_all)
    worker = CTX.Process(target=job, name="batch-job")
    worker.start()
    while worker.is_alive():
        time.sleep(0.05)


def test_supervise_with_a_zombie_reaper(restore_sigchld):
    supervise(reaper=True)


def test_supervise(restore_sigchld):
    supervise(reaper=False)

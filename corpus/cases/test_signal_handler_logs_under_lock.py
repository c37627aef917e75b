"""A signal handler logs through a handler that guards its buffer with a plain threading.Lock; the signal
arrives while the main thread is inside that handler's emit(), holding the lock, so the handler (run on
the same thread) waits for a lock its own thread holds."""

import logging
import os
import signal
import threading
import time

import pytest


class BufferedHandler(logging.Handler):
    def __init__(self, reentrant):
        super().__init__()
        self.buffer = []
        self.guard = threading.RLock() if reentrant else threading.Lock()

    def emit(self, record):
        with self.guard:
            self.buffer.append(self.format(record))
            time.sleep(0.3)  # flushing to a slow sink


@pytest.fixture
def logger_with(request):
    log = logging.getLogger("trainer-" + request.node.name)
    log.propagate = False
    old = signal.getsignal(signal.SIGUSR1)
    yield log
    signal.signal(signal.SIGUSR1, old)


def run(log, reentrant):
    handler = BufferedHandler(reentrant)
    log.addHandler(handler)
    signal.signal(signal.SIGUSR1, lambda signum, frame: log.warning("checkpoint requested"))
    threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGUSR1)).start()
    log.warning("epoch 1 done")
    return handler.buffer


def test_checkpoint_signal_while_logging(logger_with):
    assert len(run(logger_with, reentrant=False)) == 2


def test_checkpoint_signal_while_logging_reentrant(logger_with):
    assert len(run(logger_with, reentrant=True)) == 2

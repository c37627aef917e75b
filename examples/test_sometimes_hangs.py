"""Hangs SOMETIMES, on purpose: a hang hunt finds it, and shows each way it hangs once.

"It hangs sometimes." A thread of the test process holds a lock for brief moments; the test
forks a child that takes the same lock. When the fork falls inside one of those moments (about
one run in ten), the child gets the lock locked and the test waits for it forever. Run it once
and it usually passes; hunt it and the rare hang is found, counted and explained::

    pytest examples/test_sometimes_hangs.py --torch-hang-hunt=100 --torch-hang-timeout=3

The hunt stops at the first hang (``--torch-hang-hunt-all`` runs all 100 and counts them) and
ends with a ``torch-hang hunt`` section: ``hung 9 of 100 runs (9.0%, 95% CI ...), 1 distinct
signature``, with that signature's first report in full.

Some races are rarer still: two children that each add one to a shared counter lose an update
only when their read and write overlap, which plain runs almost never see (docs/hunting.md has
the rates of the same race in tests/corpus/corpus_rare.py). Stress makes it frequent: the odd
runs wait briefly, at random and seeded, where processes meet (the counter's read and write,
queues, locks, events); the even runs stay plain for comparison::

    pytest examples/test_sometimes_hangs.py -k shared --torch-hang-hunt=40 \
        --torch-hang-hunt-stress --torch-hang-hunt-all --torch-hang-timeout=3

The summary gives both rates, each with its 95% interval (``plain: hung ... of 20 runs``,
``stressed: hung ... of 20 runs``), and what a stressed run costs; each stressed hang names its
seed, and ``--torch-hang-hunt=1 --torch-hang-hunt-seed=SEED`` replays that schedule of waits.

The main example run skips them (``hunt_example``, see conftest.py): once, they prove nothing.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import threading
import time
from typing import Any

import pytest

_LOCK = threading.Lock()


def _hold_now_and_then(stop: threading.Event) -> None:
    while not stop.is_set():
        with _LOCK:  # 0.5 ms of every 5 ms
            time.sleep(0.0005)
        time.sleep(0.0045)


def _fork_a_child_that_takes_the_lock() -> int:
    pid = os.fork()
    if pid == 0:
        with _LOCK:
            pass
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.hunt_example
@pytest.mark.torch_hang(timeout=3)
def test_a_child_forked_while_a_thread_holds_a_lock() -> None:
    stop = threading.Event()
    threading.Thread(target=_hold_now_and_then, args=(stop,), daemon=True).start()
    try:
        time.sleep(random.random() * 0.02)
        assert _fork_a_child_that_takes_the_lock() == 0
    finally:
        stop.set()


def _add_one(counter: Any) -> None:  # a multiprocessing.Value
    counter.value += 1  # a read, then a write: not atomic, even with the Value's own lock


@pytest.mark.hunt_example
@pytest.mark.torch_hang(timeout=3)
def test_two_children_count_on_a_shared_value() -> None:
    fork = multiprocessing.get_context("fork")
    counter = fork.Value("i", 0)
    children = [fork.Process(target=_add_one, args=(counter,)) for _ in range(2)]
    for child in children:
        child.start()
    for child in children:
        child.join()
    while counter.value < 2:  # a lost update: waits for it forever
        time.sleep(0.01)

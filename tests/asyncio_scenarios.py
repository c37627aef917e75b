"""Inner test modules of real asyncio hangs (pytest-asyncio), shared by the end-to-end tests
(tests/test_asyncio_hangs.py) and the recorder of their reports (tests/unit/record_asyncio.py)."""

from __future__ import annotations

#: pytest-asyncio 1.x warns when the fixtures' loop scope is unset: inner sessions set it.
INI = """
[pytest]
asyncio_mode = strict
asyncio_default_fixture_loop_scope = function
"""

#: An async test awaits an Event nobody sets; the async test after it must run on a sound loop.
EVENT = """
import asyncio

import pytest


@pytest.mark.asyncio
async def test_awaits_an_event_nobody_sets():
    event = asyncio.Event()
    await event.wait()


@pytest.mark.asyncio
async def test_the_next_async_test_runs():
    await asyncio.sleep(0.01)
    done = asyncio.Event()
    asyncio.get_running_loop().call_soon(done.set)
    await asyncio.wait_for(done.wait(), 5)
"""

#: The same, on a loop the module's tests share: the hang must not break it for the next one.
MODULE_LOOP = """
import asyncio

import pytest

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_awaits_an_event_on_the_module_loop():
    await asyncio.Event().wait()


async def test_the_module_loop_still_runs_the_next_test():
    await asyncio.sleep(0.01)
    assert asyncio.get_running_loop().is_running()
"""

#: A consumer task awaits an item of a queue nobody puts into.
QUEUE = """
import asyncio

import pytest


async def consume(queue):
    return await queue.get()


@pytest.mark.asyncio
async def test_awaits_a_queue_nobody_fills():
    queue = asyncio.Queue()
    await asyncio.create_task(consume(queue), name="consumer")
"""

#: gather() of two tasks: one holds the lock and awaits an Event, the other awaits the lock.
GATHER_LOCK = """
import asyncio

import pytest


async def holder(lock, started, release):
    async with lock:
        started.set()
        await release.wait()


async def waiter(lock, started):
    await started.wait()
    async with lock:
        pass


@pytest.mark.asyncio
async def test_a_gather_where_one_task_awaits_the_others_lock():
    lock, started, release = asyncio.Lock(), asyncio.Event(), asyncio.Event()
    await asyncio.gather(
        asyncio.create_task(holder(lock, started, release), name="holder"),
        asyncio.create_task(waiter(lock, started), name="waiter"),
    )
"""

#: A sync test whose asyncio.run() never returns.
SYNC_RUN = """
import asyncio


async def wait_for_ever():
    await asyncio.Event().wait()


def test_a_sync_test_whose_asyncio_run_hangs():
    asyncio.run(wait_for_ever())


def test_the_next_test_runs():
    assert asyncio.run(asyncio.sleep(0, result=1)) == 1
"""

#: Children with an event loop stuck: a new interpreter, and a fork of the pytest process.
CHILD = '''
import asyncio
import multiprocessing
import subprocess
import sys

CHILD = """
import asyncio

async def serve(ready):
    await ready.wait()

async def main():
    await asyncio.create_task(serve(asyncio.Event()), name="server")

asyncio.run(main())
"""


def test_a_child_process_whose_loop_is_stuck():
    subprocess.run([sys.executable, "-c", CHILD], check=True)


async def serve(ready):
    await ready.wait()


def forked_loop():
    asyncio.run(serve(asyncio.Event()))


def test_a_forked_child_whose_loop_is_stuck():
    child = multiprocessing.get_context("fork").Process(target=forked_loop)
    child.start()
    child.join()
'''

#: Another thread is there: it could set the Event, so the hint must not say nothing will.
OTHER_THREAD = """
import asyncio
import threading

import pytest


@pytest.mark.asyncio
async def test_awaits_an_event_beside_another_thread():
    threading.Thread(target=threading.Event().wait, name="bystander", daemon=True).start()
    await asyncio.Event().wait()
"""

#: The wait has a timeout longer than the test's: the loop's timer could still end it.
TIMED = """
import asyncio

import pytest


@pytest.mark.asyncio
async def test_awaits_an_event_with_a_long_timeout():
    await asyncio.wait_for(asyncio.Event().wait(), 600)
"""

#: An async fixture that never finishes its setup, and an async generator iterated forever.
FIXTURE = """
import asyncio

import pytest
import pytest_asyncio


@pytest_asyncio.fixture
async def connection():
    await asyncio.Event().wait()
    yield


@pytest.mark.asyncio
async def test_uses_a_fixture_that_never_connects(connection):
    pass


async def ticks(queue):
    while True:
        yield await queue.get()


@pytest.mark.asyncio
async def test_iterates_an_async_generator_that_never_yields():
    async for _ in ticks(asyncio.Queue()):
        pass
"""

#: A task blocks the loop's thread (a sync call in a coroutine) while the test awaits it.
BLOCKED = """
import asyncio
import time

import pytest


async def announce(event):
    time.sleep(600)  # blocks the loop's thread: no other task runs
    event.set()


@pytest.mark.asyncio
async def test_awaits_an_event_a_blocking_task_would_set():
    event = asyncio.Event()
    asyncio.create_task(announce(event), name="announcer")
    await event.wait()
"""

#: Every scenario module, by the name it is written under.
MODULES = {
    "test_event": EVENT,
    "test_module_loop": MODULE_LOOP,
    "test_queue": QUEUE,
    "test_gather_lock": GATHER_LOCK,
    "test_sync_run": SYNC_RUN,
    "test_child": CHILD,
    "test_other_thread": OTHER_THREAD,
    "test_timed": TIMED,
    "test_fixture": FIXTURE,
    "test_blocked": BLOCKED,
}

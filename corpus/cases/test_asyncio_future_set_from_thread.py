"""A worker thread completes an asyncio Future with set_result() directly instead of through
loop.call_soon_threadsafe(): the loop sleeps in select() and is never woken to resume the awaiter."""

import asyncio
import threading
import time


def compute(done):
    time.sleep(0.2)
    done(42)


async def run_job(threadsafe):
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    if threadsafe:
        worker = threading.Thread(
            target=compute, args=(lambda v: loop.call_soon_threadsafe(fut.set_result, v),)
        )
    else:
        worker = threading.Thread(target=compute, args=(fut.set_result,))
    worker.start()
    value = await fut
    worker.join()
    return value


def test_job_result_set_from_the_worker_thread():
    assert asyncio.run(run_job(threadsafe=False)) == 42


def test_job_result_handed_to_the_loop():
    assert asyncio.run(run_job(threadsafe=True)) == 42

"""A coroutine waits for console input in the default executor and gives up after a timeout; the
coroutine returns, but asyncio.run() then shuts the default executor down and joins its thread, which
is still blocked in a queue get() that nobody will ever feed."""

import asyncio
import queue


def wait_for(commands):
    return commands.get()  # blocks the executor thread until a command arrives


async def main(commands, feed_on_timeout):
    loop = asyncio.get_running_loop()
    try:
        return await asyncio.wait_for(loop.run_in_executor(None, wait_for, commands), timeout=0.2)
    except asyncio.TimeoutError:
        if feed_on_timeout:
            commands.put("quit")  # wake the thread so the executor can shut down
        return "timed out"


def test_prompt_times_out():
    assert asyncio.run(main(queue.Queue(), feed_on_timeout=False)) == "timed out"


def test_prompt_times_out_and_releases_its_thread():
    assert asyncio.run(main(queue.Queue(), feed_on_timeout=True)) == "timed out"

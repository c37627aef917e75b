"""A client keeps an event loop in a background thread and submits requests with
run_coroutine_threadsafe(); the loop thread's start-up fails (it raises before run_forever), so the
submitted coroutine is never run and the caller's result() waits forever."""

import asyncio
import threading


class BackgroundClient:
    def __init__(self, config):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, args=(config,), name="client-loop")
        self.thread.start()

    def _run(self, config):
        asyncio.set_event_loop(self.loop)
        self.timeout = float(config["timeout"])  # KeyError: the thread dies before the loop runs
        self.loop.run_forever()

    async def _fetch(self, key):
        await asyncio.sleep(0)
        return key.upper()

    def fetch(self, key):
        return asyncio.run_coroutine_threadsafe(self._fetch(key), self.loop).result()

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


def test_fetch_with_an_incomplete_config():
    client = BackgroundClient({})
    try:
        assert client.fetch("a") == "A"
    finally:
        client.close()


def test_fetch_with_a_complete_config():
    client = BackgroundClient({"timeout": "1.5"})
    try:
        assert client.fetch("a") == "A"
    finally:
        client.close()

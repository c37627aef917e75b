"""A coroutine holding an asyncio.Lock awaits a helper that takes the same lock: asyncio.Lock is not
reentrant, so the task waits for itself."""

import asyncio


class TokenCache:
    def __init__(self, nested):
        self.lock = asyncio.Lock()
        self.token = None
        self.nested = nested

    async def refresh(self):
        async with self.lock:
            await asyncio.sleep(0)
            self.token = "t1"

    async def get(self):
        async with self.lock:
            if self.token is None:
                if self.nested:
                    await self.refresh()  # takes self.lock again
                else:
                    await asyncio.sleep(0)
                    self.token = "t1"
            return self.token


def test_token_refresh_under_the_cache_lock():
    assert asyncio.run(TokenCache(nested=True).get()) == "t1"


def test_token_filled_in_place():
    assert asyncio.run(TokenCache(nested=False).get()) == "t1"

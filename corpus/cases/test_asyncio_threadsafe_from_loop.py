"""A sync helper bridges to async with run_coroutine_threadsafe(...).result(); called from a coroutine,
it blocks the very loop that must run the coroutine."""

import asyncio


async def fetch_config():
    await asyncio.sleep(0)
    return {"lr": 0.1}


def load_config_sync(loop):
    return asyncio.run_coroutine_threadsafe(fetch_config(), loop).result()


def test_sync_helper_called_on_the_loop():
    async def main():
        return load_config_sync(asyncio.get_running_loop())

    assert asyncio.run(main()) == {"lr": 0.1}


def test_sync_helper_called_from_a_worker_thread():
    async def main():
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, load_config_sync, loop)

    assert asyncio.run(main()) == {"lr": 0.1}

"""Consumer tasks drain an asyncio.Queue and call task_done(); one consumer raises on a malformed item
and its task ends with the exception stored, never awaited. The item is never marked done, so
queue.join() waits forever."""

import asyncio


async def consume(queue, results, tolerant):
    while True:
        item = await queue.get()
        try:
            results.append(int(item))
        except ValueError:
            if not tolerant:
                raise  # the task dies; nobody awaits it
        queue.task_done()


async def ingest(items, tolerant):
    queue = asyncio.Queue()
    results = []
    consumers = [asyncio.create_task(consume(queue, results, tolerant)) for _ in range(2)]
    for item in items:
        queue.put_nowait(item)
    await queue.join()
    for c in consumers:
        c.cancel()
    return sorted(results)


def test_ingest_with_a_malformed_item():
    assert asyncio.run(ingest(["1", "2", "x", "3"], tolerant=False)) == [1, 2, 3]


def test_ingest_skipping_a_malformed_item():
    assert asyncio.run(ingest(["1", "2", "x", "3"], tolerant=True)) == [1, 2, 3]

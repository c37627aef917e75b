"""A task of a one-thread ThreadPoolExecutor submits a sub-task to the same executor and waits for it:
the only worker thread is the one waiting, so the sub-task never starts."""

from concurrent.futures import ThreadPoolExecutor


def checksum(block):
    return sum(block) % 251


def verify_file(pool, blocks):
    # fan the blocks out to the same pool this task runs on, then wait for them
    parts = [pool.submit(checksum, b) for b in blocks]
    return [p.result() for p in parts]


def test_verify_on_a_single_thread_pool():
    with ThreadPoolExecutor(max_workers=1) as pool:
        assert pool.submit(verify_file, pool, [[1, 2], [3, 4]]).result() == [3, 7]


def test_verify_on_a_pool_per_level():
    with ThreadPoolExecutor(max_workers=1) as outer, ThreadPoolExecutor(max_workers=2) as inner:
        assert outer.submit(verify_file, inner, [[1, 2], [3, 4]]).result() == [3, 7]

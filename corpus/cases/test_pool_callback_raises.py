"""An apply_async callback that raises: it runs in the pool's result thread, which it kills."""

import multiprocessing

CTX = multiprocessing.get_context("fork")


def shard_size(name):
    return len(name) * 100


def test_sizes_recorded_by_a_callback_that_fails():
    totals = {}

    def record(size):
        totals["bytes"] += size  # KeyError: the running total was never initialised

    with CTX.Pool(2) as pool:
        pending = pool.apply_async(shard_size, ("train-00001",), callback=record)
        assert pending.get() == 1100


def test_sizes_recorded_by_a_callback():
    totals = {"bytes": 0}

    def record(size):
        totals["bytes"] += size

    with CTX.Pool(2) as pool:
        pending = pool.apply_async(shard_size, ("train-00001",), callback=record)
        assert pending.get() == 1100
    assert totals["bytes"] == 1100

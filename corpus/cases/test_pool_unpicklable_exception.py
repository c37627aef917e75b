"""A Pool task raises an exception class whose constructor takes other arguments than it passes to
Exception.__init__: pickling it back works, unpickling it in the pool's result thread fails and kills
that thread, so map() waits forever."""

import multiprocessing

import pytest

CTX = multiprocessing.get_context("fork")


class ShardError(Exception):
    def __init__(self, shard, reason):
        super().__init__(f"shard {shard}: {reason}")  # args != constructor arguments
        self.shard = shard


class PicklableShardError(Exception):
    def __init__(self, shard, reason):
        super().__init__(shard, reason)
        self.shard = shard


def load(shard, error=ShardError):
    if shard == 3:
        raise error(shard, "truncated")
    return shard


def load_picklable(shard):
    return load(shard, PicklableShardError)


def test_map_with_a_failing_shard():
    with CTX.Pool(2) as pool, pytest.raises(ShardError):
        pool.map(load, range(6))


def test_map_with_a_failing_shard_and_a_picklable_error():
    with CTX.Pool(2) as pool, pytest.raises(PicklableShardError):
        pool.map(load_picklable, range(6))

"""HANGS ON PURPOSE: a parent joins its preprocessing processes before it drains their Queue.

Each producer decodes its shard of FakeData and puts the raw images on a ``multiprocessing.Queue``.
A Queue hands data to a feeder thread that writes it into a pipe; a process that put data on a
Queue waits at exit until the feeder has written all of it, and a pipe holds only 64 KiB until
someone reads. The parent calls ``join()`` first and reads afterwards: the producers cannot exit
until the parent reads, and the parent does not read until they exit.

What the plugin reports: the hint ``pid N joins a process that cannot exit until its
multiprocessing Queue is flushed``, the producers' ``[queue feeder thread]`` in ``_feed`` and
their main threads in ``_finalize_join``, and the test at ``producer.join()``. The fix: get()
every item first, then join() (docs/troubleshooting.md, "Data sharing between processes").
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.queues import Queue

import pytest
import torch
from torchvision.datasets import FakeData

SHARD = 128  # 128 images of 3 KiB each: far more than a pipe holds


def _decode_shard(shard: int, queue: Queue[tuple[int, bytes, int]]) -> None:
    # A forked child of a process that already ran torch ops must limit torch to one thread
    # before its first op (DataLoader workers do the same), or it can hang in OpenMP.
    torch.set_num_threads(1)
    dataset = FakeData(size=(shard + 1) * SHARD, image_size=(3, 32, 32), num_classes=10)
    for index in range(shard * SHARD, (shard + 1) * SHARD):
        image, label = dataset[index]
        queue.put((index, image.tobytes(), label))


@pytest.mark.torch_hang(timeout=3)
def test_parent_joins_producers_before_draining_their_queue() -> None:
    context = mp.get_context("fork")
    queue: Queue[tuple[int, bytes, int]] = context.Queue()
    producers = [context.Process(target=_decode_shard, args=(k, queue)) for k in range(2)]
    for producer in producers:
        producer.start()
    for producer in producers:
        producer.join()  # BUG: waits for producers that wait for this process to read
    samples = [queue.get() for _ in range(2 * SHARD)]
    assert len(samples) == 2 * SHARD

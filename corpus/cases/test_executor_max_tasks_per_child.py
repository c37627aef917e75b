"""ProcessPoolExecutor(max_tasks_per_child=...) stops scheduling once its worker retires (CPython 3.11-3.13)."""

import concurrent.futures
import multiprocessing


def test_backlog_with_recycled_workers():
    ctx = multiprocessing.get_context("spawn")  # max_tasks_per_child cannot be used with fork
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx, max_tasks_per_child=2) as pool:
        futures = [pool.submit(abs, -i) for i in range(6)]
        assert [f.result() for f in futures] == list(range(6))


def test_backlog_with_long_lived_workers():
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        futures = [pool.submit(abs, -i) for i in range(6)]
        assert [f.result() for f in futures] == list(range(6))

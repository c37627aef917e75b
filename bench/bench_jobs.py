"""Jobs for the benchmarks, in a module of their own so children import them like test code."""

from __future__ import annotations


def trivial(x: int = 0) -> int:
    return x + 1


def rank_noop(rank: int, world_size: int) -> int:
    return rank


def tmp_rank(index: int, store: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=index, world_size=2)
    dist.destroy_process_group()


def pytest_command(*args: str) -> list[str]:
    """A quiet pytest session in a fresh interpreter, without the cache provider."""
    import sys

    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]

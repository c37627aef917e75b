"""HANGS ON PURPOSE: DataLoader workers forked while another thread holds a lock they need.

A background thread warms a sample cache and holds its lock while it works. The DataLoader forks
its workers meanwhile: each worker gets a copy of the lock in the state it had at that instant,
locked, and no thread in the worker will ever release it. Every worker blocks in ``__getitem__``
and the training loop waits for a first batch that never comes.

What the plugin reports: the headline ``2 stuck in DataLoader worker __getitem__``, the hint
``A lock held by another thread when the workers were forked ...``, and each worker's stack at
``with _CACHE_LOCK:``. The fix: ``multiprocessing_context="spawn"`` (or ``"forkserver"``), or
create the lock in the worker (``worker_init_fn``), or do not share a lock with a thread.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms
from torchvision.datasets import FakeData

_CACHE: dict[int, tuple[torch.Tensor, int]] = {}
_CACHE_LOCK = threading.Lock()


class CachedFakeData(Dataset[tuple[torch.Tensor, int]]):
    """CIFAR-shaped FakeData whose transformed samples are cached in this process."""

    def __init__(self, size: int) -> None:
        self.base = FakeData(
            size=size,
            image_size=(3, 32, 32),
            num_classes=10,
            transform=transforms.Compose(
                [transforms.ToTensor(), transforms.Normalize((0.5,) * 3, (0.25,) * 3)]
            ),
        )

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        with _CACHE_LOCK:
            if index not in _CACHE:
                _CACHE[index] = self.base[index]
            return _CACHE[index]


def _warm_cache(dataset: CachedFakeData, holding: threading.Event, stop: threading.Event) -> None:
    with _CACHE_LOCK:  # held for the whole warm-up, so it is held when the workers fork
        holding.set()
        for index in range(len(dataset)):
            if stop.wait(1.0):  # stands for a slow read (a network file system, say)
                return
            _CACHE[index] = dataset.base[index]


@pytest.mark.torch_hang(timeout=3)
def test_workers_forked_while_a_thread_holds_the_cache_lock() -> None:
    dataset = CachedFakeData(size=512)
    holding, stop = threading.Event(), threading.Event()
    warmer = threading.Thread(target=_warm_cache, args=(dataset, holding, stop), daemon=True)
    warmer.start()
    holding.wait()
    try:
        loader = DataLoader(
            dataset, batch_size=128, shuffle=True, num_workers=2, multiprocessing_context="fork"
        )
        for _images, _labels in loader:
            pass
    finally:
        stop.set()
        warmer.join()

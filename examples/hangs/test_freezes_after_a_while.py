"""STALLS ON PURPOSE: a training loop that runs fine for two epochs, then freezes.

"It runs for a while, then suddenly freezes, with no exception." From its third epoch on, a
background thread refreshes a label cache and holds the cache's lock while the next epoch's
DataLoader workers fork: every worker gets the lock locked, and the epoch never yields a batch.

A long training test needs a generous timeout (this suite's is 60 s), so a wall-clock timeout
alone would let this freeze cost the whole minute. ``stall=5`` fails it 5 s after the last batch,
with a headline that says what progress looked like and when it stopped::

    STALL after 9.2s in hangs/test_freezes_after_a_while.py::test_the_third_epoch_never_starts:
    no progress for 5.0s (last: optimizer step 8 (pid 4242) at 4.1s; before that 9.9 batches/s
    and 10.1 optimizer steps/s)

Progress is counted without any change to the code: DataLoader batches, optimizer steps and
collectives, in every process of the test's tree; ``pytest_torchhang.progress()`` counts too.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms
from torchvision.datasets import FakeData

_LABELS: dict[int, int] = {}
_LABELS_LOCK = threading.Lock()


class LabelledFakeData(Dataset[tuple[torch.Tensor, int]]):
    """CIFAR-shaped FakeData whose labels go through a cache shared with a refresher thread."""

    def __init__(self, size: int) -> None:
        self.base = FakeData(size=size, image_size=(3, 32, 32), transform=transforms.ToTensor())

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image, label = self.base[index]
        with _LABELS_LOCK:
            return image, _LABELS.setdefault(index, int(label))


def _refresh_labels(stop: threading.Event) -> None:
    while not stop.is_set():
        with _LABELS_LOCK:  # held while it "re-reads the labels file": during the next fork
            stop.wait(2.0)


@pytest.mark.torch_hang(stall=5)
def test_the_third_epoch_never_starts() -> None:
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(LabelledFakeData(64), batch_size=16, num_workers=2)
    stop = threading.Event()
    try:
        for epoch in range(4):
            if epoch == 2:  # the refresher starts with the third epoch
                threading.Thread(target=_refresh_labels, args=(stop,), daemon=True).start()
                time.sleep(0.1)
            for images, labels in loader:
                loss = torch.nn.functional.cross_entropy(model(images), labels)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    finally:
        stop.set()

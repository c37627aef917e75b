"""Sharing data between DataLoader workers through a ``torch.multiprocessing`` Manager.

Each worker is a process of its own: what it writes into a plain dict or list stays in that
process. A Manager keeps the dict and list in a server process, and every worker changes them
through proxies. Each proxy call is atomic; an update made of several calls (check, then write)
needs a Manager lock, and a lock that is not released blocks every worker that asks for it:
``test_a_manager_lock_leaked_by_an_early_return_is_caught_as_a_hang`` shows what the plugin
reports then.
"""

from __future__ import annotations

from collections import Counter
from multiprocessing.managers import SyncManager
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.multiprocessing as mp
from cifar_task import NUM_CLASSES, fake_cifar
from torch.utils.data import DataLoader, Dataset, get_worker_info

from pytest_torchhang import HangError

if TYPE_CHECKING:
    from pytest_torchhang.runner.api import TorchHang


class LabelCensus(Dataset[tuple[torch.Tensor, int]]):
    """Wraps a dataset; its DataLoader workers count each sample's label once, across epochs.

    ``seen`` (index -> label) and ``counts`` (label -> samples) are Manager dicts, ``loads`` a
    Manager list of (worker id, index), ``lock`` a Manager lock.
    """

    def __init__(
        self, base: Dataset[tuple[torch.Tensor, int]], manager: SyncManager, size: int
    ) -> None:
        self.base = base
        self.size = size
        self.seen = manager.dict()
        self.counts = manager.dict()
        self.loads = manager.list()
        self.lock = manager.Lock()

    def __len__(self) -> int:
        return self.size

    def _record(self, index: int) -> None:
        info = get_worker_info()
        self.loads.append((info.id if info else -1, index))  # one proxy call: atomic

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image, label = self.base[index]
        self._record(index)
        with self.lock:  # check-then-update takes several proxy calls: one worker at a time
            if index not in self.seen:
                self.seen[index] = label
                self.counts[label] = self.counts.get(label, 0) + 1
        return image, label


class LeakyLabelCensus(LabelCensus):
    """The same census with a classic bug: an early return that skips the release."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image, label = self.base[index]
        self._record(index)
        self.lock.acquire()
        if index in self.seen:
            return image, label  # BUG: from the second epoch on, returns holding the lock
        self.seen[index] = label
        self.counts[label] = self.counts.get(label, 0) + 1
        self.lock.release()
        return image, label


class RandomImages(Dataset[tuple[torch.Tensor, int]]):
    """CIFAR-shaped random images, torch only: a child needing it starts without torchvision."""

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.rand(3, 32, 32), index % NUM_CLASSES


def _epochs(census: LabelCensus, epochs: int = 2) -> None:
    # fork: the workers start in milliseconds (Python 3.14's default, forkserver, re-imports this
    # module in every worker)
    loader = DataLoader(
        census, batch_size=16, shuffle=True, num_workers=2, multiprocessing_context="fork"
    )
    for _ in range(epochs):
        for _batch in loader:
            pass


def census_of_random_images(census_type: type[LabelCensus], size: int) -> dict[int, int]:
    """Two epochs over ``size`` random images with a census of ``census_type``; label counts."""
    with mp.Manager() as manager:
        census = census_type(RandomImages(), manager, size)
        _epochs(census)
        return dict(census.counts)


def test_workers_count_each_label_once_through_a_manager(manager: SyncManager) -> None:
    dataset = fake_cifar(64)
    census = LabelCensus(dataset, manager, 64)

    _epochs(census)

    expected = Counter(label for _image, label in (dataset[i] for i in range(64)))
    assert dict(census.counts) == expected
    assert sorted(census.seen.keys()) == list(range(64))
    loads: list[Any] = list(census.loads)
    assert sorted(index for _worker, index in loads) == sorted(2 * list(range(64)))
    assert {worker for worker, _index in loads} == {0, 1}  # both workers wrote into one list


class PlainDictCensus(Dataset[tuple[torch.Tensor, int]]):
    """The mistake a Manager avoids: a plain dict, copied into every worker process."""

    def __init__(self, base: Dataset[tuple[torch.Tensor, int]]) -> None:
        self.base = base
        self.counts: dict[int, int] = {}

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image, label = self.base[index]
        self.counts[label] = self.counts.get(label, 0) + 1
        return image, label


def test_a_plain_dict_filled_by_workers_stays_empty_in_the_test() -> None:
    census = PlainDictCensus(fake_cifar(64))

    for _batch in DataLoader(census, batch_size=16, num_workers=2):
        pass

    assert census.counts == {}  # every worker filled its own copy, then exited


def test_the_census_of_a_child_process_counts_every_sample(torch_hang: TorchHang) -> None:
    counts = torch_hang.run(census_of_random_images, LabelCensus, 64)

    assert counts == dict.fromkeys(range(NUM_CLASSES), 6) | {0: 7, 1: 7, 2: 7, 3: 7}


def test_a_manager_lock_leaked_by_an_early_return_is_caught_as_a_hang(
    torch_hang: TorchHang,
) -> None:
    with pytest.raises(HangError) as caught:
        torch_hang.run(census_of_random_images, LeakyLabelCensus, 64, timeout=2)

    report = caught.value.report
    assert report is not None
    assert "stuck in DataLoader worker __getitem__" in report.headline
    hints = [hint.text for hint in report.hints]
    assert any(
        "wait on a Manager proxy call while the Manager server is blocked serving it" in text
        and "release it in a finally block" in text
        for text in hints
    ), hints
    assert "self.lock.acquire()" in str(caught.value)  # the report's text: where the workers wait

"""Fixtures shared by the example suite: a fixed seed and a Manager that never outlives its test."""

from __future__ import annotations

from collections.abc import Iterator
from multiprocessing.managers import SyncManager

import pytest
import torch
import torch.multiprocessing as mp


@pytest.fixture(autouse=True)
def seeded() -> None:
    """Same weights and same shuffles on every run, so a failure reproduces."""
    torch.manual_seed(0)


@pytest.fixture
def manager() -> Iterator[SyncManager]:
    """A ``torch.multiprocessing`` Manager, shut down after the test.

    A Manager is a server process: one left running keeps the session (and a CI job) alive.
    """
    with mp.Manager() as started:
        yield started


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "hunt_example: a rare hang, run only when hunting (--torch-hang-hunt=N)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("torch_hang_hunt", None):
        return
    skip = pytest.mark.skip(reason="a rare hang: run it with --torch-hang-hunt=100")
    for item in items:
        if item.get_closest_marker("hunt_example") is not None:
            item.add_marker(skip)

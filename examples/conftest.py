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

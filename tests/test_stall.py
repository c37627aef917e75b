"""Stall detection: a test fails when its tree makes no progress for S seconds, not at wall time."""

from __future__ import annotations

import json

import pytest

from conftest import GuardedRunner, Session
from outcomes import assert_outcomes


def assert_stall(session: Session, test_name: str, *expected: str) -> str:
    """``test_name`` failed as a stall; returns its headline (the report's first line)."""
    report = session.report_of(test_name)
    headline = next(line for line in report.splitlines()[1:] if line.strip())
    assert headline.startswith("STALL after "), report[:3000]
    missing = [text for text in expected if text not in report]
    assert not missing, f"missing {missing} in:\n{report[:6000]}"
    return headline


pytestmark = pytest.mark.needs_torch

TRAINING = """
import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import pytest_torchhang

LOCK = threading.Lock()


class Tokens(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        with LOCK:  # a tokenizer cache guarded by a lock
            return torch.tensor([float(i)])


def test_freezes_in_its_third_epoch():
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(5):
        if epoch == 2:
            # from now on another thread holds the lock whenever workers fork: they never get it
            threading.Thread(target=lambda: (LOCK.acquire(), time.sleep(300)), daemon=True).start()
            time.sleep(0.2)
        for batch in DataLoader(Tokens(), batch_size=4, num_workers=2):
            model(batch).sum().backward()
            optimizer.step()
            optimizer.zero_grad()


class Slow(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        for _ in range(12):  # 3.6 s an item, longer than the stall time, but it says so
            time.sleep(0.3)
            pytest_torchhang.progress(f"item {i}")
        return torch.tensor([i])


@pytest.mark.torch_hang(stall=3)
def test_a_slow_worker_that_reports_progress_is_not_stalled():
    assert sum(int(b.sum()) for b in DataLoader(Slow(), batch_size=1, num_workers=2)) == 6


def test_slow_but_steady_is_never_flagged():
    for step in range(10):
        time.sleep(0.6)
        pytest_torchhang.progress(f"step {step}")
"""


def test_a_loop_that_freezes_after_a_while_is_caught_long_before_the_timeout(
    guarded: GuardedRunner,
) -> None:
    guarded.pytester.makepyfile(test_training=TRAINING)
    session = guarded.run(
        "-p", "no:randomly", "--torch-hang-stall=6", "--torch-hang-report-dir=reports", timeout=240
    )
    assert_outcomes(session.result, passed=2, stall=1)
    headline = assert_stall(session, "test_freezes_in_its_third_epoch", "[DataLoader worker")
    assert "no progress for " in headline
    assert "last: " in headline and " at " in headline
    assert "batches/s" in headline and "optimizer steps/s" in headline
    assert session.wall_s < 180, session.wall_s  # nowhere near the 240 s timeout
    (path,) = (guarded.pytester.path / "reports").glob("*.json")
    document = json.loads(path.read_text())
    assert document["kind"] == "stall"
    assert document["progress"]["stall_s"] == 6
    assert document["progress"]["counts"][0] >= 8  # two whole epochs of batches, at least
    assert document["progress"]["history"]
    session.assert_clean()


RANKS = """
import time

import pytest
import torch
import torch.distributed as dist

import pytest_torchhang


def train(rank, world_size, steps_before_leaving):
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1000):
        if rank == 1 and step == steps_before_leaving:
            time.sleep(300)  # this rank stops issuing collectives
        loss = model(torch.ones(2, 4)).sum()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(0.05)
    return step


def think(rank, world_size):
    for _ in range(14):  # 7 s without a collective, longer than the stall time, but it says so
        time.sleep(0.5)
        pytest_torchhang.progress(f"rank {rank} thinking")
    dist.barrier()
    return rank


def test_a_rank_that_stops_issuing_collectives(torch_hang):
    torch_hang.distributed(train, 5, world_size=2)


@pytest.mark.torch_hang(stall=5)  # above the ranks' start-up (gloo's rendezvous) under load
def test_progress_from_ranks_counts(torch_hang):
    assert torch_hang.distributed(think, world_size=2) == [0, 1]
"""


def test_a_rank_that_stops_issuing_collectives_is_caught(guarded: GuardedRunner) -> None:
    guarded.pytester.makepyfile(test_ranks=RANKS)
    # 12 s: above the ranks' start-up and first collectives on a loaded runner (8 s stalled
    # there once before any collective, with nothing to compare the silence with)
    session = guarded.run("-p", "no:randomly", "--torch-hang-stall=12", timeout=240)
    assert_outcomes(session.result, passed=1, stall=1)
    headline = assert_stall(session, "test_a_rank_that_stops_issuing_collectives", "[rank 1/2")
    assert "collectives/s" in headline or "optimizer steps/s" in headline, headline
    assert session.wall_s < 180, session.wall_s
    session.assert_clean()


STALL_OPTIONS = """
import time

import pytest


@pytest.mark.torch_hang(stall=1)
def test_marker_stall():
    time.sleep(60)


@pytest.mark.torch_hang(stall=0)
def test_marker_turns_it_off():
    time.sleep(2)
"""


def test_the_marker_sets_and_unsets_the_stall_time(guarded: GuardedRunner) -> None:
    guarded.pytester.makepyfile(test_options=STALL_OPTIONS)
    guarded.monkeypatch.setenv("PYTEST_TORCH_HANG_STALL", "1")
    session = guarded.run("-p", "no:randomly", timeout=None)
    assert_outcomes(session.result, passed=1, stall=1)
    headline = assert_stall(session, "test_marker_stall")
    assert "no progress at all since the test began" in headline, headline


LEFT_BEATING = """
import multiprocessing
import os
import time

import pytest_torchhang

HEARTBEAT = os.path.abspath("heartbeat")


def beat_for_a_minute():
    fd = os.open(HEARTBEAT, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    for _ in range(600):  # far past the next test's stall time; the session kills it first
        pytest_torchhang.progress("left behind by the first test")
        os.write(fd, b".")
        time.sleep(0.1)


def test_leaves_a_process_beating():
    multiprocessing.get_context("fork").Process(target=beat_for_a_minute, daemon=True).start()
    deadline = time.monotonic() + 20
    while not (os.path.exists(HEARTBEAT) and os.path.getsize(HEARTBEAT)):
        assert time.monotonic() < deadline, "the child never beat"
        time.sleep(0.01)


def test_stalls_while_that_process_beats():
    seen_at_start = os.path.getsize(HEARTBEAT)
    for _ in range(150):  # 15 s: the stall time (3 s) ends it long before
        time.sleep(0.1)
        with open("beats_during_the_second_test", "w") as out:
            out.write(str(os.path.getsize(HEARTBEAT) - seen_at_start))
"""


def test_a_process_left_beating_by_an_earlier_test_does_not_hide_a_stall(
    guarded: GuardedRunner,
) -> None:
    guarded.pytester.makepyfile(test_left_beating=LEFT_BEATING)
    session = guarded.run("-p", "no:randomly", "--torch-hang-stall=3", timeout=60)
    # the leftover beat all through the second test: a stall it hid would let that test pass
    beats = int((guarded.pytester.path / "beats_during_the_second_test").read_text())
    assert beats >= 5, beats
    assert_outcomes(session.result, passed=1, stall=1)
    headline = assert_stall(session, "test_stalls_while_that_process_beats")
    assert "no progress at all since the test began" in headline, headline
    assert session.wall_s < 40, session.wall_s  # the 15 s loop never ran out
    session.assert_clean()

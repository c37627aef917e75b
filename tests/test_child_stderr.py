"""A child's last stderr lines in the hang report: the traceback a worker printed and dropped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import GuardedRunner, assert_hang
from outcomes import assert_outcomes

pytestmark = pytest.mark.needs_torch

UNPICKLABLE_BATCH = """
import multiprocessing
import threading

import pytest
from torch.utils.data import DataLoader, Dataset


class LockedSamples(Dataset):
    \"\"\"Each sample holds a lock: the worker's queue feeder thread cannot pickle it.\"\"\"

    def __len__(self):
        return 4

    def __getitem__(self, index):
        return {"index": index, "lock": threading.Lock()}


# a forked worker (torch is imported at collection) fails its first batch within a second,
# on a busy machine too
@pytest.mark.torch_hang(timeout=5)
def test_a_batch_that_cannot_be_pickled():
    # batch_size=None: no collation, the sample goes to the queue as it is
    for _ in DataLoader(LockedSamples(), batch_size=None, num_workers=1):
        pass


def fail_before_sending(queue):
    raise RuntimeError("the child failed before it sent its result")


@pytest.mark.torch_hang(timeout=3)  # a plain forked child: it fails in milliseconds
def test_a_child_that_died_before_sending():
    queue = multiprocessing.get_context("fork").Queue()
    multiprocessing.get_context("fork").Process(target=fail_before_sending, args=(queue,)).start()
    queue.get()


def test_next_test_runs():
    pass
"""


def test_the_report_shows_the_traceback_a_worker_printed_on_its_stderr(
    guarded: GuardedRunner, tmp_path: Path
) -> None:
    guarded.pytester.makepyfile(test_stderr=UNPICKLABLE_BATCH)
    reports = tmp_path / "reports"
    # each hanging test has a marker of its own (5 s and 3 s, wide for what it waits on)
    session = guarded.run(f"--torch-hang-report-dir={reports}", timeout=10)
    assert_outcomes(session.result, hang=2, passed=1)
    text = assert_hang(
        session,
        "test_a_batch_that_cannot_be_pickled",
        "*[[]DataLoader worker 0/1*",
        "    last stderr lines:",
        "        TypeError: cannot pickle '_thread.lock' object",
    )
    # under the worker's own block, not under pytest's or another process's
    blocks = text.split("\n--- process ")[1:]
    (worker_block,) = [b for b in blocks if b.split("\n", 1)[0].count("[DataLoader worker 0/1")]
    assert "TypeError: cannot pickle '_thread.lock' object" in worker_block, text[:6000]
    assert not any("last stderr lines" in b for b in blocks if b is not worker_block), text[:6000]
    assert_hang(
        session,
        "test_a_child_that_died_before_sending",
        "        RuntimeError: the child failed before it sent its result",
    )
    docs = {
        d["test_id"].rsplit("::", 1)[-1]: d
        for d in (json.loads(p.read_text()) for p in reports.glob("*.json"))
    }
    loader = docs["test_a_batch_that_cannot_be_pickled"]
    tails = {p["role"]: p.get("stderr_tail", []) for p in loader["processes"]}
    (worker,) = [role for role in tails if role.startswith("DataLoader worker 0/1")]
    assert tails[worker][-1] == "TypeError: cannot pickle '_thread.lock' object"
    assert len(tails[worker]) <= 20
    assert not any(tail for role, tail in tails.items() if role != worker), tails
    died = docs["test_a_child_that_died_before_sending"]
    lines = [line for p in died["processes"] for line in p.get("stderr_tail", [])] + [
        line for t in died.get("gone_stderr", []) for line in t["lines"]
    ]
    assert "RuntimeError: the child failed before it sent its result" in lines, died
    session.assert_clean()

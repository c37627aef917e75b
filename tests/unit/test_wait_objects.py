"""Wait objects are data: tagged values with one summary, read back from JSON and from the
English of reports written before they were data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytest_torchhang.report import waits
from pytest_torchhang.report.model import HangReport, TaskWait, WaitEdge

from .conftest import RECORDED


def _tasks(path: Path) -> list[TaskWait]:
    report = HangReport.from_json(json.loads(path.read_text()))
    return [t for p in report.processes for t in p.tasks]


def _legacy(path: Path) -> bool:
    doc = json.loads(path.read_text())
    return all("wait" not in t for p in doc["processes"] for t in p["tasks"])


LEGACY = [p for p in RECORDED if _legacy(p)]
CURRENT = [p for p in RECORDED if not _legacy(p)]


def test_an_old_reports_objects_read_back_as_values_whose_summary_is_their_text() -> None:
    read = 0
    for path in LEGACY:
        for task in _tasks(path):
            if task.wait is None:
                assert not task.obj or task.call in ("", "running"), (path.name, task.obj)
                continue
            read += 1
            # a poll's text names every descriptor; its object is the first one (a semaphore's
            # summary adds its count, which the old text did not say)
            summary = task.wait.summary()
            assert task.obj.startswith(summary) or summary.startswith(task.obj), task.obj
    assert read > 50


def test_an_old_reports_edges_get_their_kind_from_their_words() -> None:
    kinds = {e.kind for path in LEGACY for t in _tasks(path) for e in t.waits_for}
    assert {waits.CHILD, waits.HOLDS_WRITE_END, waits.THREAD, waits.NOBODY} <= kinds
    assert "" not in kinds


@pytest.mark.skipif(not CURRENT, reason="no recording made since waits are data")
def test_a_new_report_carries_wait_objects_whose_summary_is_the_text() -> None:
    for path in CURRENT:
        for task in _tasks(path):
            if task.wait is not None:
                assert task.obj.startswith(task.wait.summary()), (path.name, task.obj)
            assert all(e.kind for e in task.waits_for), (path.name, task.waits_for)


@pytest.mark.parametrize(
    "wait",
    [
        waits.Pipe(3, "307072"),
        waits.Fifo("/tmp/f", opening="reading", held="no process of the tree has it open"),
        waits.Futex(0x7F00, private=False, path="/dev/shm/x"),
        waits.Semaphore(0x7F00, "/dev/shm/sem.mp-a", value=0),
        waits.Semaphore(0x7F00, "/dev/shm/sem.mp-a", unread="its memory could not be read"),
        waits.FileLock("/tmp/lock"),
        waits.Socket(4, "99", family="tcp", local="127.0.0.1:1", remote="127.0.0.1:2"),
        waits.StoreKey("rank1"),
        waits.Sleep(),
        waits.ChildExit(12),
        waits.OtherFile(5, "/tmp/data"),
    ],
    ids=lambda w: type(w).__name__,
)
def test_each_kind_of_wait_survives_the_json_round_trip(wait: waits.WaitObject) -> None:
    doc = json.loads(json.dumps(waits.to_json(wait)))
    assert doc["kind"] == wait.kind
    assert waits.from_json(doc) == wait


def test_a_wait_of_a_kind_this_version_does_not_know_reads_as_none() -> None:
    assert waits.from_json({"kind": "carrier_pigeon", "loft": 3}) is None


def test_a_semaphore_says_its_count_or_why_it_was_not_read() -> None:
    assert "(a semaphore, count 0)" in waits.Semaphore(1, "/dev/shm/sem.x", value=0).summary()
    unread = waits.Semaphore(1, "/dev/shm/sem.x", unread="the capture's time ran out")
    assert "count unread: the capture's time ran out" in unread.summary()


def test_an_edge_written_without_a_kind_reads_its_kind_from_its_words() -> None:
    assert waits.edge_kind_from_text(5, "pipe:[1], whose write end it holds") == (
        waits.HOLDS_WRITE_END
    )
    assert waits.edge_kind_from_text(0, "no other thread in this process can release it") == (
        waits.NOBODY
    )
    assert waits.edge_kind_from_text(-1, "file /tmp/x") == waits.FILE
    assert WaitEdge(5).kind == ""

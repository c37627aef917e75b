"""Semaphore slots that leaked, told when every process that maps the semaphore waits only on
the others: replayed on the recorded DataLoader whose workers leak the slots of a shared
semaphore, with one worker idle (waiting for its next index from the parent), as a capture a
moment earlier or later finds it."""

from __future__ import annotations

from pytest_torchhang.diagnosis.frames import main_thread
from pytest_torchhang.report.model import Frame, HangReport, ProcessReport, WaitEdge
from pytest_torchhang.report.waits import HOLDS_WRITE_END, OUTSIDE, Pipe, Semaphore

from .conftest import RECORDED, Replay

NAME = "test_loading_workers_leak_the_slots_of_a_shared_semaphore"
#: A DataLoader worker's own loop, waiting for its next index (library frames only).
WORKER_LOOP = Frame(
    "/x/site-packages/torch/utils/data/_utils/worker.py", 300, "_worker_loop", "index_queue.get()"
)


def _in_acquire(proc: ProcessReport) -> bool:
    return any(isinstance(t.wait, Semaphore) for t in proc.tasks)


def _with_an_idle_worker(replay: Replay, edge_to: str) -> tuple[HangReport, ProcessReport]:
    """The recording, with its last worker in acquire() (when two are) waiting instead for its
    next index through a pipe held by the parent (``edge_to`` "parent") or by something outside
    the tree ("outside"); the idle worker."""
    (path,) = [p for p in RECORDED if p.stem == NAME]
    report = replay.load(path)
    (parent,) = [p for p in report.processes if p.role == "pytest"]
    workers = [p for p in report.processes if p.role.startswith("DataLoader worker")]
    waiting = [w for w in workers if _in_acquire(w)]
    idle = waiting[-1] if len(waiting) > 1 else next(w for w in workers if not _in_acquire(w))
    edge = (
        WaitEdge(parent.pid, via="pipe:[9]", kind=HOLDS_WRITE_END)
        if edge_to == "parent"
        else WaitEdge(-1, via="socket to 10.0.0.1:80", kind=OUTSIDE)
    )
    task = next(t for t in idle.tasks if t.tid == idle.pid)
    task.call, task.state, task.wait, task.waits_for = "read", "S", Pipe(fd=7, inode="9"), [edge]
    thread = main_thread(idle)
    assert thread is not None
    thread.frames = [WORKER_LOOP]
    return report, idle


def test_an_idle_worker_that_waits_for_the_parent_releases_nothing(replay: Replay) -> None:
    report, idle = _with_an_idle_worker(replay, "parent")
    (hint,) = [h for h in replay.hints(report) if h.rule == "leaked_slots"]
    assert "slots leaked" in hint.text and idle.pid in hint.pids


def test_a_worker_that_waits_on_something_outside_could_still_release(replay: Replay) -> None:
    report, _ = _with_an_idle_worker(replay, "outside")
    assert "leaked_slots" not in [h.rule for h in replay.hints(report)]

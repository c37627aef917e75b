"""What a SIGTERM would do to a child a process waits to exit: ignored or blocked, it is not
ended by terminate() (diagnosis/sigterm.py), told from the masks the capture read."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_torchhang.diagnosis.sigterm import sigterm_facts
from pytest_torchhang.report.model import Frame, ProcessReport, TaskWait, ThreadStack, WaitEdge
from pytest_torchhang.report.signals import SignalFacts
from pytest_torchhang.report.waits import CHILD, ChildExit, Pipe

TEST_SOURCE = """\
def test_stops_its_worker(worker):
    worker.start()
    worker.terminate()
    worker.join()
"""


def _proc(pid: int, ppid: int, role: str, signals: SignalFacts | None) -> ProcessReport:
    proc = ProcessReport(pid, ppid, role, "python", "S", 0, 0, 0, 1, 0, "ok")
    proc.signals = signals
    return proc


def _joiner(tmp_path: Path, signals: SignalFacts, wait: object = None) -> ProcessReport:
    source = tmp_path / "test_stop.py"
    source.write_text(TEST_SOURCE)
    parent = _proc(10, 1, "pytest", signals)
    frame = Frame(str(source), 4, "test_stops_its_worker", "worker.join()")
    parent.threads = [ThreadStack("0x1", current=True, frames=[frame])]
    parent.tasks = [
        TaskWait(
            10,
            call="wait4",
            waits_for=[WaitEdge(11, kind=CHILD)],
            python_thread="0x1",
            wait=ChildExit(11) if wait is None else wait,  # type: ignore[arg-type]
        )
    ]
    return parent


@pytest.mark.parametrize(
    ("parent", "child", "said"),
    [
        (
            SignalFacts(ignored=["SIGTERM"]),
            SignalFacts(ignored=["SIGTERM"]),
            "child (pid 11) ignores SIGTERM (SIG_IGN, as its parent does: a disposition "
            "inherited at fork), so the SIGTERM that terminate() sends does not end it "
            "(terminate() was called at line 3, before this wait)",
        ),
        (
            SignalFacts(),
            SignalFacts(ignored=["SIGTERM"]),
            "child (pid 11) ignores SIGTERM (SIG_IGN), so the SIGTERM that terminate() sends "
            "does not end it (terminate() was called at line 3, before this wait)",
        ),
        (
            SignalFacts(),
            SignalFacts(blocked=["SIGTERM"]),
            "child (pid 11) blocks SIGTERM in its signal mask (a mask is inherited from the "
            "thread that forked it), so the SIGTERM that terminate() sends stays pending and "
            "does not end it (terminate() was called at line 3, before this wait)",
        ),
        # SIGTERM's default action, or a handler: it would end the child, nothing to say
        (SignalFacts(), SignalFacts(), None),
        (SignalFacts(), SignalFacts(caught=["SIGTERM"], handlers={"SIGTERM": "stop"}), None),
    ],
)
def test_a_joined_child_that_ignores_or_blocks_sigterm_is_told(
    parent: SignalFacts, child: SignalFacts, said: str | None, tmp_path: Path
) -> None:
    joiner = _joiner(tmp_path, parent)
    worker = _proc(11, 10, "child", child)
    assert sigterm_facts(joiner, joiner.tasks[0], [joiner, worker]) == ([said] if said else [])


def test_only_a_wait_for_a_live_child_s_exit_is_looked_at(tmp_path: Path) -> None:
    worker = _proc(11, 10, "child", SignalFacts(ignored=["SIGTERM"]))
    reader = _joiner(tmp_path, SignalFacts(), wait=Pipe(fd=3, inode="7"))
    assert sigterm_facts(reader, reader.tasks[0], [reader, worker]) == []
    joiner = _joiner(tmp_path, SignalFacts())
    worker.exit_status = "exited with code 0"
    assert sigterm_facts(joiner, joiner.tasks[0], [joiner, worker]) == []
    worker.exit_status, worker.signals = "", None  # masks not read: nothing claimed
    assert sigterm_facts(joiner, joiner.tasks[0], [joiner, worker]) == []

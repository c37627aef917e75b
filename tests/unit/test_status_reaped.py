"""A loop on a child's state that never ends because the process's own SIGCHLD handler took
the child's exit status (diagnosis/rules/reaped.py), told only on that evidence."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from pytest_torchhang.diagnosis.rules.reaped import hint_status_reaped
from pytest_torchhang.report.model import Frame, ProcessReport, Role, ThreadStack
from pytest_torchhang.report.signals import SignalFacts

STDLIB = sysconfig.get_paths()["stdlib"]
SUPERVISOR = """\
def supervise(worker):
    worker.start()
    while worker.is_alive():
        time.sleep(0.05)
"""
SLEEPER = """\
def wait_for_flag(flag):
    while not flag.exists():
        time.sleep(0.05)
"""


def _supervisor(tmp_path: Path, source: str, handlers: dict[str, str] | None) -> ProcessReport:
    path = tmp_path / "test_supervise.py"
    path.write_text(source)
    proc = ProcessReport(10, 1, "pytest", "python", "S", 0, 0, 0, 1, 0, "ok")
    proc.role_facts = Role("pytest")
    proc.signals = SignalFacts(caught=["SIGCHLD"], handlers=handlers)
    sleep = Frame(f"{STDLIB}/selectors.py", 1, "select", "")  # a library frame above
    frame = Frame(str(path), 4, "supervise", "time.sleep(0.05)")
    proc.threads = [ThreadStack("0x1", current=True, frames=[sleep, frame])]
    return proc


def _child(pid: int, ppid: int, role: str, kind: str, exit_status: str = "") -> ProcessReport:
    child = ProcessReport(pid, ppid, role, "python", "S", 0, 0, 0, 1, 0, "ok")
    child.role_facts = Role(kind)
    child.exit_status = exit_status
    return child


@pytest.mark.parametrize(
    ("source", "handlers", "children", "told"),
    [
        (SUPERVISOR, {"SIGCHLD": "reap_all"}, [], True),
        # a helper of multiprocessing's beside it is no child the loop asks about
        (SUPERVISOR, {"SIGCHLD": "reap_all"}, [("resource_tracker", "resource_tracker", "")], True),
        # no handler of its own, or not known: the child's end is another story
        (SUPERVISOR, {}, [], False),
        (SUPERVISOR, None, [], False),
        # the child still runs, or is a zombie nobody reaped: not stolen
        (SUPERVISOR, {"SIGCHLD": "reap_all"}, [("child", "child", "")], False),
        (SUPERVISOR, {"SIGCHLD": "reap_all"}, [("child", "child", "exited with code 0")], False),
        # a loop that asks nothing of a child
        (SLEEPER, {"SIGCHLD": "reap_all"}, [], False),
    ],
)
def test_a_loop_on_a_reaped_child_s_state_is_told_with_the_handler(
    source: str,
    handlers: dict[str, str] | None,
    children: list[tuple[str, str, str]],
    told: bool,
    tmp_path: Path,
) -> None:
    proc = _supervisor(tmp_path, source, handlers)
    others = [_child(11 + k, 10, *c) for k, c in enumerate(children)]
    hints = hint_status_reaped([proc, *others])
    assert bool(hints) == told
    if told:
        (hint,) = hints
        assert hint.rule == "status_reaped" and hint.pids == [10]
        assert "`while worker.is_alive():`" in hint.text
        assert "a Python SIGCHLD handler of its own (reap_all)" in hint.text

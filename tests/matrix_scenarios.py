"""Cells of the interaction matrix: where a test hangs, what must fire when, and the per-cell checks."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from conftest import Session

#: The inner test module every cell of a session lives in.
MODULE = "test_cells"

#: Helpers every cell may use; each blocking function's name is what the report must show.
HEADER = """
import os
import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import pytest_torchhang


def main_thread_waits_on_an_event():
    threading.Event().wait()


def main_thread_beats_every_50ms_for_ever():
    while True:  # progress never stops, so only a timeout can end this test
        time.sleep(0.05)
        pytest_torchhang.progress()


def teardown_waits_on_an_event():
    threading.Event().wait()


@pytest.fixture
def stuck_teardown():
    yield
    teardown_waits_on_an_event()


def worker_waits_in_getitem():
    threading.Event().wait()


class StuckInGetitem(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        worker_waits_in_getitem()


def ranks_in_different_collectives(rank, world_size):
    import torch.distributed as dist

    tensor = torch.ones(1)
    if rank == 0:
        dist.all_reduce(tensor)
    else:
        dist.barrier()


def child_waits_on_an_event():
    threading.Event().wait()


def child_beats_every_50ms_for_ever():
    while True:
        time.sleep(0.05)
        pytest_torchhang.progress()
"""

#: Where a test hangs -> (the test's arguments, its body, the frame the report must show).
WHERE = {
    "main": ("", "main_thread_waits_on_an_event()", "main_thread_waits_on_an_event"),
    "main_beating": (
        "",
        "main_thread_beats_every_50ms_for_ever()",
        "main_thread_beats_every_50ms_for_ever",
    ),
    "teardown": ("stuck_teardown", "pass", "teardown_waits_on_an_event"),
    "dataloader": (
        "",
        "for _ in DataLoader(StuckInGetitem(), num_workers=2):\n        pass",
        "worker_waits_in_getitem",
    ),
    "gloo": (
        "torch_hang",
        "torch_hang.distributed(ranks_in_different_collectives, world_size=2{call})",
        "ranks_in_different_collectives",
    ),
    "child": (
        "torch_hang",
        "torch_hang.run(child_waits_on_an_event{call})",
        "child_waits_on_an_event",
    ),
    "child_beating": (
        "torch_hang",
        "torch_hang.run(child_beats_every_50ms_for_ever{call})",
        "child_beats_every_50ms_for_ever",
    ),
}

#: ``HANG after 6.1s in [torch_hang.run(fn) in ]test_x.py::test_y[ (during teardown)]: ...``
#: Source lines the report must show besides the blocking frame (both ranks' collectives).
ALSO_SHOWN = {
    "gloo": ("dist.all_reduce(tensor)", "dist.barrier()"),
    "dataloader": ("worker_waits_in_getitem()",),
}

_HEADLINE = re.compile(r"^(HANG|STALL) after (\d+(?:\.\d+)?)s in (.*?)(?: \(during \w+\))?: ")
#: How late a fire may come on a loaded 2-core machine; early is never allowed (beyond rounding).
LATE_S = 3.5
#: A fixture call that inherits the test's deadline ends 0.5 s before it, to leave the test time.
EARLY_S = 0.6
#: ... and its headline counts from the call's start, after the test's own start and the ranks'
#: (or child's) start: on a loaded machine that is up to a second or two after the test began.
INHERITED_EARLY_S = 2.5
#: A stall's headline counts from the test's start, a zygote start (which pauses the test's
#: clocks) included: its silence, ``no progress for Xs``, is what the stall time bounds.
SILENCE = re.compile(r"no progress for (\d+(?:\.\d+)?)s")


@dataclass(frozen=True)
class Cell:
    """One hanging test: it must fire ``kind`` about ``due_s`` after it started."""

    name: str
    where: str
    kind: str
    due_s: float
    mark: str = ""  # a decorator line, e.g. "@pytest.mark.timeout(5)"
    call_timeout: float | None = None  # the fixture call's own timeout

    @property
    def teardown(self) -> bool:
        return self.where == "teardown"

    @property
    def frame(self) -> str:
        return WHERE[self.where][2]

    def source(self) -> str:
        args, body, _ = WHERE[self.where]
        call = f", timeout={self.call_timeout}" if self.call_timeout is not None else ""
        mark = f"{self.mark}\n" if self.mark else ""
        return (
            f"\n\n{mark}def {self.name}({args}):\n    {body.format(call=call)}\n\n\n"
            f"def {self.name}__then_the_next_test_passes():\n    pass\n"
        )


@dataclass
class Group:
    """Cells that share one inner session (its command line), each checked on its own."""

    args: tuple[str, ...]
    cells: tuple[Cell, ...]
    plugin_timeout: float | None = None  # --torch-hang-timeout, passed by GuardedRunner
    problems: dict[str, list[str]] = field(default_factory=dict)

    def module(self) -> str:
        return HEADER + "".join(cell.source() for cell in self.cells)

    def expected_outcomes(self) -> dict[str, int]:
        # a hang or a stall has its own count, in any phase; nothing else fails
        hang = sum(cell.kind == "HANG" for cell in self.cells)
        stall = sum(cell.kind == "STALL" for cell in self.cells)
        teardowns = sum(cell.teardown for cell in self.cells)
        # each cell's following test passes, and so does a test whose teardown hangs
        passed = len(self.cells) + teardowns
        return {"failed": 0, "errors": 0, "passed": passed, "hang": hang, "stall": stall}


def passed_tests(session: Session) -> set[str]:
    """Names of the tests that passed (from ``-rA``'s short summary)."""
    found = re.findall(rf"^PASSED {MODULE}\.py::(\w+)", session.result.stdout.str(), re.M)
    return set(found)


def check_cell(session: Session, cell: Cell) -> list[str]:
    """What is wrong with one cell's outcome: empty when it fired right, once, with its frames."""
    problems = []
    try:
        report = session.report_of(cell.name)
    except AssertionError:
        return ["no failure section for the test (see the session's verdict)"]
    headlines = [m for line in report.splitlines() if (m := _HEADLINE.match(line))]
    if len(headlines) != 1:
        shown = [m.group(0) for m in headlines] or [report[:800]]
        problems.append(f"{len(headlines)} HANG/STALL headlines, expected 1: {shown}")
    if headlines:
        kind, elapsed_text, where = headlines[0].groups()
        elapsed = float(elapsed_text)
        if kind != cell.kind:
            problems.append(f"{kind} fired, expected {cell.kind}: {headlines[0].group(0)}")
        silence = SILENCE.search(report) if kind == "STALL" else None
        if silence:
            elapsed = float(silence.group(1))
        inherited = cell.where in ("child", "child_beating", "gloo") and cell.call_timeout is None
        early = INHERITED_EARLY_S if inherited else EARLY_S
        if not cell.due_s - early <= elapsed <= cell.due_s + LATE_S:
            problems.append(
                f"fired after {elapsed}s, expected {cell.due_s}s (-{early}s/+{LATE_S}s)"
            )
        if not where.endswith(f"{MODULE}.py::{cell.name}"):
            problems.append(f"the headline names {where}")
    if cell.teardown and "(during teardown)" not in report:
        problems.append("the report does not say the hang was during teardown")
    if not re.search(rf"^\s*File .*, in {cell.frame}$", report, re.M):
        problems.append(f"the stuck frame {cell.frame} is not shown")
    missing = [line for line in ALSO_SHOWN.get(cell.where, ()) if line not in report]
    if missing:
        problems.append(f"the report does not show {missing}")
    summary_lines = [
        line
        for line in session.result.stdout.str().splitlines()
        if (m := _HEADLINE.match(line)) and m.group(3).endswith(f"::{cell.name}")
    ]
    # one line in the test's section and one in the torch-hang summary: never a second hang
    if len(summary_lines) != 2:
        problems.append(
            f"{len(summary_lines)} headlines name this test, expected 2: {summary_lines}"
        )
    if f"{cell.name}__then_the_next_test_passes" not in passed_tests(session):
        problems.append("the next test did not pass")
    if cell.teardown and cell.name not in passed_tests(session):
        problems.append("the test body whose teardown hung did not pass")
    return problems


def check_session(session: Session, group: Group) -> list[str]:
    """What is wrong with the session as a whole: it ended normally, with the expected counts."""
    problems = []
    ret = session.result.ret
    if ret != 1:
        problems.append(f"pytest exited with {ret}, expected 1 (tests failed)")
    if "session stopped" in session.text:
        after = session.text[session.text.index("session stopped") :].splitlines()[1:3]
        problems.append(f"pytest-torchhang stopped the session: {' / '.join(after)}")
    try:
        outcomes = session.result.parseoutcomes()
    except ValueError:  # no summary line: the session did not end by itself
        outcomes = {}
    got = {key: outcomes.get(key, 0) for key in ("failed", "errors", "passed", "hang", "stall")}
    if got != group.expected_outcomes():
        problems.append(f"outcomes {got}, expected {group.expected_outcomes()}")
    if session.leftovers:
        problems.append(f"processes left running: {session.leftovers}")
    if session.new_shm:
        problems.append(f"/dev/shm segments left: {session.new_shm}")
    if session.new_tmp:
        problems.append(f"multiprocessing temp dirs left in TMPDIR: {session.new_tmp}")
    return problems


def verdict(session: Session, group: Group) -> str:
    """Every cell's verdict and the session's, one block each; empty when all are right."""
    blocks = []
    for cell in group.cells:
        problems = check_cell(session, cell)
        if problems:
            blocks.append(f"cell {cell.name}: FAILS\n  - " + "\n  - ".join(problems))
    session_problems = check_session(session, group)
    if session_problems:
        blocks.append("session: FAILS\n  - " + "\n  - ".join(session_problems))
    if not blocks:
        return ""
    if session_problems:
        blocks.append(f"the session's output ends:\n{session.text.strip()[-1200:]}")
    passing = [c.name for c in group.cells if not check_cell(session, c)]
    blocks.append(f"cells that pass: {passing or 'none'}")
    return "\n".join(blocks)

"""The exceptions a test sees: a hang, a crashed child, and a child's own error."""

from __future__ import annotations

from types import CodeType, TracebackType
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from .report.model import HangReport


class HangError(pytest.fail.Exception):  # type: ignore[misc, name-defined]
    """A test, or work it ran in subprocesses, passed its deadline; ``.report`` says where it hung.

    It derives from pytest's ``Failed`` (a ``BaseException``), so a broad ``except Exception`` in
    the code under test cannot swallow it.
    """

    def __init__(self, message: str, report: HangReport | None = None) -> None:
        super().__init__(message, pytrace=True)
        self.report = report

    def __reduce__(self) -> tuple[type[HangError], tuple[str, HangReport | None]]:
        return (type(self), (str(self.msg), self.report))


class ChildCrashed(Exception):
    """A child process died (a signal or an exit code) instead of returning a result."""

    def __init__(
        self,
        message: str,
        *,
        signal: str | None = None,
        exitcode: int | None = None,
        crash_trace: str = "",
    ) -> None:
        super().__init__(message)
        self.signal = signal
        self.exitcode = exitcode
        self.crash_trace = crash_trace

    def __str__(self) -> str:
        text = str(self.args[0])
        if self.crash_trace:
            text += "\n\nthe child's crash trace (faulthandler):\n" + self.crash_trace.rstrip()
        return text


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a child process, shown as its ``__cause__``."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n\n--- traceback in the child process ---\n" + self.text.rstrip()


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` on Python 3.11+; on 3.10 the same ``__notes__`` list, which
    pytest shows there through the ``exceptiongroup`` backport it depends on."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:
        exc.__notes__ = [*getattr(exc, "__notes__", ()), note]  # type: ignore[attr-defined,unused-ignore]


def _nearest_line(code: CodeType, lasti: int) -> tuple[int, int]:
    """(line, instruction index) of the last instruction at or before ``lasti`` with a line."""
    line, index = code.co_firstlineno, 0
    for start, _end, number in code.co_lines():
        if start > lasti:
            break
        if number is not None:
            line, index = number, start
    return line, index


def _with_line_numbers(tb: TracebackType) -> TracebackType:
    entries = []
    walk: TracebackType | None = tb
    while walk is not None:
        entries.append(walk)
        walk = walk.tb_next
    if all(entry.tb_lineno is not None for entry in entries):
        return tb
    rebuilt: TracebackType | None = None
    for entry in reversed(entries):
        line, lasti = entry.tb_lineno, entry.tb_lasti
        if line is None:
            # the index moves too: pytest (through traceback.extract_tb) reads positions at it
            line, lasti = _nearest_line(entry.tb_frame.f_code, entry.tb_lasti)
        rebuilt = TracebackType(rebuilt, entry.tb_frame, lasti, line)
    assert rebuilt is not None
    return rebuilt


def make_renderable(exc: BaseException) -> bool:
    """Give every traceback entry of ``exc`` (its causes, contexts and group members too) a
    line number; returns whether anything changed.

    An interrupt can land on an instruction that has no line of its own (Python 3.11+ does
    that), and its traceback entry then says ``tb_lineno is None``: pytest cannot render that
    and ends the session with an INTERNALERROR. Such an entry gets the line of the nearest
    instruction before it that has one.
    """
    changed = False
    seen: set[int] = set()
    todo = [exc]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        tb = current.__traceback__
        if tb is not None:
            fixed = _with_line_numbers(tb)
            if fixed is not tb:
                current.__traceback__ = fixed
                changed = True
        todo.extend(e for e in (current.__cause__, current.__context__) if e is not None)
        todo.extend(getattr(current, "exceptions", ()))
    return changed

"""The exceptions a test sees: a hang, a crashed child, and a child's own error."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from .report import HangReport


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

"""What the plugin writes to pytest's terminal at the session's end: each hang's report (a HANGS
section, as pytest writes FAILURES), hangs in the short test summary, the session's notes, what
tests left running, the hunt, and the hangs' headlines.

Loaded at configure (``ShortSummary`` is registered then); the report's code (the cold path)
only once a session had a failure.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from .hunt import HuntPlugin
    from .session import SessionState


def hang_reports(terminalreporter: pytest.TerminalReporter) -> list[pytest.TestReport]:
    stats = terminalreporter.stats
    if not any(stats.get(c) for c in ("failed", "error", "hang", "stall")):
        return []  # a passing session: the report's code (the cold path) stays unloaded
    from .report import handoff

    found = [
        r
        for category in (*handoff.OUTCOMES, "failed", "error")
        for r in stats.get(category, [])
        if isinstance(r, pytest.TestReport) and handoff.is_hang(r)
    ]
    return list({id(r): r for r in found}.values())


def write_hang_sections(
    terminalreporter: pytest.TerminalReporter, hangs: list[pytest.TestReport]
) -> None:
    """Each hang's report in full, as pytest writes a failure's in its FAILURES section (which
    lists the "failed" category only)."""
    from .report import handoff

    config = terminalreporter.config
    if config.option.tbstyle == "no" or getattr(config.option, "no_summary", False):
        return
    terminalreporter.write_sep("=", "HANGS", red=True, bold=True)
    showcapture = config.option.showcapture
    for report in hangs:
        terminalreporter.write_sep("_", handoff.section_title(report), red=True, bold=True)
        report.toterminal(terminalreporter)  # type: ignore[arg-type]  # it calls .line() only
        if showcapture == "no":
            continue
        for name, content in report.sections:
            if showcapture != "all" and showcapture not in name:
                continue
            terminalreporter.write_sep("-", name)
            terminalreporter.line(content[:-1] if content.endswith("\n") else content)


#: pytest's report characters (``-r``) and the categories whose lines they add to its short
#: summary: pytest writes the summary's title only when one of them has a line.
_REPORTCHARS = {"f": "failed", "E": "error", "s": "skipped", "x": "xfailed", "X": "xpassed"}


class ShortSummary:
    """Hangs in pytest's short test summary (``HANG test_x.py::test_x - HANG after ...``),
    which lists its own categories only: written just after it, by a wrapper around pytest's."""

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_terminal_summary(
        self, terminalreporter: pytest.TerminalReporter
    ) -> Generator[None, None, None]:
        try:
            return (yield)
        finally:
            self._write(terminalreporter)

    @staticmethod
    def _write(terminalreporter: pytest.TerminalReporter) -> None:
        chars = terminalreporter.reportchars
        if "f" not in chars or getattr(terminalreporter.config.option, "no_summary", False):
            return
        hangs = hang_reports(terminalreporter)
        if not hangs:
            return
        from .report import handoff

        stats = terminalreporter.stats
        if not any(stats.get(_REPORTCHARS[c]) for c in chars if c in _REPORTCHARS):
            # pytest wrote no title: it had no line of its own
            terminalreporter.write_sep("=", "short test summary info", cyan=True, bold=True)
        for report in hangs:
            word = handoff.outcome(report)[2]
            terminalreporter.write_line(f"{word} {report.nodeid} - {handoff.headline(report)}")


def summary(
    terminalreporter: pytest.TerminalReporter, state: SessionState, hunter: HuntPlugin | None
) -> None:
    """The session's notes, what tests left running, the hunt, and each hang's report and
    headline (``plugin.pytest_terminal_summary``)."""
    config = terminalreporter.config
    stats = terminalreporter.stats
    failures = [*stats.get("failed", []), *stats.get("error", [])]
    failures += [*stats.get("hang", []), *stats.get("stall", [])]
    if not (state.notes or state.leftovers or failures or hunter or stats.get("rerun")):
        return  # nothing to say (and nothing more to import)
    from .report import handoff

    hangs = hang_reports(terminalreporter)
    if hangs:
        write_hang_sections(terminalreporter, hangs)

    write = terminalreporter.write_line
    if state.notes:
        terminalreporter.write_sep("=", "torch-hang: notes", yellow=True)
        for note in dict.fromkeys(state.notes):  # each said once
            write(note)
    if state.leftovers:
        terminalreporter.write_sep("=", "torch-hang: processes left running by tests", yellow=True)
        for line in state.leftovers:
            write(line)
        write(
            f"killed {len(state.leftovers)} process(es) at session end: tests started them and "
            "left them running (they would have blocked pytest's exit or outlived it)"
        )
    if hunter is not None and hunter.tests:
        terminalreporter.write_sep("=", "torch-hang hunt", bold=True)
        for line in hunter.summary_lines():
            write(line)
        hunter.write_json(state.settings.report_dir)
    # pytest-rerunfailures: an attempt that hung and was run again is a "rerun", not a failure
    reruns = [r for r in stats.get("rerun", []) if handoff.is_hang(r)]
    if not hangs and not reruns:
        return
    terminalreporter.write_sep("=", "torch-hang summary", red=True, bold=True)
    for report in reruns:
        write(f"attempt {getattr(report, 'rerun', 0) + 1}, run again: {handoff.headline(report)}")
    for report in hangs:
        write(handoff.headline(report))
    if os.environ.get("GITHUB_ACTIONS") == "true":
        for report in hangs:  # one annotation per hang, on the test's line
            write(handoff.github_annotation(report))
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary and not hasattr(config, "workerinput"):  # the controller writes, once per hang
        from .report import views

        for report in hangs:
            hang = handoff.hang_model(report)
            problem = views.append_job_summary(summary, hang) if hang is not None else None
            if problem:
                write(f"torch-hang: {problem}")

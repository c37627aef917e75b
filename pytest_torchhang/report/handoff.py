"""How a hang travels in pytest's reports: longrepr, user properties, the JSON file, the summary."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Protocol

import pytest

from .hunts import signature
from .model import HangReport
from .text import to_text

HANG_PROPERTY = "torch_hang"
HEADLINE_PROPERTY = "torch_hang_headline"
#: ``hang`` (past its deadline) or ``stall`` (no progress for the stall time): the outcome.
KIND_PROPERTY = "torch_hang_kind"
#: The headline's hint, when one matched: what JUnit readers and dashboards group hangs by.
CAUSE_PROPERTY = "torch_hang_cause"
#: Stable ids to group hangs by, across runs and machines (the cause's text names pids): the id
#: of the rule whose hint is the cause ("none" when no rule named one), and the hang's signature
#: (its processes' roles and stuck frames, as ``--torch-hang-hunt`` counts distinct hangs).
RULE_PROPERTY = "torch_hang_rule"
SIGNATURE_PROPERTY = "torch_hang_signature"
#: The outcomes a hang report gets instead of "failed": (category, letter, word). The report
#: stays failed (exit code 1, ``-x``, ``--maxfail``, ``--lf``, JUnit's <failure> count it);
#: only the terminal's count and word are its own.
OUTCOMES = {"hang": ("hang", "H", "HANG"), "stall": ("stall", "S", "STALL")}
#: The report's attribute holding the hang as its JSON document: pytest-xdist sends a report's
#: attributes to the controller, which rebuilds the model from it (the job summary's graph).
#: Not a section (the terminal prints sections) nor a property (JUnit XML writes properties).
MODEL_ATTRIBUTE = "torch_hang_json"


@dataclass(frozen=True)
class _Crash:
    """What pytest's short summary and JUnit XML read from ``longrepr.reprcrash``."""

    message: str
    path: str = ""
    lineno: int = 0


class _Writer(Protocol):
    """What ``toterminal`` uses of pytest's terminal writer (private: ``_pytest._io``)."""

    def line(self, s: str = "", **markup: bool) -> None: ...


class HangLongRepr:
    """A hang's ``longrepr``: the headline is the failure message, the report is the text.

    pytest reads a longrepr by duck typing: ``toterminal(writer)`` for the terminal (and
    ``longreprtext``), ``reprcrash.message`` for the short summary and JUnit XML, ``str()`` for
    pytest-xdist and JUnit. Its base class ``TerminalRepr`` and its writer are private
    (``_pytest``); pytest 9.0 exposes neither (pytest-dev/pytest#10436 proposes a public
    ``TerminalWriter``; no version provides it yet), so this class derives from nothing.
    """

    def __init__(self, headline: str, text: str, path: str = "", lineno: int = 0) -> None:
        self.reprcrash = _Crash(headline, path, lineno)
        self.text = text

    def toterminal(self, tw: _Writer) -> None:
        for number, line in enumerate(self.text.splitlines()):
            if number == 0:
                tw.line(line, red=True, bold=True)
            elif line.startswith("hint:"):
                tw.line(line, yellow=True, bold=True)
            else:
                tw.line(line)

    def __str__(self) -> str:
        return self.text


def write_json(report_dir: str, hang: HangReport, nodeid: str, tag: str) -> str | None:
    """One JSON file per hang in ``report_dir``; ``tag`` keeps names apart (worker, pid, count).

    A file that cannot be written must not end the session: the reason goes into the report.
    """
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid)[-120:]
    path = os.path.join(report_dir, f"{safe}-{tag}.json")
    try:
        os.makedirs(report_dir, exist_ok=True)
        with open(path, "w") as out:
            json.dump(hang.to_json(), out, indent=1, default=str)
    except OSError as exc:
        hang.notes.append(f"the JSON report could not be written to {path}: {exc}")
        return None
    return path


def mark_hang(
    item: pytest.Item, report: pytest.TestReport, hang: HangReport, json_path: str | None
) -> None:
    """Turn ``report`` into a hang: failed, the hang's text as longrepr, its properties set."""
    path, lineno, _ = item.location
    report.outcome = "failed"
    properties = [
        (HANG_PROPERTY, "true"),
        ("torch_hang_timeout", f"{hang.timeout_s:g}"),
        ("torch_hang_processes", str(len(hang.processes))),
        (HEADLINE_PROPERTY, hang.headline),
        (KIND_PROPERTY, hang.kind if hang.kind in OUTCOMES else "hang"),
    ]
    if hang.cause:
        properties.append((CAUSE_PROPERTY, hang.cause))
    properties.append((RULE_PROPERTY, cause_rule(hang)))
    properties.append((SIGNATURE_PROPERTY, signature(hang)))
    if json_path:
        properties.append(("torch_hang_report", json_path))
    longrepr = HangLongRepr(hang.headline, to_text(hang), path, (lineno or 0) + 1)
    # typed as the private TerminalRepr in pytest; any object with toterminal() is read as one
    report.longrepr = longrepr  # type: ignore[assignment]
    report.user_properties.extend(properties)
    setattr(report, MODEL_ATTRIBUTE, json.dumps(hang.to_json(), default=str))
    if report.when != "teardown":
        # JUnit XML writes the properties of the teardown report, a copy of the item's
        item.user_properties.extend(properties)


def cause_rule(hang: HangReport) -> str:
    """The id of the rule whose hint is the hang's cause; ``none`` when no rule named one."""
    return next((h.rule for h in hang.hints if hang.cause and h.text == hang.cause), "none")


def is_hang(report: pytest.TestReport | pytest.CollectReport) -> bool:
    return any(k == HANG_PROPERTY for k, _ in getattr(report, "user_properties", ()))


def hang_model(report: pytest.TestReport) -> HangReport | None:
    """The hang a report carries, rebuilt (on the xdist controller too); None if it has none."""
    doc = getattr(report, MODEL_ATTRIBUTE, None)
    if not isinstance(doc, str):
        return None
    try:
        return HangReport.from_json(json.loads(doc))
    except (ValueError, TypeError):
        return None


def _property(report: pytest.TestReport, name: str) -> str:
    return str(next((v for k, v in report.user_properties if k == name), ""))


def headline(report: pytest.TestReport) -> str:
    return _property(report, HEADLINE_PROPERTY)


def outcome(report: pytest.TestReport) -> tuple[str, str, str]:
    """(category, letter, word) of a hang report: ``("hang", "H", "HANG")`` or the stall's."""
    return OUTCOMES.get(_property(report, KIND_PROPERTY), OUTCOMES["hang"])


def section_title(report: pytest.TestReport) -> str:
    """The title of a hang's section, as pytest titles a failure's: the test's name, with the
    phase when it hung outside the test body (``HANG at teardown of test_x``)."""
    name = report.head_line or report.nodeid
    if report.when == "call":
        return name
    return f"{outcome(report)[2]} at {report.when} of {name}"


def restore_longrepr(report: pytest.TestReport) -> None:
    """A worker's hang report, rebuilt on the pytest-xdist controller: its longrepr arrives as
    the hang's text (pytest-xdist sends ``str(longrepr)``); give it its headline back."""
    if not is_hang(report) or not isinstance(report.longrepr, str):
        return
    path, lineno, _ = report.location
    longrepr = HangLongRepr(headline(report), report.longrepr, path, (lineno or 0) + 1)
    report.longrepr = longrepr  # type: ignore[assignment]  # see mark_hang


def github_annotation(report: pytest.TestReport) -> str:
    """A GitHub Actions ``::error`` line on the test's line for one hang."""
    path, lineno, _ = report.location
    message = _gh_data(f"{headline(report)} (the job log has every process's stack)")
    return f"::error file={_gh_property(path)},line={(lineno or 0) + 1},title=HANG::{message}"


def _gh_data(text: str) -> str:
    """Escape a workflow command's message (GitHub Actions' rules)."""
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _gh_property(text: str) -> str:
    """Escape a workflow command's property value (GitHub Actions' rules)."""
    return _gh_data(text).replace(":", "%3A").replace(",", "%2C")

"""Join the hunt summaries (``*-hunt.json``) of several machines into one count per test."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from .hunts import hunt_line

HUNT_SCHEMA = "pytest-torchhang/hunt-summary"
HUNT_SCHEMA_VERSION = 1


class InputError(Exception):
    """A path that is not a readable hunt summary; the message names it."""


@dataclass
class SeenSignature:
    """One distinct way a test hung, over every machine that saw it."""

    text: str
    count: int = 0
    headline: str = ""
    first_report: str = ""  # the first report found, as a path on this machine
    seen_in: dict[str, int] = field(default_factory=dict)  # directory -> hangs seen there


@dataclass
class MergedTest:
    """One test's runs and hangs, summed over the summaries given."""

    test_id: str
    runs: int = 0
    hangs: int = 0
    signatures: dict[str, SeenSignature] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)  # the directories that ran it

    def line(self) -> str:
        return hunt_line(self.test_id, self.hangs, self.runs, len(self.signatures))


def hunt_files(paths: list[str]) -> list[str]:
    """Every ``*-hunt.json`` under the directories given, and the files given, in that order."""
    found: list[str] = []
    for path in paths:
        if os.path.isdir(path):
            for root, dirs, files in os.walk(path):
                dirs.sort()
                found += [os.path.join(root, f) for f in sorted(files) if f.endswith("-hunt.json")]
        elif os.path.isfile(path):
            found.append(path)
        else:
            raise InputError(f"{path}: no such file or directory")
    if not found:
        raise InputError(
            f"{', '.join(paths)}: no *-hunt.json file found (run with --torch-hang-hunt=N --torch-hang-report-dir=DIR)"
        )
    return found


def _load(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as source:
            doc = json.load(source)
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot be read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("schema") != HUNT_SCHEMA:
        raise InputError(f"{path}: not a pytest-torchhang hunt summary (schema {HUNT_SCHEMA!r})")
    version = doc.get("schema_version")
    if not isinstance(version, int) or version > HUNT_SCHEMA_VERSION:
        raise InputError(
            f"{path}: hunt summary schema_version {version!r} is newer than this "
            f"pytest-torchhang reads ({HUNT_SCHEMA_VERSION}): upgrade pytest-torchhang"
        )
    try:
        int(doc["runs"]), str(doc["test_id"])
        for sig in doc["signatures"]:
            int(sig["count"]), str(sig["signature"])
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(f"{path}: a hunt summary without its field {exc}") from None
    return doc


def _report_path(hunt_file: str, sig: dict[str, Any]) -> str:
    """The signature's first report beside the summary (an uploaded directory moves whole)."""
    for name in (sig.get("report_file"), sig.get("report")):
        if name:
            here = os.path.join(os.path.dirname(hunt_file), os.path.basename(str(name)))
            if os.path.exists(here):
                return here
    return ""


def merge(paths: list[str]) -> list[MergedTest]:
    """The hunts of ``paths`` (directories or files), joined per test in the order found."""
    tests: dict[str, MergedTest] = {}
    for path in hunt_files(paths):
        doc = _load(path)
        where = os.path.dirname(path) or "."
        test = tests.setdefault(doc["test_id"], MergedTest(doc["test_id"]))
        test.runs += int(doc["runs"])
        test.sources.append(where)
        for sig in doc["signatures"]:
            seen = test.signatures.setdefault(sig["signature"], SeenSignature(sig["signature"]))
            count = int(sig["count"])
            seen.count += count
            test.hangs += count
            seen.seen_in[where] = seen.seen_in.get(where, 0) + count
            if not seen.first_report:
                seen.first_report = _report_path(path, sig)
                seen.headline = seen.headline or str(sig.get("headline") or "")
    return list(tests.values())


def merged_lines(tests: list[MergedTest]) -> list[str]:
    """The merged table: per test its count line, then each signature once with where it was seen."""
    lines: list[str] = []
    for test in tests:
        lines.append(test.line())
        lines.append(f"    from {len(test.sources)} hunt(s): {', '.join(test.sources)}")
        for number, sig in enumerate(test.signatures.values(), 1):
            lines.append(f"  signature {number} of {test.test_id}, {sig.count} run(s): {sig.text}")
            if sig.headline:
                lines.append(f"    headline: {sig.headline}")
            seen = ", ".join(f"{where} ({count})" for where, count in sig.seen_in.items())
            lines.append(f"    seen in: {seen}")
            lines.append(
                f"    first report: {sig.first_report or '(not found beside its summary)'}"
            )
        lines.append("")
    return lines

"""Stable ids of a hang for JUnit readers and dashboards (issue 30): the cause's rule and the
hang's signature, read from hang reports recorded from real hangs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pytest_torchhang.report.handoff import cause_rule
from pytest_torchhang.report.hunts import signature
from pytest_torchhang.report.model import HangReport

from .conftest import RECORDED, recorded_ids


def _load(path: Path) -> HangReport:
    return HangReport.from_json(json.loads(path.read_text()))


@pytest.mark.parametrize("path", RECORDED, ids=recorded_ids(RECORDED))
def test_the_rule_is_the_one_whose_hint_is_the_cause(path: Path) -> None:
    hang = _load(path)
    rule = cause_rule(hang)
    if hang.cause:
        assert rule in {h.rule for h in hang.hints if h.text == hang.cause}
        assert rule != "none"
    else:
        assert rule == "none"


@pytest.mark.parametrize("path", RECORDED, ids=recorded_ids(RECORDED))
def test_the_signature_names_no_pid_of_the_run(path: Path) -> None:
    hang = _load(path)
    text = signature(hang)
    assert text
    for proc in hang.processes:
        assert not re.search(rf"\b{proc.pid}\b", text), (proc.pid, text)


def test_a_report_without_a_cause_has_the_rule_none() -> None:
    hang = _load(RECORDED[0])
    hang.cause = ""
    assert cause_rule(hang) == "none"

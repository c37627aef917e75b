"""CI views end to end: the GitHub job summary of a real hang, and hunts merged across machines."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import GuardedRunner
from outcomes import assert_outcomes
from pytest_torchhang import __main__ as cli
from unit.mermaid_flowchart import mermaid_blocks, parse

DATALOADER_HANG = """
import time

import torch
from torch.utils.data import DataLoader, Dataset


class Stuck(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        time.sleep(3600)
        return torch.zeros(1)


def test_loader_hangs():
    for _ in DataLoader(Stuck(), num_workers=2):
        pass


def test_fine():
    pass
"""


@pytest.mark.needs_torch
@pytest.mark.parametrize("xdist", [[], ["-n", "2"]], ids=["in-process", "xdist"])
def test_a_dataloader_hang_writes_one_section_with_its_graph_to_the_job_summary(
    guarded: GuardedRunner, monkeypatch: pytest.MonkeyPatch, xdist: list[str]
) -> None:
    guarded.pytester.makepyfile(test_loader=DATALOADER_HANG)
    summary = guarded.pytester.path / "step_summary.md"
    summary.write_text("## Tests\n")
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    # forked workers (no torch import of their own: the module imported it at collection)
    session = guarded.run("-p", "no:randomly", *xdist, timeout=5)
    assert_outcomes(session.result, hang=1, passed=1)
    headline = next(line for line in session.result.stdout.lines if line.startswith("HANG after "))
    assert "test_loader.py::test_loader_hangs" in headline
    assert any(
        line.startswith("::error file=test_loader.py") for line in session.result.stdout.lines
    )
    text = summary.read_text()
    assert text.startswith("## Tests\n")  # appended, never replaced
    assert re.findall(r"^### .*$", text, re.M) == [f"### `{headline}`"]  # once per hang
    (block,) = mermaid_blocks(text)
    chart = parse(block)
    roles = {key: lines[0] for key, lines in chart.nodes.items()}
    workers = {k for k, role in roles.items() if role.startswith("DataLoader worker")}
    assert len(workers) == 2, roles
    pytest_box = next(k for k, role in roles.items() if role.startswith("pytest"))
    assert {(src, dst) for src, _, _, dst in chart.edges} >= {(pytest_box, w) for w in workers}
    assert "<details>" in text and "--- process " in text
    session.assert_clean()


EVERY_SECOND_RUN_HANGS = """
import os
import time


def test_flaky():
    with open(os.environ["RUN_COUNTER"], "a") as runs:
        runs.write(".")
    with open(os.environ["RUN_COUNTER"]) as runs:
        number = len(runs.read())
    if number % 2 == 0:
        time.sleep(600)  # the guard ends it
"""


def test_two_hunts_on_two_machines_merge_into_one_count(
    guarded: GuardedRunner, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    guarded.pytester.makepyfile(test_hunted=EVERY_SECOND_RUN_HANGS)
    machines = ["machine-a", "machine-b"]
    for machine in machines:
        monkeypatch.setenv("RUN_COUNTER", str(guarded.pytester.path / f"{machine}.runs"))
        session = guarded.run(
            "-p",
            "no:randomly",
            "--torch-hang-hunt=3",
            "--torch-hang-hunt-all",
            f"--torch-hang-report-dir={machine}",
            timeout=1,
        )
        assert_outcomes(session.result, hang=1, passed=2)
        assert "test_hunted.py::test_flaky: hung 1 of 3 runs" in session.result.stdout.str()
        session.assert_clean()
    dirs = [str(guarded.pytester.path / m) for m in machines]
    capsys.readouterr()  # pytester echoed the sessions' output
    assert cli.main(["merge-hunts", *dirs]) == 1
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("test_hunted.py::test_flaky: ")]
    assert line.startswith("test_hunted.py::test_flaky: hung 2 of 6 runs (33.3%, 95% CI ")
    assert line.endswith(", 1 distinct signature")
    assert "signature 1 of test_hunted.py::test_flaky, 2 run(s): pytest in test_flaky" in out
    assert f"seen in: {dirs[0]} (1), {dirs[1]} (1)" in out
    first = next(x for x in out.splitlines() if "first report: " in x).split("first report: ")[1]
    assert Path(first).parent == Path(dirs[0]) and Path(first).is_file()

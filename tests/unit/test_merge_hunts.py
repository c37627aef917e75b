"""merge-hunts: the hunt summaries of several machines joined per test, signatures comparable."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from pytest_torchhang import __main__ as cli
from pytest_torchhang import hunt
from pytest_torchhang.report import hunts, merge
from pytest_torchhang.report.model import HangReport

VIEWS_DATA = Path(__file__).parent / "recorded_views"


def recorded(name: str) -> HangReport:
    return HangReport.from_json(json.loads(gzip.decompress((VIEWS_DATA / name).read_bytes())))


def write_hunt(directory: Path, test_id: str, runs: int, hung_runs: dict[str, list[int]]) -> Path:
    """A hunt summary as the plugin writes it (``Hunted.to_json``), its first reports beside it."""
    directory.mkdir(parents=True, exist_ok=True)
    hunted = hunt.Hunted(test_id, planned=runs, runs=runs)
    for n, (text, numbers) in enumerate(hung_runs.items()):
        report = directory / f"{test_id.replace('::', '_')}-main-{n}.json"
        report.write_text("{}")
        sig = hunt.Signature(
            text, runs=numbers, headline=f"HANG in {test_id}", json_path=str(report)
        )
        hunted.signatures[text] = sig
    path = directory / f"{test_id.replace('::', '_')}-hunt.json"
    path.write_text(json.dumps(hunted.to_json()))
    return path


def test_two_machines_merge_into_one_count_with_each_signature_once(tmp_path: Path) -> None:
    sig = "pytest in test_y"
    write_hunt(tmp_path / "machine-a", "t.py::test_y", 3, {sig: [2]})
    write_hunt(tmp_path / "machine-b", "t.py::test_y", 3, {sig: [2]})
    (test,) = merge.merge([str(tmp_path / "machine-a"), str(tmp_path / "machine-b")])
    assert test.line() == hunts.hunt_line("t.py::test_y", 2, 6, 1)
    assert test.line().startswith("t.py::test_y: hung 2 of 6 runs (33.3%, 95% CI ")
    assert test.line().endswith(", 1 distinct signature")
    (seen,) = test.signatures.values()
    assert seen.count == 2
    assert seen.seen_in == {str(tmp_path / "machine-a"): 1, str(tmp_path / "machine-b"): 1}
    assert seen.first_report == str(tmp_path / "machine-a" / "t.py_test_y-main-0.json")


def test_the_merged_line_is_the_hunt_sections_line() -> None:
    hunted = hunt.Hunted("t.py::test_y", planned=6, runs=6)
    hunted.signatures["s"] = hunt.Signature("s", runs=[2, 5])
    merged = merge.MergedTest(
        "t.py::test_y", runs=6, hangs=2, signatures={"s": merge.SeenSignature("s")}
    )
    assert merged.line() == hunted.line()


def test_a_moved_upload_still_finds_its_first_report_by_name(tmp_path: Path) -> None:
    write_hunt(tmp_path / "ci" / "job-3", "t.py::test_y", 4, {"a": [1]})
    moved = tmp_path / "downloaded"
    (tmp_path / "ci").rename(moved)
    (test,) = merge.merge([str(moved)])
    (seen,) = test.signatures.values()
    assert seen.first_report == str(moved / "job-3" / "t.py_test_y-main-0.json")


def test_distinct_signatures_and_tests_stay_apart(tmp_path: Path) -> None:
    write_hunt(tmp_path / "a", "t.py::test_y", 10, {"x": [1, 4], "y": [7]})
    write_hunt(tmp_path / "b", "t.py::test_y", 10, {"y": [3]})
    write_hunt(tmp_path / "b", "t.py::test_z", 10, {})
    tests = {t.test_id: t for t in merge.merge([str(tmp_path)])}
    y, z = tests["t.py::test_y"], tests["t.py::test_z"]
    assert (y.hangs, y.runs, {s.text: s.count for s in y.signatures.values()}) == (
        4,
        20,
        {"x": 2, "y": 2},
    )
    assert z.line().startswith("t.py::test_z: hung 0 of 10 runs (0.0%")


def test_the_command_exits_1_when_any_run_hung_and_0_when_none_did(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_hunt(tmp_path / "clean", "t.py::test_y", 5, {})
    assert cli.main(["merge-hunts", str(tmp_path / "clean")]) == 0
    write_hunt(tmp_path / "hung", "t.py::test_y", 5, {"pytest in test_y": [3]})
    assert cli.main(["merge-hunts", str(tmp_path / "clean"), str(tmp_path / "hung")]) == 1
    out = capsys.readouterr().out
    assert "t.py::test_y: hung 1 of 10 runs (10.0%, 95% CI " in out
    assert "signature 1 of t.py::test_y, 1 run(s): pytest in test_y" in out
    assert f"seen in: {tmp_path / 'hung'} (1)" in out


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (None, "no such file or directory"),
        ("{", "not JSON"),
        ('{"schema": "pytest-torchhang/hang-report"}', "not a pytest-torchhang hunt summary"),
        ('{"schema": "pytest-torchhang/hunt-summary", "schema_version": 7}', "schema_version 7"),
        ('{"schema": "pytest-torchhang/hunt-summary", "schema_version": 1}', "without its field"),
    ],
)
def test_a_bad_input_is_one_line_that_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, reason: str
) -> None:
    path = tmp_path / "x-hunt.json"
    if content is not None:
        path.write_text(content)
    assert cli.main(["merge-hunts", str(path)]) == cli.BAD_INPUT
    (line,) = capsys.readouterr().err.splitlines()
    assert str(path) in line and reason in line, line


def test_a_directory_without_hunts_is_an_error_not_a_clean_result(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["merge-hunts", str(tmp_path)]) == cli.BAD_INPUT
    assert "no *-hunt.json file found" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name", ["dataloader_two_workers.json.gz", "pipe_cycle.json.gz", "join_wait4.json.gz"]
)
def test_a_signature_holds_no_pid_address_or_absolute_path(name: str) -> None:
    hang = recorded(name)
    text = hunt.signature(hang)
    assert text != "no stuck frame"
    assert not any(str(p.pid) in text for p in hang.processes), text
    assert "0x" not in text and "/" not in text.replace("/?", ""), text


def test_the_same_hang_elsewhere_has_the_same_signature() -> None:
    here = recorded("dataloader_two_workers.json.gz")
    there = recorded("dataloader_two_workers.json.gz")
    for n, proc in enumerate(there.processes):  # other pids, other paths, other addresses
        proc.pid += 1000 + n
        proc.cmdline = proc.cmdline.replace("/tmp/", "/home/runner/work/")
    there.processes[0].role = "pytest (xdist worker gw3)"
    assert hunts.signature(there) == hunts.signature(here)
    assert hunts._stable("f at /home/a/b/t.py:3 (pid 41) 0x7f3a") == "f at t.py:3 (pid ?) 0x?"

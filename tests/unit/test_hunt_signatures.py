"""Hunt signatures: one string per way a test hangs, equal for the same hang on any machine."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from pytest_torchhang.diagnosis import frames
from pytest_torchhang.hunt import base_id, run_number
from pytest_torchhang.report.hunts import signature, wilson
from pytest_torchhang.report.model import HangReport, Role

from .conftest import RECORDED, RECORDING, recorded_ids


@pytest.mark.parametrize(
    ("role", "kind"),
    [
        ("DataLoader worker 1/4 (dataset Tokens)", "DataLoader worker"),
        ("DataLoader worker 0/1", "DataLoader worker"),
        ("rank 0/2", "rank"),
        ("rank 1/2 (gloo)", "rank"),
        ("rank 3/8 (torch.multiprocessing.spawn)", "rank"),
        ("pytest", "pytest"),
        ("pytest (xdist worker gw1)", "pytest"),
        ("multiprocessing.Process(target=_census)", "multiprocessing.Process(target=_census)"),
        ("Pool worker", "Pool worker"),
        ("exited child", "exited child"),
        ("run child 12345", "run child"),
        ("(unnamed)", "(unnamed)"),  # nothing before the cut: the role itself
        ("", ""),
    ],
)
def test_role_kind_drops_numbers_and_details(role: str, kind: str) -> None:
    assert Role.parse(role).general() == kind
    assert Role.parse(role).text() == role  # a role read from text renders as that text


@pytest.mark.parametrize(
    ("hits", "runs", "low", "high"),
    [
        (0, 0, 0.0, 1.0),  # no run: nothing known
        (0, 10, 0.0, 0.2775),
        (10, 10, 0.7225, 1.0),
        (5, 10, 0.2366, 0.7634),
        (3, 200, 0.0051, 0.0431),  # the README's example: 1.5%, 95% CI 0.5%-4.3%
        (1, 1, 0.2065, 1.0),
        (0, 1000, 0.0, 0.0038),
    ],
)
def test_wilson_interval(hits: int, runs: int, low: float, high: float) -> None:
    got = wilson(hits, runs)
    assert got == pytest.approx((low, high), abs=1e-4)
    assert 0.0 <= got[0] <= hits / max(runs, 1) <= got[1] <= 1.0


def test_a_wider_confidence_gives_a_wider_interval() -> None:
    low95, high95 = wilson(3, 50)
    low99, high99 = wilson(3, 50, z=2.576)
    assert low99 < low95 < high95 < high99


@pytest.mark.parametrize(
    ("nodeid", "base", "run"),
    [
        ("test_x.py::test_y[a-hunt7]", "test_x.py::test_y[a]", 7),
        ("test_x.py::test_z[hunt7]", "test_x.py::test_z", 7),
        ("test_x.py::test_z[hunt3-a]", "test_x.py::test_z[a]", 3),
        ("test_x.py::Cls::test[1-2-hunt120]", "test_x.py::Cls::test[1-2]", 120),
        ("test_x.py::test_z", "test_x.py::test_z", 0),
        ("test_x.py::test_z[a-b]", "test_x.py::test_z[a-b]", 0),
        ("test_x.py::test_z[hunt]", "test_x.py::test_z[hunt]", 0),  # no run number
        ("test_x.py::test_z[xhunt3]", "test_x.py::test_z[xhunt3]", 0),  # a user's own id
        ("test_x.py::test_z[hunt3x]", "test_x.py::test_z[hunt3x]", 0),
    ],
)
def test_base_id_and_run_number_of_a_hunted_run(nodeid: str, base: str, run: int) -> None:
    assert (base_id(nodeid), run_number(nodeid)) == (base, run)


def _load(path: Path) -> HangReport:
    return HangReport.from_json(json.loads(path.read_text()))


@pytest.mark.parametrize(
    ("scenario", "expected"),
    [
        ("test_loading_lock_held_at_fork", "DataLoader worker in __getitem__; pytest in select"),
        (
            "test_distributed_different_collectives",
            "pytest in test_distributed_different_collectives; rank in _mismatch",
        ),
        # the Manager server waits by design: not part of the signature
        (
            "test_sharing_manager_lock_leaked",
            "multiprocessing.Process(target=_census) in _census; "
            "pytest in test_sharing_manager_lock_leaked",
        ),
        # the dead rank (a zombie) has no stuck frame; who waits for it has
        (
            "test_distributed_rank_died_before_init",
            "multiprocessing.Process(target=_rank_main) in _create_gloo_process_group; "
            "pytest in test_distributed_rank_died_before_init",
        ),
    ],
)
def test_the_signature_of_a_recorded_hang(scenario: str, expected: str) -> None:
    assert signature(_load(Path(RECORDING.parent, f"{scenario}.json"))) == expected


def test_a_report_without_stuck_frames_has_the_empty_signature() -> None:
    report = _load(RECORDED[0])
    report.processes = [p for p in report.processes if p.role.startswith("started before")]
    assert signature(report) == "no stuck frame"


# What differs between two machines (or two runs) that hit the same hang.
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


@pytest.mark.parametrize("path", RECORDED, ids=recorded_ids(RECORDED))
def test_a_signature_holds_no_pid_no_path_and_no_address(path: Path) -> None:
    report = _load(path)
    text = signature(report)
    pids = {str(p.pid) for p in report.processes} | {str(p.ppid) for p in report.processes}
    assert not pids & set(re.findall(r"\d+", text)), text
    assert "/" not in text and "\\" not in text, text
    assert not _ADDRESS.search(text), text


def _elsewhere(value: Any, moves: dict[str, str], key: str = "") -> Any:
    """``value`` as another machine would have recorded it: other pids, other directories."""
    if isinstance(value, dict):
        return {k: _elsewhere(v, moves, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_elsewhere(v, moves, key) for v in value]
    if isinstance(value, str):
        for old, new in moves.items():
            value = value.replace(old, new)
        return value
    if isinstance(value, int) and not isinstance(value, bool) and key in ("pid", "ppid", "tid"):
        return value + 40_000 if value > 0 else value
    return value


@pytest.mark.parametrize("path", RECORDED, ids=recorded_ids(RECORDED))
def test_the_same_hang_elsewhere_has_the_same_signature(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same hang in other pids, under another stdlib and another checkout: the stuck frames
    are found anew there, and the signature is the same."""
    stdlib = json.loads(RECORDING.read_text())["stdlib"]
    doc = json.loads(path.read_text())
    moves = {stdlib: "/opt/python3.99/lib/python3.99", "/tmp/": "/home/someone/checkout/"}
    here = HangReport.from_json(doc)
    there = HangReport.from_json(_elsewhere(doc, moves))
    monkeypatch.setattr(frames, "STDLIB", "/opt/python3.99/lib/python3.99")
    for proc in there.processes:
        proc.stuck_at = frames.stuck_at(proc)
    assert [p.pid for p in there.processes] != [p.pid for p in here.processes]
    assert signature(there) == signature(here)


def test_a_child_blocked_while_spawn_re_imports_signs_with_the_re_import() -> None:
    # its role's detail ("importing", or "still starting: importing" while it moves) is left
    # out; where it waits is the re-import, the same on every run and machine
    (path,) = [
        p
        for p in RECORDED
        if p.stem
        == "test_startup_spawned_loader_worker_imports_a_module_that_waits_for_the_tests_lock"
    ]
    hang = HangReport.from_json(json.loads(path.read_text()))
    (child,) = [p for p in hang.processes if p.role.startswith("multiprocessing child")]
    assert frames.stuck_at(child) == child.stuck_at  # as recorded, as the frames say today
    assert "multiprocessing child in while spawn re-imports test_corpus_startup" in signature(hang)

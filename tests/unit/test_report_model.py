"""The report model: a saved JSON report rebuilds into the report that wrote it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pytest_torchhang.report.model import SCHEMA_VERSION, SPAWNED, HangReport, Role
from pytest_torchhang.report.text import to_text

from .conftest import RECORDED, recorded_ids


def _doc(path: Path) -> dict[str, object]:
    doc: dict[str, object] = json.loads(path.read_text())
    return doc


def _without_wait_data(written: dict[str, Any], doc: dict[str, Any]) -> dict[str, Any]:
    """``written`` without the wait objects and edge kinds that ``doc``, written before waits
    were data, lacks (a reader makes them from its text: they are new, not changed, facts)."""
    out = json.loads(json.dumps(written))
    for proc, old in zip(out["processes"], doc["processes"], strict=True):
        for task, old_task in zip(proc["tasks"], old["tasks"], strict=True):
            if "wait" not in old_task:
                del task["wait"]
            for edge, old_edge in zip(task["waits_for"], old_task["waits_for"], strict=True):
                if "kind" not in old_edge:
                    del edge["kind"]
    return out  # type: ignore[no-any-return]


@pytest.mark.parametrize("path", RECORDED, ids=recorded_ids(RECORDED))
def test_a_recorded_report_survives_the_round_trip(path: Path) -> None:
    doc = _doc(path)
    report = HangReport.from_json(doc)
    written = report.to_json()
    assert _without_wait_data(written, doc) == doc
    assert all(p["role_facts"] is not None for p in written["processes"])
    again = HangReport.from_json(json.loads(json.dumps(report.to_json())))
    assert again == report
    assert again.to_json() == report.to_json()
    assert to_text(again) == to_text(report)


#: Facts of a process that documents written before them lack.
NEW_FACTS = ("role_facts", "libcuda")


@pytest.mark.parametrize("path", RECORDED, ids=recorded_ids(RECORDED))
def test_a_document_without_role_facts_has_them_read_from_its_role(path: Path) -> None:
    doc = json.loads(path.read_text())
    for proc in doc["processes"]:  # as a document written before these facts were
        for key in NEW_FACTS:
            proc.pop(key, None)
    for proc in HangReport.from_json(doc).processes:
        assert proc.role_facts is not None and proc.role_facts.text() == proc.role


def test_the_rebuilt_report_holds_typed_objects_down_to_the_wait_edges() -> None:
    report = HangReport.from_json(_doc(RECORDED[0]))
    assert report.processes and report.hints
    kinds = {type(x).__name__ for x in report.processes}
    kinds |= {type(t).__name__ for p in report.processes for t in p.threads}
    kinds |= {type(f).__name__ for p in report.processes for t in p.threads for f in t.frames}
    kinds |= {type(t).__name__ for p in report.processes for t in p.tasks}
    kinds |= {type(h).__name__ for h in report.hints}
    kinds |= {type(p.role_facts).__name__ for p in report.processes}
    assert kinds == {"ProcessReport", "ThreadStack", "Frame", "TaskWait", "Hint", "Role"}


def test_every_kind_of_nested_object_is_in_the_recordings() -> None:
    """The round trip above covers wait edges and collectives only if some recording has them."""
    reports = [HangReport.from_json(_doc(path)) for path in RECORDED]
    edges = [e for r in reports for p in r.processes for t in p.tasks for e in t.waits_for]
    collectives = [c for r in reports for p in r.processes for c in p.collectives]
    assert edges and {type(e).__name__ for e in edges} == {"WaitEdge"}
    assert collectives and {type(c).__name__ for c in collectives} == {"Collective"}
    assert any(p.exit_status for r in reports for p in r.processes)  # a zombie's facts
    assert any(r.kind == "stall" for r in reports), "no stall report recorded"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"schema": "something/else"}, "not a pytest-torchhang hang report: schema is"),
        ({"schema_version": SCHEMA_VERSION + 1}, "is newer than this pytest-torchhang reads"),
        ({"schema_version": None}, "schema_version must be a whole number, got None"),
    ],
)
def test_a_document_of_another_schema_is_refused_with_what_to_do(
    change: dict[str, object], message: str
) -> None:
    doc = {**_doc(RECORDED[0]), **change}
    with pytest.raises(ValueError, match=message):
        HangReport.from_json(doc)


def test_a_role_is_data_rendered_once_and_kept_as_data_in_the_json() -> None:
    (path,) = [p for p in RECORDED if p.stem == "test_loading_lock_held_at_fork"]
    report = HangReport.from_json(_doc(path))
    worker = next(p for p in report.processes if p.role.startswith("DataLoader worker 1/"))
    assert worker.role_facts == Role("DataLoader worker", index=1, count=2, dataset="LockedAtFork")
    again = HangReport.from_json(json.loads(json.dumps(report.to_json())))
    (same,) = [p for p in again.processes if p.pid == worker.pid]
    assert same.role_facts == worker.role_facts and same.role == worker.role
    assert Role("rank", rank=1, world=2, backend="gloo").text() == "rank 1/2 (gloo)"
    assert str(Role("rank", rank=0, world=None)) == "rank 0/?"
    assert Role("rank", rank=3, world=8, detail=SPAWNED).numbered() == (
        "rank {}/8 (torch.multiprocessing.spawn)",
        3,
    )

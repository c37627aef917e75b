"""The diagnosis rules replayed on hang reports recorded from real hangs (``record.py``).

Each recording is rebuilt with ``HangReport.from_json`` and diagnosed again, so a rule change is
checked against real evidence in milliseconds. What each scenario must be told is the labelled
corpus's own expectation (``tests/test_diagnosis_corpus.py``), scored the same way.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from test_diagnosis_corpus import LABELS, Label, _label, _score

from .conftest import RECORDED, Replay, diagnosis_digest, recorded_ids

if TYPE_CHECKING:
    from pytest_torchhang.report.model import Hint

#: Recordings from outside the corpus, with what they must be told.
OTHER_LABELS: dict[str, Label] = {
    # tests/test_stall.py: the workers of the third epoch wait for a lock held when they forked
    "test_freezes_in_its_third_epoch": _label(
        "worker_lock", "held by another thread when the workers were forked", role="DataLoader"
    ),
}


def _label_of(path: Path) -> Label:
    return {**LABELS, **OTHER_LABELS}[path.stem]


@pytest.mark.parametrize("path", RECORDED, ids=recorded_ids(RECORDED))
def test_the_rules_tell_each_recorded_hang_what_the_corpus_expects(
    path: Path, replay: Replay
) -> None:
    report = replay.load(path)
    hints = replay.hints(report)
    doc = {**report.to_json(), "hints": [asdict(h) for h in hints]}
    verdicts = _score(_label_of(path), doc)
    assert [v for v in verdicts if v[1] != "right"] == [], [h.text for h in hints]
    label = _label_of(path)
    if not label.rules and not label.facts_only:  # nothing to explain: no rule may fire
        assert [h.rule for h in hints] == ["none"]


def test_the_recordings_cover_every_rule_family() -> None:
    families = {_label_of(path).rules[0] for path in RECORDED if _label_of(path).rules}
    assert families >= {
        "stopped",
        "busy",
        "worker_lock",
        "nobody",
        "pipe",
        "sleeper",
        "deadlock",
        "openmp_after_fork",
        "queue_join",
        "manager",
        "pool_lost",
        "dead",
        "outside",
        "collectives",
        "fifo",
        "unpicklable_batch",
    }
    assert len(RECORDED) >= 15


@pytest.mark.parametrize("path", RECORDED, ids=recorded_ids(RECORDED))
def test_the_replay_gives_what_the_capture_gave(path: Path, replay: Replay) -> None:
    """While the diagnosis code is the one that recorded, the replay must reproduce the
    recorded hints and headline exactly: the recording holds everything the rules read."""
    recorded_by = replay.machine.get("digests", {}).get(path.stem, replay.machine["diagnose_sha256"])
    if recorded_by != diagnosis_digest():
        pytest.skip("the diagnosis changed since the recording: re-record to compare exactly")
    report = replay.load(path)
    assert [asdict(h) for h in replay.hints(report)] == [asdict(h) for h in report.hints]
    if report.kind == "hang":  # a stall's headline is the stall's own, made by the watchdog
        assert replay.headline(report) == report.headline


def test_the_replay_reads_no_source_file_of_this_machine(
    replay: Replay, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every source line a rule reads comes from the recording, not from this machine's disk."""
    import linecache

    read: list[str] = []

    def no_disk(filename: str, module_globals: object = None) -> list[str]:
        read.append(filename)
        return []

    monkeypatch.setattr(linecache, "updatecache", no_disk)
    for path in RECORDED:
        report = replay.load(path)
        replay.hints(report)
    assert read == []


def test_the_replay_reads_nothing_of_proc(replay: Replay, monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    opened: list[str] = []
    real_open = builtins.open

    def watched(file: object, *args: object, **kwargs: object) -> object:
        opened.append(str(file))
        return real_open(file, *args, **kwargs)  # type: ignore[call-overload]

    reports = [replay.load(path) for path in RECORDED]
    monkeypatch.setattr(builtins, "open", watched)
    for report in reports:
        replay.hints(report)
    assert [name for name in opened if name.startswith("/proc")] == []


def test_the_recordings_are_the_plugins_own_documents() -> None:
    for path in RECORDED:
        doc = json.loads(path.read_text())
        assert doc["schema"] == "pytest-torchhang/hang-report", path.name
        assert doc["test_id"].split("::")[-1] == path.stem


def _recorded_hints(name: str, replay: Replay) -> list[Hint]:
    paths = [p for p in RECORDED if p.stem == name]
    if not paths:
        pytest.skip(f"{name} is not recorded yet: run tests/unit/record.py")
    (path,) = paths
    return replay.hints(replay.load(path))


def test_a_send_and_recv_that_never_match_are_not_told_to_call_the_same_collectives(
    replay: Replay,
) -> None:
    (hint,) = _recorded_hints("test_distributed_send_and_recv_never_match", replay)
    assert "do not match" in hint.text and "same collectives" not in hint.text
    # each side's peer and tag, read from the line that calls send / recv
    assert "rank 0/2 in send (dst=1, tag=1)" in hint.text
    assert "rank 1/2 in recv (src=0, tag=2)" in hint.text


def test_a_worker_opening_a_fifo_gets_its_path_and_nobody_opening_the_other_end(
    replay: Replay,
) -> None:
    (hint,) = _recorded_hints("test_loading_worker_opens_a_fifo_nobody_writes", replay)
    assert hint.rule == "fifo"
    assert "samples.fifo for reading" in hint.text
    assert "no process of the tree has it open" in hint.text


def test_a_batch_that_cannot_be_pickled_cites_the_workers_stderr_as_evidence(
    replay: Replay,
) -> None:
    (hint,) = _recorded_hints("test_loading_batch_that_cannot_be_pickled", replay)
    assert hint.rule == "unpicklable_batch"
    assert "could not pickle the batch" in hint.text
    assert any(
        line.endswith("stderr: TypeError: cannot pickle '_thread.lock' object")
        for line in hint.based_on
    ), hint.based_on

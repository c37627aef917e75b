"""The world corpus (``corpus/``: real hangs written from public reports) replayed in the unit tier.

``bench/score_corpus.py --record tests/unit/data/world`` runs every case of
``corpus/manifest.json`` with the plugin and keeps each hang report, unedited, beside what the
diagnosis read from the recording machine's disk (``recording.json``). Here today's diagnosis
runs again on those recorded facts and is judged as the scorer judges a live run
(``bench/_judge.py``: the hint in its own words against the case's regular expressions): a
case whose hint named the cause when it was recorded must still name it, and no hint may say
that nothing can end a wait that the manifest says something could end. The manifest itself
is checked: every case file and test exists, and every expected frame is in the case's ground
truth (the stacks of its recorded report).
"""

from __future__ import annotations

import json
import linecache
import re
import sys
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from .conftest import DATA, Replay, diagnosis_digest

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "corpus"
MANIFEST: list[dict[str, Any]] = json.loads((CORPUS / "manifest.json").read_text())
WORLD = DATA / "world"
RECORDED = sorted(WORLD.glob("test_*.json"))
SCORES: dict[str, dict[str, Any]] = json.loads((WORLD / "scores.json").read_text())

sys.path.insert(0, str(ROOT / "bench"))
from _judge import (  # noqa: E402  (bench/ is no package: its helpers are found by path)
    NOTHING_CAN_END,
    defined_names,
    hints_of,
    judge_hints,
    matches,
    own_words,
    report_frames,
)

#: The cases whose hint named the cause in its own words when the corpus was recorded
#: (bench/score_corpus.py, docs/corpus.md's table): a change of the diagnosis keeps them right.
RIGHT_TODAY = {
    "test_asyncio_blocking_client_same_loop",
    "test_asyncio_executor_thread_never_returns",
    "test_asyncio_future_set_from_thread",
    "test_asyncio_lock_reentered",
    "test_asyncio_loop_thread_crashed",
    "test_asyncio_queue_consumer_task_died",
    "test_asyncio_threadsafe_from_loop",
    "test_dist_broadcast_src_mismatch",
    "test_dist_reduce_dst_mismatch",
    "test_dist_two_groups_order",
    "test_dl_log_queue_listener_not_started",
    "test_executor_max_tasks_per_child",
    "test_mp_child_nondaemon_thread",
    "test_pool_callback_waits_on_pool",
    "test_queue_join_missed_task_done",
    "test_sigchld_reaper_steals_status",
    "test_sigmask_inherited_blocks_sigterm",
    "test_signal_handler_logs_under_lock",
    "test_sigterm_flag_while_blocked",
    "test_sigterm_ignored_by_child",
    "test_subprocess_child_output_buffered",
    "test_subprocess_grandchild_keeps_pipe",
    "test_subprocess_stdin_and_stdout_full",
    "test_thread_consumer_died_queue_full",
    "test_thread_import_during_import",
    "test_threading_barrier_worker_failed",
    "test_threadpool_nested_wait",
}
FAMILIES = {
    "dataloader",
    "distributed-gloo",
    "multiprocessing",
    "pool",
    "threads",
    "subprocess",
    "signals",
    "asyncio",
}


def _case(stem: str) -> dict[str, Any]:
    (entry,) = [e for e in MANIFEST if Path(e["file"]).stem == stem]
    return entry


@pytest.fixture
def world_replay(monkeypatch: pytest.MonkeyPatch) -> Iterator[Replay]:
    """The diagnosis, made to read the world recording machine (as ``replay`` does for
    ``data/recording.json``): its stdlib directory and the source lines it read."""
    from pytest_torchhang.diagnosis import frames

    machine = json.loads((WORLD / "recording.json").read_text())
    monkeypatch.setattr(frames, "STDLIB", machine["stdlib"])
    for filename, text in machine["sources"].items():
        lines = text.splitlines(keepends=True)
        monkeypatch.setitem(linecache.cache, filename, (len(text), None, lines, filename))
    frames.enclosing_class.cache_clear()
    yield Replay(machine)
    frames.enclosing_class.cache_clear()


def _replayed_hints(path: Path, replay: Replay) -> list[tuple[str, str]]:
    report = replay.load(path)
    return [(h.rule, h.text) for h in replay.hints(report)]


def test_the_manifest_is_well_formed() -> None:
    assert len(MANIFEST) >= 35
    assert {e["family"] for e in MANIFEST} >= FAMILIES
    files = [e["file"] for e in MANIFEST]
    assert len(set(files)) == len(files), "one case per file"
    for entry in MANIFEST:
        path = CORPUS / entry["file"]
        text = path.read_text()
        for key in ("test", "sibling_test"):
            file, _, name = entry[key].partition("::")
            assert file == entry["file"] and f"\ndef {name}(" in text, (entry["file"], key)
        assert entry["root_cause"] and re.search(r"\w+/\w[\w.-]*#\d+", entry["source"])
        assert 1 <= len(entry["expected_hint_all"]) <= 3
        for rx in entry["expected_hint_all"]:
            re.compile(rx)
        assert entry["expected_frames"], entry["file"]
        assert entry["hangs_here"] is True and entry["reaches_hang_within_s"] > 0
        assert entry["example_right_hint"], entry["file"]


def test_each_case_can_be_named_in_own_words() -> None:
    """Each case's example of a right hint (``example_right_hint``) matches its regexes once the
    case's own names are removed: the scorer asks for something a hint can say."""
    for entry in MANIFEST:
        names = defined_names(CORPUS / entry["file"])
        text = own_words(entry["example_right_hint"], names)
        assert matches(text, entry["expected_hint_all"]), (entry["file"], text)


def test_no_case_accepts_the_recorded_hints_of_another() -> None:
    """The regexes are specific: today's hints of one case (none of which names another case's
    cause) do not pass as naming the cause of any other case."""
    hints = {p.stem: hints_of(json.loads(p.read_text())) for p in RECORDED}
    names = {p.stem: defined_names(CORPUS / _case(p.stem)["file"]) for p in RECORDED}
    lax = [
        (stem, other)
        for stem in hints
        for other in hints
        if other != stem
        and judge_hints(hints[other], _case(stem)["expected_hint_all"], names[other])[0]
    ]
    assert lax == []


def test_every_case_has_its_recorded_report() -> None:
    assert {p.stem for p in RECORDED} == {Path(e["file"]).stem for e in MANIFEST}
    assert set(SCORES) == {p.stem for p in RECORDED}


@pytest.mark.parametrize("path", RECORDED, ids=[p.stem.removeprefix("test_") for p in RECORDED])
def test_every_expected_frame_is_in_the_ground_truth(path: Path) -> None:
    shown = report_frames(json.loads(path.read_text()))
    missing = [f for f in _case(path.stem)["expected_frames"] if f not in shown]
    assert missing == [], sorted(shown)


def test_the_right_today_table_is_what_the_recording_scored() -> None:
    assert {name for name, s in SCORES.items() if s["hint_right"]} == RIGHT_TODAY


@pytest.mark.parametrize("path", RECORDED, ids=[p.stem.removeprefix("test_") for p in RECORDED])
def test_a_case_right_today_stays_right(path: Path, world_replay: Replay) -> None:
    entry = _case(path.stem)
    names = defined_names(CORPUS / entry["file"])
    hints = _replayed_hints(path, world_replay)
    right, _ = judge_hints(hints, entry["expected_hint_all"], names)
    if path.stem in RIGHT_TODAY:
        assert right, [text for _, text in hints]
    # what the recording's own hints scored is what the scorer reported for the live run
    recorded, _ = judge_hints(
        hints_of(json.loads(path.read_text())), entry["expected_hint_all"], names
    )
    assert recorded == SCORES[path.stem]["hint_right"]


@pytest.mark.parametrize(
    "path",
    [p for p in RECORDED if _case(p.stem).get("could_end_wait")],
    ids=lambda p: p.stem.removeprefix("test_"),
)
def test_no_hint_says_nothing_can_end_a_wait_that_something_could_end(
    path: Path, world_replay: Replay
) -> None:
    texts = [text for _, text in _replayed_hints(path, world_replay)]
    assert not [t for t in texts if NOTHING_CAN_END in t], _case(path.stem)["could_end_wait"]


@pytest.mark.parametrize("path", RECORDED, ids=[p.stem.removeprefix("test_") for p in RECORDED])
def test_the_replay_gives_what_the_capture_gave(path: Path, world_replay: Replay) -> None:
    """While the diagnosis is the code that recorded, the replay reproduces the recorded hints:
    the recording holds everything the rules read."""
    if world_replay.machine["diagnose_sha256"] != diagnosis_digest():
        pytest.skip("the diagnosis changed since the recording: re-record to compare exactly")
    report = world_replay.load(path)
    assert [asdict(h) for h in world_replay.hints(report)] == [asdict(h) for h in report.hints]


#: Words of the confidently wrong hints issue 28 (item 6) found on this corpus: a fork story on
#: hangs with no fork, the test's own server called no process of the test, a collective called
#: skipped when the ranks are in the same one with different arguments.
WRONG_TODAY = {
    "test_threadpool_nested_wait": "not copied by fork",
    "test_asyncio_threadsafe_from_loop": "not copied by fork",
    "test_asyncio_loop_thread_crashed": "not copied by fork",
    "test_asyncio_blocking_client_same_loop": "no process of this test",
    "test_dist_reduce_dst_mismatch": "rank-dependent branch",
}


@pytest.mark.parametrize("stem", sorted(WRONG_TODAY), ids=lambda s: s.removeprefix("test_"))
def test_no_hint_repeats_a_confidently_wrong_cause(stem: str, world_replay: Replay) -> None:
    texts = [text for _, text in _replayed_hints(WORLD / f"{stem}.json", world_replay)]
    assert not [t for t in texts if WRONG_TODAY[stem] in t], texts


def test_no_fork_story_without_a_fork(world_replay: Replay) -> None:
    """No case of this corpus waits for a Future made before a fork: no hint may say so."""
    for path in RECORDED:
        texts = [text for _, text in _replayed_hints(path, world_replay)]
        assert not [t for t in texts if "copied by fork" in t], path.stem


def _waits(stem: str, replay: Replay, rule: str) -> list[Any]:
    report = replay.load(WORLD / f"{stem}.json")
    (hint,) = [h for h in replay.hints(report) if h.rule == rule]
    return hint.waits


def test_the_nobody_rule_states_both_ends_as_data(world_replay: Replay) -> None:
    """The thread joined is none of the living ones; the ones that could end the wait are
    named with where they wait (the Barrier), as data and in the text rendered from it."""
    (facts,) = _waits("test_threading_barrier_worker_failed", world_replay, "nobody")
    assert facts.waits_in.startswith("Thread.join()")
    ends = {e.thread: (e.state, e.where) for e in facts.ends}
    assert ends["loader-a"][0] == "waits" and ends["loader-a"][1].startswith(
        "waits in Barrier.wait()"
    )
    assert ends["loader-c"][0] == "waits"
    assert "Thread-1 (run_server)" not in ends  # an earlier test's thread ends none of its waits
    assert any("Barrier.wait() ends when every party arrives" in k for k in facts.known)


def test_the_fallback_states_what_the_other_end_is_doing(world_replay: Replay) -> None:
    """No rule matched: the child the test joins is named, exiting, with the non-daemon thread
    it waits for; a pool worker that ended says its uncaught exception (its traceback's), and
    one caught alive in the initializer where it waits."""
    (facts,) = _waits("test_mp_child_nondaemon_thread", world_replay, "none")
    (child,) = facts.ends
    assert child.state == "exiting" and "non-daemon threads" in child.where
    every = _waits("test_pool_initializer_raises", world_replay, "none")
    facts = every[0]
    gone = [e for e in facts.ends if e.state == "exited"]
    # the Pool replaces its dead workers: the capture finds them gone, or in the initializer
    if gone:
        assert "FileNotFoundError" in gone[0].last_lines[-1]
        assert gone[0].exception.startswith("FileNotFoundError")
        assert gone[0].called_by.endswith("as initializer")
    else:
        assert any(f.waits_in.startswith("time.sleep() at") for f in every[1:])


def test_the_waits_survive_the_json_round_trip(world_replay: Replay) -> None:
    from pytest_torchhang.report.model import HangReport

    report = world_replay.load(WORLD / "test_threading_barrier_worker_failed.json")
    report.hints = world_replay.hints(report)
    again = HangReport.from_json(json.loads(json.dumps(report.to_json())))
    assert again.hints == report.hints and again.hints[0].waits

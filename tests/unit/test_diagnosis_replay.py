"""The diagnosis rules replayed on hang reports recorded from real hangs (``record.py``).

Each recording is rebuilt with ``HangReport.from_json`` and diagnosed again, so a rule change is
checked against real evidence in milliseconds. What each scenario must be told is the labelled
corpus's own expectation (``tests/test_diagnosis_corpus.py``), scored the same way.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from test_diagnosis_corpus import LABELS, Label, _label, _score

from .conftest import RECORDED, Replay, diagnosis_digest, recorded_ids

if TYPE_CHECKING:
    from pytest_torchhang.report.model import HangReport, Hint, ProcessReport, TaskWait

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
        "leaked_slots",
        "end_marker",
        "full_pipe",
        "poll_dead",
        "no_answer",
        "import_lock_at_fork",
        "join_cycle",
    }
    assert len(RECORDED) >= 15


@pytest.mark.parametrize("path", RECORDED, ids=recorded_ids(RECORDED))
def test_the_replay_gives_what_the_capture_gave(path: Path, replay: Replay) -> None:
    """While the diagnosis code is the one that recorded, the replay must reproduce the
    recorded hints and headline exactly: the recording holds everything the rules read."""
    recorded_by = replay.machine.get("digests", {}).get(
        path.stem, replay.machine["diagnose_sha256"]
    )
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


# --- classes of wait, named in the user's words (tests/corpus/corpus_waits.py) ---


def _one(name: str, rule: str, replay: Replay) -> Hint:
    hints = [h for h in _recorded_hints(name, replay) if h.rule == rule]
    assert len(hints) == 1, [h.rule for h in _recorded_hints(name, replay)]
    return hints[0]


def test_leaked_multiprocessing_semaphore_slots_are_named_with_the_count_read_from_it(
    replay: Replay,
) -> None:
    hint = _one("test_waits_semaphore_slots_leak_on_an_early_return", "leaked_slots", replay)
    assert "slots.acquire()" in hint.text and "Lock.acquire()" not in hint.text
    assert "multiprocessing semaphore" in hint.text
    assert "its count is 0 (read from the semaphore)" in hint.text
    assert "created (by its name) as a BoundedSemaphore at test_corpus_waits.py:" in hint.text
    assert "`slots = FORK.BoundedSemaphore(2)`" in hint.text
    assert "holds no acquire of it" in hint.text and "`with slots:`" in hint.text


def test_leaked_threading_semaphore_slots_are_named_from_the_threads_that_wait(
    replay: Replay,
) -> None:
    hint = _one(
        "test_waits_threading_semaphore_slots_leak_on_an_early_return", "leaked_slots", replay
    )
    assert "threading Semaphore or BoundedSemaphore" in hint.text
    assert "`slots = threading.BoundedSemaphore(2)`" in hint.text
    assert "its count is 0" in hint.text and "slots leaked" in hint.text


def test_the_wait_objects_of_a_new_recording_are_data(replay: Replay) -> None:
    from pytest_torchhang.report.waits import HOLDS_READ_END, MAPS, Pipe, Semaphore, Socket

    def tasks(name: str) -> list[TaskWait]:
        (path,) = [p for p in RECORDED if p.stem == name]
        return [t for p in replay.load(path).processes for t in p.tasks]

    sems = [
        t.wait
        for t in tasks("test_waits_semaphore_slots_leak_on_an_early_return")
        if isinstance(t.wait, Semaphore)
    ]
    assert sems and all(s.value == 0 for s in sems)
    writer = next(
        t for t in tasks("test_waits_popen_wait_with_a_full_stderr_pipe") if t.call == "write"
    )
    assert isinstance(writer.wait, Pipe) and writer.wait.fd == 2
    assert [e.kind for e in writer.waits_for] == [HOLDS_READ_END]
    sockets = [
        t.wait
        for t in tasks("test_waits_recv_from_a_server_that_accepted_and_never_answers")
        if isinstance(t.wait, Socket)
    ]
    client = next(s for s in sockets if s.remote)
    assert any(s.listening and s.local == client.remote for s in sockets)
    leaked = tasks("test_waits_semaphore_slots_leak_on_an_early_return")
    assert any(e.kind == MAPS for t in leaked for e in t.waits_for)


def test_one_end_marker_for_two_consumers_names_the_marker_and_the_empty_queue(
    replay: Replay,
) -> None:
    hint = _one("test_waits_one_end_marker_for_two_consumers", "end_marker", replay)
    assert "`if item is None:`" in hint.text and "the queue is empty" in hint.text
    assert "put one marker per consumer" in hint.text


def test_a_child_on_a_full_pipe_is_told_to_be_read_with_communicate(replay: Replay) -> None:
    for name, stream in (
        ("test_sharing_popen_wait_with_a_full_stdout_pipe", "stdout"),
        ("test_waits_popen_wait_with_a_full_stderr_pipe", "stderr"),
    ):
        hint = _one(name, "full_pipe", replay)
        assert f"blocked writing to its {stream}" in hint.text
        assert "wchan anon_pipe_write" in hint.text and "Popen.wait()" in hint.text
        assert "communicate()" in hint.text
    (hint,) = [
        h
        for h in _recorded_hints("test_waits_popen_wait_with_a_full_stderr_pipe", replay)
        if h.rule != "none"
    ]  # the graph's deadlock is not said beside it


def test_a_poll_loop_is_joined_with_the_producer_that_exited(replay: Replay) -> None:
    for name, polled, line in (
        (
            "test_waits_spins_for_a_file_a_failed_producer_never_writes",
            "a file's existence",
            "os.path.exists(flag)",
        ),
        (
            "test_waits_spins_on_a_shared_value_a_failed_producer_never_sets",
            "a shared Value",
            "counter.value < 2",
        ),
    ):
        hints = _recorded_hints(name, replay)
        hint = _one(name, "poll_dead", replay)
        assert f"polls {polled}" in hint.text and line in hint.text
        assert "exited with code 1" in hint.text
        assert "busy" not in [h.rule for h in hints]  # not told apart as "computing"
    hint = _one("test_waits_spins_for_a_file_a_failed_producer_never_writes", "poll_dead", replay)
    assert "ValueError: no data to write" in hint.text


def test_a_read_from_a_server_that_never_answers_names_the_server_and_the_missing_timeout(
    replay: Replay,
) -> None:
    name = "test_waits_recv_from_a_server_that_accepted_and_never_answers"
    hint = _one(name, "no_answer", replay)
    (path,) = [p for p in RECORDED if p.stem == name]
    report = replay.load(path)
    client = next(
        t.wait
        for p in report.processes
        for t in p.tasks
        if t.call == "recvfrom" and t.wait is not None
    )
    assert f"the server at {client.remote}" in hint.text  # type: ignore[union-attr]
    assert "accepted the connection and never answered" in hint.text
    assert "with no timeout" in hint.text and "settimeout" in hint.text
    assert "target=_service" in hint.text and "accept" in hint.text


def test_a_fork_child_on_an_import_lock_is_not_told_it_is_still_starting(
    replay: Replay,
) -> None:
    name = "test_waits_fork_child_imports_a_module_a_parent_thread_was_importing"
    hints = _recorded_hints(name, replay)
    assert [h.rule for h in hints] == ["import_lock_at_fork"]
    (hint,) = hints
    assert "`import torchhang_corpus_slow_module`" in hint.text
    # the thread's number is how many threads that session had started before it
    assert re.search(r"thread 'Thread-\d+ \(_import_the_slow_module\)' of pytest", hint.text)
    assert "before the workers start" in hint.text and "spawn" in hint.text


def test_a_chain_of_joins_is_named_to_its_end_with_the_sentinel_sent_after_the_join(
    replay: Replay,
) -> None:
    for name, sent in (
        ("test_waits_join_chain_to_a_sentinel_sent_after_the_join", "`queue.put(None)`"),
        ("test_sharing_join_chain_back_to_the_test", '`os.write(write_fd, b"x")`'),
    ):
        hint = _one(name, "join_cycle", replay)
        assert "a cycle of waits through 3 processes: pytest" in hint.text
        assert hint.text.count(" -> ") == 2 and len(hint.pids) == 3
        assert "sends it only after its join: line" in hint.text and sent in hint.text


def test_a_semaphore_the_test_holds_across_its_join_is_not_called_leaked(replay: Replay) -> None:
    name = "test_waits_semaphore_held_by_the_test_while_it_joins"
    hints = _recorded_hints(name, replay)
    assert "leaked_slots" not in [h.rule for h in hints]
    hint = _one(name, "join_cycle", replay)
    assert "holds it across its join: line" in hint.text and "`with slots:`" in hint.text


# --- inside multiprocessing's start-up (tests/corpus/corpus_startup.py) ---

#: Children blocked while spawn imports a module again: (the recording, the module).
BLOCKED_AT_IMPORT = {
    "test_startup_spawned_loader_worker_imports_a_module_that_waits_for_the_tests_lock": (
        "test_corpus_startup"
    ),
    "test_startup_pool_replaces_a_worker_that_waits_for_the_tests_lock": "test_corpus_startup",
    # a script's own spawned child runs its top level again (runpy): no importlib frame
    "test_startup_spawned_child_of_a_script_runs_its_top_level_that_waits_for_its_lock": "train",
}


def _blocked_child(report: HangReport) -> ProcessReport:
    (child,) = [p for p in report.processes if p.role.startswith("multiprocessing child")]
    return child


@pytest.mark.parametrize("name", list(BLOCKED_AT_IMPORT))
def test_a_child_blocked_in_its_import_is_not_told_it_is_still_starting(
    name: str, replay: Replay
) -> None:
    from pytest_torchhang.diagnosis import engine
    from pytest_torchhang.diagnosis.frames import importing, stuck_at
    from pytest_torchhang.diagnosis.roles import making_progress
    from pytest_torchhang.report.text import to_text

    (path,) = [p for p in RECORDED if p.stem == name]
    report = replay.load(path)
    child = _blocked_child(report)
    assert importing(child) and not making_progress(child)  # importing, and blocked there
    assert child.role == "multiprocessing child (importing)"
    assert stuck_at(child) == f"while spawn re-imports {BLOCKED_AT_IMPORT[name]}"
    hints = replay.hints(report)
    assert [h.rule for h in hints] == ["deadlock"]
    for text in [h.text for h in hints] + [to_text(report)]:
        assert "still starting" not in text and "Raise the timeout" not in text
    (hint,) = hints
    assert "fcntl.flock(" in hint.text and child.pid in hint.pids
    if child.pid in report.culprits:  # a script's own wait at its join is named first
        assert replay.headline(report).endswith(
            f"1 stuck in multiprocessing child while spawn re-imports {BLOCKED_AT_IMPORT[name]}"
        )
    # the child as the headline's root (its own process named): "stuck while spawn re-imports"
    alone = engine.headline("t", 1.0, [child], child.pid)
    assert alone.endswith(f"1 process, stuck while spawn re-imports {BLOCKED_AT_IMPORT[name]}")


#: What a process importing at the deadline does, and whether it is still starting up: the
#: facts of the recorded blocked child with its CPU and its main thread's state set to each.
PROGRESS = [
    # cpu during the capture, process state, main thread's state and call, edges kept
    ((0.0, "sleeping", "S", "flock", True), False),  # as recorded: blocked on its parent's lock
    ((0.0, "sleeping", "S", "futex", False), False),  # a lock with no edge is still a wait
    ((0.0, "sleeping", "S", "clock_nanosleep", False), False),
    ((0.3, "sleeping", "S", "read", False), True),  # it used CPU during the capture
    ((0.0, "running", "R", "running", False), True),
    ((0.0, "disk-sleep", "D", "read", False), True),  # reading a module's file from disk
    ((0.0, "disk-sleep", "D", "flock", True), False),  # in D, but for another process
]


@pytest.mark.parametrize(("facts", "starting"), PROGRESS, ids=[str(p[0]) for p in PROGRESS])
def test_still_starting_is_said_only_of_a_process_that_moves_through_its_imports(
    facts: tuple[float, str, str, str, bool], starting: bool, replay: Replay
) -> None:
    from pytest_torchhang.diagnosis.roles import making_progress
    from pytest_torchhang.diagnosis.rules.starting import hint_still_starting

    (path,) = [p for p in RECORDED if p.stem == next(iter(BLOCKED_AT_IMPORT))]
    report = replay.load(path)
    child = _blocked_child(report)
    cpu, state, task_state, call, edges = facts
    child.cpu_delta_s, child.state = cpu, state
    child.motion = None  # the second look's verdict would overrule the facts set here
    child.cpu_s = 0.1  # far below its age: not "mostly running" on its own account
    for task in child.tasks:
        task.state, task.call = task_state, call
        task.waits_for = task.waits_for if edges else []
    assert making_progress(child) is starting
    said = [h for h in hint_still_starting(replay.diagnosed(report)) if child.pid in h.pids]
    assert bool(said) is starting
    if said:
        assert "still starting up" in said[0].text and "Raise the timeout" in said[0].text

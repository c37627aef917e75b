"""Waits a signal or an alarm would still end, an idle server beside a hang, a child with no
stack: replayed from real hangs (``tests/corpus/corpus_signals.py``), and the pure pieces (the
masks, the dispositions) by tables."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from .conftest import RECORDED, Replay

if TYPE_CHECKING:
    from pytest_torchhang.report.model import HangReport

SIGNALS = [p for p in RECORDED if p.stem.startswith("test_signals_")]


def _replayed(path: Path, replay: Replay) -> tuple[HangReport, str, list[int], str]:
    """The report, and the headline, culprits and cause the diagnosis gives it today."""
    from pytest_torchhang.diagnosis import engine

    report = replay.load(path)
    processes = replay.diagnosed(report)
    (root,) = [p for p in processes if p.role_facts and p.role_facts.kind == "pytest"]
    found = engine.hints(processes)
    report.hints = found
    culprits = engine.culprits(processes, root.pid, found)
    return report, replay.headline(report), culprits, engine.cause(found, processes, root.pid)


def test_the_seven_situations_are_recorded() -> None:
    assert len(SIGNALS) == 7, [p.stem for p in SIGNALS]


@pytest.mark.parametrize("path", SIGNALS, ids=[p.stem for p in SIGNALS])
def test_headline_culprits_and_cause_tell_one_story_and_never_say_nothing_can_end(
    path: Path, replay: Replay
) -> None:
    report, headline, culprits, cause = _replayed(path, replay)
    (first,) = [h for h in report.hints if h.text == cause]
    assert set(culprits) <= set(first.pids), (culprits, first.pids)
    roles = {p.pid: p for p in report.processes}
    for pid in culprits:
        proc = roles[pid]
        if proc.role_facts and proc.role_facts.kind == "pytest":
            assert headline.endswith(f"stuck in {proc.stuck_at}"), headline
        else:
            assert f"(pid {pid})" in headline or proc.stuck_at in headline, headline
    for hint in report.hints:
        assert "nothing can end" not in hint.text
        assert "waits in ," not in hint.text and "waits in  " not in hint.text


def _story(name: str, replay: Replay) -> tuple[str, str, list[int], HangReport]:
    (path,) = [p for p in SIGNALS if p.stem == name]
    report, headline, culprits, cause = _replayed(path, replay)
    return cause, headline, culprits, report


def test_a_worker_with_a_sigterm_handler_is_told_nobody_sends_it(replay: Replay) -> None:
    cause, _, culprits, report = _story(
        "test_signals_worker_ended_by_sigterm_joined_without_terminate", replay
    )
    assert "a SIGTERM would run its Python handler (a lambda in _serve_until_terminated)" in cause
    assert "but nobody sends one: pytest (pid" in cause
    assert "in Process.join() at test_corpus_signals.py:" in cause
    assert "no terminate() before it" in cause
    # the fork sentence is a condition now: the Event was the worker's own
    assert "if what it waits for was made before the fork" in cause
    (worker,) = [p for p in report.processes if p.pid in culprits]
    assert worker.signals is not None and "SIGTERM" in worker.signals.caught


def test_a_test_under_its_own_alarm_is_told_when_the_alarm_ends_the_wait(replay: Replay) -> None:
    cause, headline, _, report = _story(
        "test_signals_test_under_its_own_alarm_hangs_on_a_lock", replay
    )
    assert "its own alarm (signal.alarm or setitimer) is due in 2" in cause  # 30 s - 3 s
    assert "its Python handler _expire() in the main thread" in cause
    (pytest_proc,) = [p for p in report.processes if p.role == "pytest"]
    assert pytest_proc.signals is not None and pytest_proc.signals.handlers == {
        "SIGALRM": "_expire"
    }
    assert headline.endswith("stuck in test_signals_test_under_its_own_alarm_hangs_on_a_lock")


def test_an_idle_http_server_is_a_helper_not_the_culprit(replay: Replay) -> None:
    from pytest_torchhang.report import groups

    cause, headline, culprits, report = _story(
        "test_signals_idle_http_server_beside_a_test_deadlocked_on_its_lock", replay
    )
    (server,) = [p for p in report.processes if "_serve_http" in p.role]
    assert groups.idle_service(server)
    assert culprits == [p.pid for p in report.processes if p.role == "pytest"]
    assert "_serve_http" not in headline and "Lock.acquire()" in cause
    # in the text, the server comes after the test, with the helpers
    order = [g.pids for g in groups.group_processes(report.processes, culprits)]
    assert order.index([server.pid]) > order.index(culprits)


def test_an_idle_http_server_thread_is_no_thread_that_would_release_the_lock(
    replay: Replay,
) -> None:
    cause, headline, culprits, report = _story(
        "test_signals_idle_http_server_thread_beside_a_test_deadlocked_on_its_lock", replay
    )
    assert culprits == [p.pid for p in report.processes if p.role == "pytest"]
    assert "waits in Lock.acquire() at test_corpus_signals.py:" in cause
    assert "idle services that only wait for work (thread 'http-server' in serve_forever" in cause
    assert "no process of the test is connecting" in cause
    assert headline.endswith("stuck in " + report.test_id.split("::")[-1])


@pytest.mark.parametrize("kind", ["process", "thread"])
def test_an_executors_idle_workers_are_helpers_not_the_story(kind: str, replay: Replay) -> None:
    from pytest_torchhang.report import groups

    cause, headline, culprits, report = _story(
        f"test_signals_idle_{kind}_pool_beside_a_test_deadlocked_on_its_lock", replay
    )
    (root,) = [p.pid for p in report.processes if p.role == "pytest"]
    assert culprits == [root] and headline.endswith("stuck in " + report.test_id.split("::")[-1])
    assert "waits in Lock.acquire() at test_corpus_signals.py:" in cause
    assert "idle services that only wait for work" in cause
    workers = [p for p in report.processes if "_process_worker" in p.role]
    assert len(workers) == (2 if kind == "process" else 0)
    assert all(groups.idle_service(w) for w in workers)
    # no hint tells the workers' wait for a task as a pipe nobody writes, or as a deadlock
    assert [h.rule for h in report.hints] == ["nobody"]


def test_a_child_without_a_stack_is_told_by_what_the_kernel_shows(replay: Replay) -> None:
    cause, _, _, _ = _story(
        "test_signals_setsid_daemon_child_with_closed_descriptors_reads_forever", replay
    )
    assert "waits in the system call read(fd " in cause and "[anon_pipe_read]" in cause
    assert "no Python stack: the process closed or replaced its dump file" in cause
    assert "a SIGTERM (what terminate() sends) would end it by its default action" in cause


def test_the_masks_of_proc_status_are_read_by_name(tmp_path: Path) -> None:
    from pytest_torchhang.capture import procfs
    from pytest_torchhang.capture.signals import masks

    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "status").write_text(
        "Name:\tpython\nSigBlk:\t0000000000000000\nSigIgn:\t0000000001001000\n"
        "SigCgt:\t0000000180004002\n"
    )
    facts = masks(procfs.ProcReader(root=str(tmp_path)), 7)
    assert facts is not None
    assert facts.caught == ["SIGINT", "SIGTERM"] and facts.blocked == []
    assert facts.ignored == ["SIGPIPE", "SIGXFSZ"]
    assert masks(procfs.ProcReader(root=str(tmp_path)), 8) is None


@pytest.mark.parametrize(
    ("caught", "blocked", "ignored", "handlers", "expected", "ends"),
    [
        ([], [], [], None, "default", True),
        (["SIGTERM"], [], [], {"SIGTERM": "stop"}, "handler stop", True),
        (["SIGTERM"], [], [], None, "handler", True),  # caught, no answer: not known as Python's
        ([], [], ["SIGTERM"], {}, "ignored", False),
        ([], ["SIGTERM"], [], {}, "blocked", False),
        (["SIGTERM"], ["SIGTERM"], [], {"SIGTERM": "stop"}, "blocked", False),
    ],
)
def test_what_sigterm_would_do(
    caught: list[str],
    blocked: list[str],
    ignored: list[str],
    handlers: dict[str, str] | None,
    expected: str,
    ends: bool,
) -> None:
    from pytest_torchhang.report.signals import SignalFacts

    facts = SignalFacts(caught, blocked, ignored, handlers)
    assert facts.disposition("SIGTERM") == expected
    assert facts.ends_on("SIGTERM") is ends


def test_signal_facts_survive_the_json_document(replay: Replay) -> None:
    from pytest_torchhang.report.model import HangReport

    for path in SIGNALS:
        report = replay.load(path)
        again = HangReport.from_json(report.to_json())
        assert [p.signals for p in again.processes] == [p.signals for p in report.processes]
        assert any(p.signals is not None for p in report.processes)


@pytest.mark.parametrize(
    ("facts", "expected"),
    [
        (
            {"ignored": ["SIGTERM"], "handlers": {}},
            "SIGTERM is ignored there: terminate() would not end it (kill() would)",
        ),
        (
            {"blocked": ["SIGTERM"], "handlers": {}},
            "SIGTERM is blocked there: terminate() would not end it (kill() would)",
        ),
        (
            {"handlers": {}, "alarm_s": 5.0},
            "its own alarm (signal.alarm or setitimer) is due in 5.0s, and SIGALRM's default "
            "action will end the process",
        ),
        (
            {"ignored": ["SIGALRM"], "handlers": {}, "alarm_s": 5.0},
            "but SIGALRM is ignored there: it will not end the wait",
        ),
        ({"caught": ["SIGUSR1"], "handlers": {"SIGUSR1": "dump"}}, "a SIGUSR1 would run its "),
    ],
)
def test_what_the_joined_worker_would_be_told_under_other_dispositions(
    facts: dict[str, object], expected: str, replay: Replay
) -> None:
    """The recorded worker's wait, its signal facts varied: each disposition in its words."""
    from pytest_torchhang.diagnosis.rules.enders import clauses
    from pytest_torchhang.report.signals import from_json

    (path,) = [p for p in SIGNALS if "sigterm" in p.stem]
    processes = replay.diagnosed(replay.load(path))
    (worker,) = [p for p in processes if "_serve_until_terminated" in p.role]
    worker.signals = from_json(facts)
    assert any(expected in clause for clause in clauses(worker, processes, nobody=True)), clauses(
        worker, processes, nobody=True
    )

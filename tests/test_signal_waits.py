"""Waits a signal would still end, an idle server beside a hang, a child with no stack: the report
tells one story (headline, culprits and cause name the same processes) and never says "nothing
can end that wait" of a wait that a SIGTERM, the test's own alarm or ``terminate()`` would end.

A real session of the scenarios of ``tests/corpus/corpus_signals.py``: a worker with a SIGTERM
handler joined without ``terminate()``, a test under its own ``signal.alarm(30)`` guard, an idle
HTTP server (a process, and a thread of the test's own process) and an executor's idle workers
(processes, threads) beside a test deadlocked on its own lock, a setsid'd daemon child with its
descriptors closed. No torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from conftest import GuardedRunner
from outcomes import assert_outcomes

CORPUS = Path(__file__).parent / "corpus" / "corpus_signals.py"
TIMEOUT_S = 3.0


def _reports(folder: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for path in sorted(folder.glob("*.json")):
        doc = json.loads(path.read_text())
        out[doc["test_id"].split("::")[-1]] = doc
    return out


def _one_story(doc: dict[str, Any]) -> None:
    """Headline, culprits and cause agree; no hint says what its evidence does not show."""
    procs = {p["pid"]: p for p in doc["processes"]}
    culprits = doc["culprits"]
    hints = [h for h in doc["hints"] if h["rule"] != "none"]
    if hints:
        (cause,) = [h for h in hints if h["text"] == doc["cause"]]
        assert set(culprits) <= set(cause["pids"]), (culprits, cause)
    for pid in culprits:
        proc = procs[pid]
        if proc["role"] == "pytest":
            assert doc["headline"].endswith(f"stuck in {proc['stuck_at']}"), doc["headline"]
        else:
            assert f"(pid {pid})" in doc["headline"] or proc["stuck_at"] in doc["headline"]
    for hint in doc["hints"]:
        assert "nothing can end" not in hint["text"], hint["text"]
        assert "waits in ," not in hint["text"], hint["text"]


def test_waits_a_signal_would_end_are_told_so_and_an_idle_server_is_no_culprit(
    guarded: GuardedRunner,
) -> None:
    guarded.pytester.makepyfile(test_corpus_signals=CORPUS.read_text())
    reports = guarded.pytester.path / "reports"
    session = guarded.run(f"--torch-hang-report-dir={reports}", timeout=TIMEOUT_S, wait_s=240)
    assert_outcomes(session.result, hang=7)
    docs = _reports(reports)
    assert len(docs) == 7, sorted(docs)
    for doc in docs.values():
        _one_story(doc)

    worker = docs["test_signals_worker_ended_by_sigterm_joined_without_terminate"]
    assert "_serve_until_terminated" in worker["headline"]
    assert (
        "a SIGTERM would run its Python handler (a lambda in _serve_until_terminated)"
        in (worker["cause"])
    )
    assert "but nobody sends one: pytest (pid" in worker["cause"]
    assert "no terminate() before it" in worker["cause"]

    alarm = docs["test_signals_test_under_its_own_alarm_hangs_on_a_lock"]
    assert "Lock.acquire()" in alarm["cause"]
    assert "its own alarm (signal.alarm or setitimer) is due in 2" in alarm["cause"]
    assert "will run its Python handler _expire() in the main thread" in alarm["cause"]

    server = docs["test_signals_idle_http_server_beside_a_test_deadlocked_on_its_lock"]
    (root,) = [p["pid"] for p in server["processes"] if p["role"] == "pytest"]
    assert server["culprits"] == [root], server["headline"]
    assert "_serve_http" not in server["headline"] and "Lock.acquire()" in server["cause"]

    thread = docs["test_signals_idle_http_server_thread_beside_a_test_deadlocked_on_its_lock"]
    assert thread["culprits"] == [p["pid"] for p in thread["processes"] if p["role"] == "pytest"]
    assert (
        "idle services that only wait for work (thread 'http-server' in serve_forever"
        in (thread["cause"])
    )

    for kind in ("process", "thread"):
        pool = docs[f"test_signals_idle_{kind}_pool_beside_a_test_deadlocked_on_its_lock"]
        assert pool["culprits"] == [p["pid"] for p in pool["processes"] if p["role"] == "pytest"]
        assert [h["rule"] for h in pool["hints"]] == ["nobody"], pool["hints"]
        assert "idle services that only wait for work" in pool["cause"]

    daemon = docs["test_signals_setsid_daemon_child_with_closed_descriptors_reads_forever"]
    assert "waits in the system call read(fd " in daemon["cause"]
    assert "no Python stack: the process closed or replaced its dump file" in daemon["cause"]
    assert (
        "a SIGTERM (what terminate() sends) would end it by its default action" in daemon["cause"]
    )

    # the guard's alarm was cancelled by the test's finally once the hang was raised: no later
    # test of the session was hit by it, and nothing is left running (the daemon included)
    assert "_GuardExpired" not in session.text
    session.assert_clean()

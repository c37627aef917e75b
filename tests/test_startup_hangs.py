"""Hangs inside multiprocessing's start-up, end to end: a spawned DataLoader worker and a Pool's
replacement worker blocked while spawn imports the test module again, and a Pool worker forked by
the pool's maintenance thread with a lock held. The start-up frames are the evidence there: the
report shows them, names the re-import in its headline, and never calls a blocked process "still
starting up" (issue 32)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from conftest import GuardedRunner, assert_hang
from outcomes import assert_outcomes

#: The scenarios, shared with the labelled corpus (tests/test_diagnosis_corpus.py) and the
#: recordings of the unit tier (tests/unit/record.py).
SCENARIOS = (Path(__file__).parent / "corpus" / "corpus_startup.py").read_text()
LOADER = "test_startup_spawned_loader_worker_imports_a_module_that_waits_for_the_tests_lock"
SPAWN_POOL = "test_startup_pool_replaces_a_worker_that_waits_for_the_tests_lock"
FORK_POOL = "test_startup_pool_forks_a_replacement_while_the_test_holds_a_lock"
SCRIPT = "test_startup_spawned_child_of_a_script_runs_its_top_level_that_waits_for_its_lock"
EXECUTOR = "test_startup_executor_worker_initializer_waits_for_the_tests_lock"
#: The frames of a spawned child blocked at the import of the test module, innermost first.
REIMPORT_FRAMES = [
    '*File "*test_startup.py", line *, in <module>',
    "*fcntl.flock(_cache, fcntl.LOCK_SH)*",
    '*File "<frozen importlib._bootstrap>", line *, in _find_and_load',
    '*File "*multiprocessing/spawn.py", line *, in _main',
    "*self = reduction.pickle.load(from_parent)",
    '*File "*multiprocessing/spawn.py", line *, in spawn_main',
]


def _child_block(report: str) -> str:
    """The block of the first process of the report: the one its headline names."""
    start = report.index("\n--- process ")
    return report[start : report.index("\n--- process ", start + 1)]


def _assert_not_starting(report: str) -> None:
    assert "still starting" not in report, report[:3000]
    assert "Raise the timeout" not in report and "raise the timeout" not in report


@pytest.mark.needs_torch
@pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="needs torch, which is not installed"
)
def test_blocked_start_ups_show_their_start_up_frames_and_are_not_called_starting(
    guarded: GuardedRunner,
) -> None:
    guarded.pytester.makepyfile(test_startup=SCENARIOS)
    # each scenario sets its own deadline (a spawned DataLoader worker imports torch first)
    session = guarded.run(timeout=3, wait_s=300)
    assert_outcomes(session.result, hang=5)

    # (a) the spawned DataLoader worker, blocked importing the test module on the test's lock
    report = assert_hang(
        session,
        LOADER,
        "HANG after *: * processes, 1 stuck in multiprocessing child while spawn re-imports "
        "test_startup",
        *REIMPORT_FRAMES,
        "*hint: deadlock:*fcntl.flock(_cache, fcntl.LOCK_SH)*",
    )
    _assert_not_starting(report)
    assert "start-up frames cut" not in _child_block(report)

    # (b) a spawn Pool: its maintenance thread starts a replacement, which blocks importing the
    # test module; the thread waits for it to read its initargs, the test for a worker
    report = assert_hang(
        session,
        SPAWN_POOL,
        "HANG after *: * processes, 1 stuck in multiprocessing child while spawn re-imports "
        "test_startup",
        *REIMPORT_FRAMES,
        '*thread * (_handle_workers)" [[]Pool handler thread[]]*',
        '*File "*multiprocessing/pool.py", line *, in _repopulate_pool_static',
        '*File "*multiprocessing/pool.py", line *, in _maintain_pool',
        '*File "*multiprocessing/pool.py", line *, in _handle_workers',
    )
    _assert_not_starting(report)
    assert "start-up frames cut" not in _child_block(report)

    # (b') a fork Pool: the replacement forked by the maintenance thread with the test's lock
    # held waits in its initializer; its fork history says which thread forked it, and when
    report = assert_hang(
        session,
        FORK_POOL,
        "HANG after *: * processes, 1 stuck in Pool worker _read_the_cache",
        "*hint: Pool worker (pid *) waits in `with CACHE:`*",
    )
    block = _child_block(report)
    frames = re.findall(r", in (\S+)\n", block + "\n")
    expected = ["_read_the_cache", "worker", "run", "_bootstrap", "_launch"]
    expected += ["_repopulate_pool_static", "_maintain_pool", "_handle_workers"]
    assert [f for f in frames if f in expected] == [
        "_read_the_cache",
        "worker",
        "run",
        "_bootstrap",
        "_launch",
        "_repopulate_pool_static",
        "_maintain_pool",
        "_handle_workers",
    ], block
    assert "multiprocessing's start-up frames cut" not in block
    _assert_not_starting(report)

    # (c) a script's spawned child runs the script's top level again (spawn's prepare, runpy),
    # which waits for the lock the script's main block holds while it joins the child
    report = assert_hang(
        session,
        SCRIPT,
        "*multiprocessing child (importing) (pid *): * -> while spawn re-imports train",
        '*File "*train.py", line *, in <module>',
        "*fcntl.flock(cache, fcntl.LOCK_SH)",
        "*, in run_path",
        '*File "*multiprocessing/spawn.py", line *, in _fixup_main_from_path',
        '*File "*multiprocessing/spawn.py", line *, in prepare',
        '*File "*multiprocessing/spawn.py", line *, in _main',
        '*File "*multiprocessing/spawn.py", line *, in spawn_main',
        "*hint: deadlock:*Process.join()*fcntl.flock(cache, fcntl.LOCK_SH)*",
    )
    _assert_not_starting(report)
    assert "multiprocessing's start-up frames cut" not in report

    # (d) a spawned executor worker whose initializer waits for the test's lock: the worker is
    # the one stuck, the test's Future.result() waits on it (its manager thread is no idle
    # service while the worker is blocked), and the first hint says so
    report = assert_hang(
        session,
        EXECUTOR,
        "HANG after *: * processes, 1 stuck in * _wait_for_the_cache",
        '*File "*test_startup.py", line *, in _wait_for_the_cache',
        '*File "*concurrent/futures/process.py", line *, in _process_worker',
    )
    first_hint = next(line for line in report.splitlines() if line.startswith("hint: "))
    assert first_hint.startswith("hint: deadlock:") and "Future.result()" in first_hint, report
    _assert_not_starting(report)
    session.assert_clean()

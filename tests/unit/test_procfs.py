"""The one /proc reader: stat parsed once, reads that can block bounded, children without the
``children`` files, and child-side notes read back for the report."""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_torchhang.capture import pipeline, procfs, tree
from pytest_torchhang.inject import hook
from pytest_torchhang.report.model import ProcessReport


@pytest.fixture
def thread_named() -> Iterator[tuple[int, str]]:
    """A live thread whose kernel name holds spaces and parentheses, as a command name may."""
    name = "a) b (c"
    ready, release = threading.Event(), threading.Event()
    tid: list[int] = []

    def run() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME: this thread's comm
        tid.append(threading.get_native_id())
        ready.set()
        release.wait(10)

    thread = threading.Thread(target=run)
    thread.start()
    assert ready.wait(10)
    yield tid[0], name
    release.set()
    thread.join(10)


def test_stat_is_parsed_past_a_command_name_with_spaces_and_parentheses(
    thread_named: tuple[int, str],
) -> None:
    tid, name = thread_named
    stat = procfs.stat(os.getpid(), tid)
    assert stat is not None
    assert stat.comm == name
    assert stat.state in "RS"
    assert stat.ppid == os.getppid()
    mine = procfs.stat(os.getpid())
    assert mine is not None and stat.start_ticks >= mine.start_ticks
    assert tree.start_ticks(os.getpid()) == mine.start_ticks


def test_stat_of_a_process_that_is_gone_is_none() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(30)
    assert procfs.stat(child.pid) is None


@pytest.fixture
def blocking_proc(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """A /proc-like tree whose ``PID/maps`` is a FIFO nobody writes: opening it blocks."""
    pid = 4242
    (tmp_path / str(pid)).mkdir()
    fifo = tmp_path / str(pid) / "maps"
    os.mkfifo(fifo)
    yield tmp_path, pid
    # release the reader thread still blocked in open(): a writer's open and close lets its
    # read return; no reader left (ENXIO) means there is nothing to release
    with contextlib.suppress(OSError):
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def test_a_read_that_does_not_return_is_abandoned_within_its_bound_and_noted(
    blocking_proc: tuple[Path, int],
) -> None:
    root, pid = blocking_proc
    reader = procfs.ProcReader(timeout_s=0.3, root=str(root))
    started = time.monotonic()
    assert reader.file(pid, "maps") is None
    assert time.monotonic() - started < 0.3 + 1.0
    assert [(u.pid, u.what) for u in reader.unread] == [(pid, "maps")]
    assert procfs.NOT_IN_TIME in reader.unread[0].reason
    # the next capture does not queue behind the stuck read: it is skipped, and says so
    again = procfs.ProcReader(timeout_s=0.3, root=str(root))
    started = time.monotonic()
    assert again.file(pid, "maps") is None
    assert time.monotonic() - started < 0.2
    assert "still blocked" in again.unread[0].reason
    # reads of other files go on, on a fresh reader thread
    words = Path("/proc/self/cmdline").read_bytes().decode().split("\0")[:-1]
    assert procfs.ProcReader(timeout_s=0.3).cmdline(os.getpid()) == words
    (note,) = reader.notes()
    assert note.startswith(f"pid {pid}:") and "maps" in note and procfs.NOT_IN_TIME in note


def test_the_capture_budget_bounds_every_read_that_can_block() -> None:
    reader = procfs.ProcReader(deadline=time.monotonic() - 1.0)
    assert reader.cmdline(os.getpid()) is None
    assert "budget" in reader.unread[0].reason
    # files that never block are read whatever the budget
    assert reader.file(os.getpid(), "status")


def test_cmdline_and_environ_match_what_the_process_was_started_with(tmp_path: Path) -> None:
    code = "import sys; print('up', flush=True); sys.stdin.read()"
    child = subprocess.Popen(
        [sys.executable, "-c", code, "an arg"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "RANK": "3"},
    )
    try:
        assert child.stdout is not None
        # read after the child runs: straight after Popen it may not have exec'd yet
        ready, _, _ = select.select([child.stdout], [], [], 60)
        assert ready and child.stdout.readline() == b"up\n"
        reader = procfs.ProcReader()
        assert reader.cmdline(child.pid) == [sys.executable, "-c", code, "an arg"]
        assert (reader.environ(child.pid) or {}).get("RANK") == "3"
        assert reader.unread == []
    finally:
        child.communicate(timeout=30)


def test_a_bounded_call_that_does_not_return_raises_timeout_error() -> None:
    release = threading.Event()
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"wait did not return within 0\.3s"):
        procfs.call_with_timeout(0.3, release.wait)
    assert time.monotonic() - started < 0.3 + 1.0
    release.set()
    assert procfs.call_with_timeout(5.0, sum, [1, 2]) == 3
    with pytest.raises(ZeroDivisionError):
        procfs.call_with_timeout(5.0, divmod, 1, 0)


@pytest.fixture
def grandchild() -> Iterator[tuple[int, int]]:
    """A child of this process with a child of its own: (child pid, grandchild pid)."""
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys; p = subprocess.Popen(['sleep', '60']); "
            "print(p.pid, flush=True); sys.stdin.read(); p.kill(); p.wait()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert child.stdout is not None
    line = child.stdout.readline()
    yield child.pid, int(line)
    child.communicate(timeout=30)


@pytest.mark.parametrize("children_files", [True, False], ids=["children files", "ppid scan"])
def test_the_ownership_snapshot_finds_children_and_grandchildren(
    grandchild: tuple[int, int], children_files: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where /proc/PID/task/TID/children is missing (gVisor, no CONFIG_PROC_CHILDREN) the
    snapshot scans /proc/*/stat instead: a fixture's processes are still found, so never killed."""
    child, grand = grandchild
    monkeypatch.setattr(procfs, "USE_CHILDREN_FILES", children_files)
    assert procfs.children_files() is children_files
    births = tree.births(os.getpid())
    pids = {pid for pid, _ in births}
    assert {child, grand} <= pids
    assert (child, tree.start_ticks(child)) in births
    assert tree.births_below([child]) == {
        (child, tree.start_ticks(child)),
        (grand, tree.start_ticks(grand)),
    }
    assert procfs.children(child) == [grand]
    owned = tree.descendants(os.getpid(), before=births)
    assert child not in {p.pid for p in owned} and grand not in {p.pid for p in owned}


def test_child_notes_are_read_back_for_the_report_with_their_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(hook.DUMP_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(hook._Registration, "dump_dir", None)
    hook.child_note("an earlier test's failure")
    time.sleep(0.01)  # notes are stamped to the millisecond: the next test begins later
    since = time.time()
    hook.child_note("pytest-torchhang could not wrap init_process_group in pid 1: boom")
    gone = 999999  # a process already gone: only its file is left
    Path(hook.notes_path(str(tmp_path), gone)).write_text(f"{time.time():.3f} listener died\n")
    me = ProcessReport(os.getpid(), 0, "rank 0/2", "", "sleeping", 0, 0, 0, 1, 0, "ok")
    notes = pipeline.child_notes(str(tmp_path), [me], since)
    assert notes == [
        f"pid {os.getpid()} (rank 0/2): pytest-torchhang could not wrap init_process_group "
        "in pid 1: boom",
        f"pid {gone}: listener died",
    ]

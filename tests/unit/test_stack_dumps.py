"""A stack dump counts once its text shows its end: checked on faulthandler's real output."""

from __future__ import annotations

import faulthandler
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_torchhang.capture import stacks
from pytest_torchhang.capture.stacks import Dump, dump_is_complete, parse_faulthandler


def _dump(path: Path) -> str:
    with open(path, "w") as out:
        faulthandler.dump_traceback(out, all_threads=True)
    return path.read_text()


@pytest.fixture
def waiting_threads() -> Iterator[int]:
    """Three more threads, blocked until the test ends; the count of this process's threads."""
    release = threading.Event()
    threads = [threading.Thread(target=release.wait, name=f"waiter {i}") for i in range(3)]
    for thread in threads:
        thread.start()
    # every Python thread faulthandler will write: threading's, and those started without it
    # (pytest-xdist's execnet starts its worker's thread with _thread)
    yield len(sys._current_frames())
    release.set()
    for thread in threads:
        thread.join(5)


def _end_of_line_with(text: str, needle: str) -> int:
    return text.index("\n", text.index(needle)) + 1


def test_a_whole_dump_of_several_threads_is_complete_and_every_cut_before_its_end_is_not(
    tmp_path: Path, waiting_threads: int
) -> None:
    text = _dump(tmp_path / "dump")
    assert len(parse_faulthandler(text)) == waiting_threads
    assert dump_is_complete(text)
    # Anywhere a writer could stop, up to and including this test's own frame (the main thread,
    # written last): never taken as the end. Below it lie only pytest's outermost frames.
    mine = _end_of_line_with(text, "in test_a_whole_dump_of_several_threads")
    wrong = [cut for cut in range(mine + 1) if dump_is_complete(text[:cut])]
    assert wrong == []


def test_a_dump_written_from_another_thread_is_complete(
    tmp_path: Path, waiting_threads: int
) -> None:
    got: list[str] = []
    writer = threading.Thread(target=lambda: got.append(_dump(tmp_path / "dump")))
    writer.start()
    writer.join(10)
    (text,) = got
    assert text.startswith("Current thread")  # the newest thread first, the main thread last
    assert dump_is_complete(text)
    mine = _end_of_line_with(text, "in test_a_dump_written_from_another_thread")
    assert not any(dump_is_complete(text[:cut]) for cut in range(mine + 1))


def test_a_stack_deeper_than_faulthandler_writes_ends_at_its_truncation_line(
    tmp_path: Path,
) -> None:
    def deep(n: int) -> str:
        return _dump(tmp_path / "dump") if n == 0 else deep(n - 1)

    text = deep(120)
    assert text.endswith("  ...\n")  # faulthandler stops at 100 frames
    assert dump_is_complete(text)
    assert not dump_is_complete(text[: -len("  ...\n")])


def test_a_dump_ending_at_a_threads_bootstrap_is_complete_only_in_a_one_thread_process(
    tmp_path: Path,
) -> None:
    """A child forked from a thread: that thread is all it has (the kernel's thread count)."""
    out = tmp_path / "dump"
    code = f"""
import faulthandler, os, threading
def fork_and_dump():
    pid = os.fork()
    if pid == 0:
        with open({str(out)!r}, "w") as f:
            faulthandler.dump_traceback(f, all_threads=True)
        os._exit(0)
    os.waitpid(pid, 0)
t = threading.Thread(target=fork_and_dump)
t.start(); t.join()
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    text = out.read_text()
    assert len(parse_faulthandler(text)) == 1
    assert dump_is_complete(text, one_thread=True)
    # elsewhere the same text is a dump cut after its first (newest) thread
    assert not dump_is_complete(text)


def _collect(path: Path, offset: int, budget_s: float) -> Dump:
    dumps = {1: Dump("no stack: no answer within the capture budget")}
    stacks._collect(dumps, {1: (str(path), offset)}, time.monotonic() + budget_s)
    return dumps[1]


def test_a_writer_paused_mid_dump_is_waited_for(tmp_path: Path, waiting_threads: int) -> None:
    """A cut real dump, finished 0.2 s later: long after its size stopped changing (the old
    10 ms rule took the cut text as the whole), well within the budget."""
    text = _dump(tmp_path / "whole")
    cut = text.index("Current thread")  # the main thread's block not written yet
    path = tmp_path / "dump"
    path.write_text("earlier dump\n")
    offset = path.stat().st_size
    with open(path, "a") as out:
        out.write(text[:cut])

    def finish() -> None:
        time.sleep(0.2)  # the preempted writer runs again
        with open(path, "a") as out:
            out.write(text[cut:])

    writer = threading.Thread(target=finish)
    writer.start()
    dump = _collect(path, offset, budget_s=5.0)
    writer.join()
    assert dump.status == "ok" and dump.complete
    assert len(dump.threads) == waiting_threads


def test_a_dump_that_never_shows_its_end_is_kept_and_marked_possibly_truncated(
    tmp_path: Path, waiting_threads: int
) -> None:
    text = _dump(tmp_path / "whole")
    path = tmp_path / "dump"
    path.write_text(text[: text.index("Current thread")])
    started = time.monotonic()
    dump = _collect(path, 0, budget_s=5.0)
    assert time.monotonic() - started < 5.0 - 1.0  # given up once quiet, not at the budget
    assert dump.status == "ok" and not dump.complete
    assert len(dump.threads) == waiting_threads - 1
    assert dump.threads[-1].truncated


def test_a_dump_still_growing_at_the_budget_is_kept_and_marked(tmp_path: Path) -> None:
    path = tmp_path / "dump"
    path.write_text("Thread 0x00007f0000000001 (most recent call first):\n")
    stop = threading.Event()

    def grow() -> None:  # a writer that never gets to its end within the budget
        while not stop.wait(0.02):
            with open(path, "a") as out:
                out.write(f'  File "x.py", line {os.getpid()} in f\n')

    writer = threading.Thread(target=grow)
    writer.start()
    try:
        started = time.monotonic()
        dump = _collect(path, 0, budget_s=0.6)
        assert time.monotonic() - started < 0.6 + 0.5
    finally:
        stop.set()
        writer.join()
    assert not dump.complete and dump.threads and dump.threads[-1].frames

"""A process's copy of its last stderr lines: kept bounded, per pid, never in the user's way."""

from __future__ import annotations

import contextlib
import io
import os
import threading
import time
from pathlib import Path

import pytest

from pytest_torchhang.capture.pipeline import (
    STDERR_TAIL_CHARS,
    STDERR_TAIL_LINES,
    fill_stderr_tails,
    gone_stderr_tails,
    read_stderr_tail,
    stderr_tail,
)
from pytest_torchhang.inject import protocol
from pytest_torchhang.inject.hook import StderrTail
from pytest_torchhang.inject.protocol import read_stderr_copy, stderr_path
from pytest_torchhang.report.model import HangReport, ProcessReport
from pytest_torchhang.report.model import StderrTail as GoneTail
from pytest_torchhang.report.text import to_text


def _tail(tmp_path: Path) -> tuple[io.StringIO, StderrTail]:
    stream = io.StringIO()
    return stream, StderrTail(stream, str(tmp_path))


def _copy(tmp_path: Path, pid: int | None = None) -> str:
    """The text of process ``pid``'s copy (this one's by default), as the capture reads it."""
    return read_stderr_copy(stderr_path(str(tmp_path), pid or os.getpid()))[0].decode()


def _process(pid: int) -> ProcessReport:
    return ProcessReport(
        pid=pid,
        ppid=1,
        role="DataLoader worker 0/1",
        cmdline="python",
        state="sleeping",
        cpu_s=0.0,
        cpu_delta_s=0.0,
        rss_bytes=0,
        num_threads=1,
        age_s=1.0,
        dump_status="ok",
    )


def test_the_user_sees_what_was_written_and_the_file_holds_a_copy(tmp_path: Path) -> None:
    stream, tail = _tail(tmp_path)
    print("first line", file=tail)
    tail.writelines(["second ", "line\n"])
    assert tail.write("third line\n") == len("third line\n")
    assert stream.getvalue() == "first line\nsecond line\nthird line\n"
    # in the file as soon as written: no flush, no close (the capture reads it from outside)
    assert _copy(tmp_path) == stream.getvalue()
    # everything else is the stream's own
    assert tail.getvalue() == stream.getvalue()


def test_a_threads_traceback_reaches_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, tail = _tail(tmp_path)
    monkeypatch.setattr("sys.stderr", tail)

    def fail() -> None:
        raise TypeError("cannot pickle '_thread.lock' object")

    thread = threading.Thread(target=fail)
    with pytest.MonkeyPatch.context() as patch:  # the real excepthook, not pytest's warning one
        patch.setattr(threading, "excepthook", threading.__excepthook__)
        thread.start()
        thread.join(10)
    lines, _ = read_stderr_tail(stderr_path(str(tmp_path), os.getpid()), 0.0)
    assert lines[-1] == "TypeError: cannot pickle '_thread.lock' object"
    assert lines[0].startswith("Exception in thread")


def test_the_file_stays_bounded_and_keeps_the_last_lines(tmp_path: Path) -> None:
    stream, tail = _tail(tmp_path)
    path = Path(stderr_path(str(tmp_path), os.getpid()))
    sizes = set()
    for n in range(10_000):
        tail.write(f"line {n} " + "x" * 40 + "\n")
        sizes.add(path.stat().st_size)
        if n in (1_500, 4_000):  # just after a wrap too: whole lines, the latest last
            lines, _ = read_stderr_tail(str(path), 0.0)
            assert lines[-1].startswith(f"line {n} ") and lines[0].startswith(f"line {n - 19} ")
    assert len(stream.getvalue()) > 5 * protocol.STDERR_FILE_BYTES  # the user lost nothing
    assert sizes == {protocol.STDERR_MAP_BYTES}  # one size, set at the first write
    lines, _ = read_stderr_tail(str(path), 0.0)
    assert len(lines) == STDERR_TAIL_LINES
    assert lines[-1].startswith("line 9999 ") and lines[0].startswith("line 9980 ")
    text, _, cut = read_stderr_copy(str(path))
    assert cut and len(text) == protocol.STDERR_KEEP_BYTES


def test_one_write_longer_than_the_file_keeps_its_end(tmp_path: Path) -> None:
    _, tail = _tail(tmp_path)
    tail.write("before\n")
    tail.write("".join(f"{n:06d}\n" for n in range(20_000)))  # 140 KB at once
    assert _copy(tmp_path).endswith("019998\n019999\n")
    lines, _ = read_stderr_tail(stderr_path(str(tmp_path), os.getpid()), 0.0)
    assert lines[-1] == "019999" and len(lines) == STDERR_TAIL_LINES


def test_a_fork_child_writes_its_own_file_and_leaves_its_parents_alone(tmp_path: Path) -> None:
    _, tail = _tail(tmp_path)
    tail.write("parent before the fork\n")
    pid = os.fork()
    if pid == 0:  # the child: its first write opens its own file
        try:
            tail.write("child line\n")
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    tail.write("parent after the fork\n")
    assert _copy(tmp_path) == "parent before the fork\nparent after the fork\n"
    assert _copy(tmp_path, pid) == "child line\n"


def test_descriptors_closed_and_reused_by_other_code_are_never_written(tmp_path: Path) -> None:
    before = set(os.listdir("/proc/self/fd"))
    _, tail = _tail(tmp_path)
    tail.write("one\n")
    for name in set(os.listdir("/proc/self/fd")) - before:  # code that closes all of them
        with contextlib.suppress(OSError):
            os.close(int(name))
    other = tmp_path / "users.log"
    fd = os.open(other, os.O_WRONLY | os.O_CREAT)  # code that opens its own files
    try:
        tail.write("two\n")
    finally:
        os.close(fd)
    assert other.read_text() == ""
    assert _copy(tmp_path) == "one\ntwo\n"


def test_copying_costs_no_system_call_a_line(tmp_path: Path) -> None:
    """200,000 lines through the copy take about as long as through a bare pass-through
    wrapper, not several times as long (issue 29; bench/bench_stderr.py measures it)."""

    class Bare:
        def __init__(self, stream: io.TextIOBase) -> None:
            self.stream = stream

        def write(self, text: str) -> int:
            return self.stream.write(text)

    def seconds(stream: object) -> float:
        began = time.perf_counter()
        for n in range(100_000):
            print(f"line {n} of a chatty child", file=stream)
        return time.perf_counter() - began

    with open(tmp_path / "stderr.txt", "w", buffering=1) as out:  # line-buffered, as stderr
        bare = min(seconds(Bare(out)) for _ in range(3))
        copied = min(seconds(StderrTail(out, str(tmp_path))) for _ in range(3))
    assert copied < 3 * bare, (copied, bare)  # a write(2) and an fstat(2) a line was 4-6x


def test_a_failing_copy_never_reaches_the_user_and_stops(tmp_path: Path) -> None:
    stream, tail = _tail(tmp_path / "gone")  # no such directory
    assert tail.write("still shown\n") == len("still shown\n")
    tail.write("and this\n")
    assert stream.getvalue() == "still shown\nand this\n"
    assert tail._torchhang_off


def test_an_error_of_the_users_stream_is_the_users() -> None:
    stream = io.StringIO()
    stream.close()
    with pytest.raises(ValueError, match="closed file"):
        StderrTail(stream, "/nonexistent").write("x")


def test_the_tail_is_bounded_in_lines_and_characters() -> None:
    assert stderr_tail("".join(f"{n}\n" for n in range(100))) == [str(n) for n in range(80, 100)]
    long = stderr_tail("short\n" + "y" * 10_000 + "\n")
    assert long == ["..." + "y" * (STDERR_TAIL_CHARS - 3)]
    wide = stderr_tail("".join(f"{n} " + "z" * 1000 + "\n" for n in range(10)))
    assert [line.split()[0] for line in wide] == ["6", "7", "8", "9"]
    assert sum(map(len, wide)) <= STDERR_TAIL_CHARS


def test_a_progress_bar_reads_as_its_last_state_and_control_characters_are_escaped() -> None:
    text = " 10%|#\r 50%|#####\r100%|##########\r\nTraceback\r\n\x1b[31mError: red\x1b[0m\n\n"
    assert stderr_tail(text) == ["100%|##########", "Traceback", "\\x1b[31mError: red\\x1b[0m"]


def test_a_file_cut_in_the_middle_loses_its_first_partial_line() -> None:
    assert stderr_tail("tail of a cut line\nwhole\n", partial_first=True) == ["whole"]


def test_files_last_written_before_the_test_are_not_shown(tmp_path: Path) -> None:
    pid = os.fork()
    if pid == 0:
        try:
            StderrTail(io.StringIO(), str(tmp_path)).write("an earlier test's line\n")
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    path = Path(stderr_path(str(tmp_path), 4242))
    Path(stderr_path(str(tmp_path), pid)).rename(path)
    with open(path, "r+b") as copy:  # written a minute ago
        copy.write(protocol.STDERR_HEADER.pack(time.time() - 60))
    procs = [_process(4242)]
    fill_stderr_tails(str(tmp_path), procs, since=time.time() - 30)
    assert procs[0].stderr_tail == []
    fill_stderr_tails(str(tmp_path), procs, since=time.time() - 90)
    assert procs[0].stderr_tail == ["an earlier test's line"]


def test_gone_processes_files_are_found_and_live_strangers_are_not(tmp_path: Path) -> None:
    _, tail = _tail(tmp_path)
    pid = os.fork()
    if pid == 0:
        try:
            tail.write("RuntimeError: the child failed before it sent its result\n")
        finally:
            os._exit(1)
    os.waitpid(pid, 0)  # reaped: gone from /proc
    tail.write("a live process's line\n")  # this very process: alive, not in the report
    since = time.time() - 30
    assert gone_stderr_tails(str(tmp_path), set(), since) == [
        GoneTail(pid, ["RuntimeError: the child failed before it sent its result"])
    ]
    assert gone_stderr_tails(str(tmp_path), {pid}, since) == []


def test_the_report_shows_the_lines_under_the_process_and_keeps_them_in_json() -> None:
    proc = _process(7)
    proc.stderr_tail = ["Traceback (most recent call last):", "TypeError: cannot pickle 'x'"]
    quiet = _process(8)
    report = HangReport("t.py::test", 1.0, 1.0, "call", headline="HANG", processes=[proc, quiet])
    report.gone_stderr = [GoneTail(9, ["RuntimeError: boom"])]
    text = to_text(report)
    assert (
        "    last stderr lines:\n"
        "        Traceback (most recent call last):\n"
        "        TypeError: cannot pickle 'x'\n"
    ) in text
    assert text.index("--- process 7") < text.index("last stderr") < text.index("--- process 8")
    assert text.count("last stderr lines:") == 2  # pid 7 and the gone pid 9, not pid 8
    assert "--- process 9, gone before the capture\n    last stderr lines:\n" in text
    doc = report.to_json()
    assert "stderr_tail" not in doc["processes"][1]  # wrote nothing: as in older documents
    again = HangReport.from_json(doc)
    assert again.processes[0].stderr_tail == proc.stderr_tail
    assert again.processes[1].stderr_tail == []
    assert again.gone_stderr == report.gone_stderr
    assert to_text(again) == text

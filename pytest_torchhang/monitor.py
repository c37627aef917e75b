"""The last resort: a process that acts when the pytest process cannot.

The watchdog thread needs the GIL. If the test's main thread holds it in C code (or the process
is frozen), the monitor, told of each deadline through a pipe, captures every stack from outside
(the pytest process answers the dump signal in C, without the GIL), prints the report to the
terminal pytest started on, writes the JSON report, and kills the whole tree, pytest included.
Run as ``python -m pytest_torchhang.monitor PYTEST_PID FD DUMP_DIR REPORT_DIR BOARD [--spare-root]``;
with ``--spare-root`` (pytest runs in a thread of a host program, such as an IDE) it reports and
kills the test's processes but never the host. ``MonitorClient`` is the pytest side.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterable

from ._hook import DUMP_DIR_ENV

#: How long after the deadline the watchdog thread has to say it fired.
GIL_GRACE_S = 3.0
#: How long after the watchdog fired the test has to finish.
HARD_GRACE_S = 20.0
#: The last-resort capture may take this much longer than a capture's own budget (native
#: stacks through pystack or py-spy take about 2 s), then the tree is killed all the same.
CAPTURE_EXTRA_S = 8.0
#: The monitor looks at the deadline board (and at its parent) at least this often.
POLL_S = 0.5


class DeadlineBoard:
    """The current test's deadline, on a page the monitor reads: no system call per test.

    The pytest process writes it (a seqlock: the sequence number is odd while it writes); the
    monitor reads it whenever it wakes (at least twice a second) and retries a torn read. Only
    the rare events (a deadline fired, the session's end) go through the pipe.
    """

    SIZE = 1 << 16
    _HEAD = struct.Struct("<QQddQQQ")  # seq, generation, deadline, timeout, armed, id len, pairs
    _ID_AT, _ID_MAX = 64, 1024
    _PAIRS_AT = _ID_AT + _ID_MAX
    _PAIR = struct.Struct("<QQ")
    MAX_PAIRS = (SIZE - _PAIRS_AT) // _PAIR.size

    def __init__(self, path: str, create: bool = False) -> None:
        flags = os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, self.SIZE)
            self._page = mmap.mmap(fd, self.SIZE, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.path = path
        self._seq = 0
        self._generation = 0

    def arm(
        self, deadline: float, timeout: float, before: Iterable[tuple[int, int]], test_id: str
    ) -> None:
        """A new deadline (a new test, a grace, a pause): the monitor forgets any earlier fire."""
        name = test_id.encode("utf-8", "replace")[: self._ID_MAX]
        pairs = list(before)[: self.MAX_PAIRS]
        self._generation += 1
        self._write(deadline, timeout, 1, name, pairs)

    def disarm(self) -> None:
        self._write(0.0, 0.0, 0, b"", [])

    def _write(
        self, deadline: float, timeout: float, armed: int, name: bytes, pairs: list[tuple[int, int]]
    ) -> None:
        page = self._page
        self._seq += 1  # odd: a write is under way
        struct.pack_into("<Q", page, 0, self._seq)
        page[self._ID_AT : self._ID_AT + len(name)] = name
        for index, pair in enumerate(pairs):
            self._PAIR.pack_into(page, self._PAIRS_AT + index * self._PAIR.size, *pair)
        self._seq += 1
        self._HEAD.pack_into(
            page, 0, self._seq, self._generation, deadline, timeout, armed, len(name), len(pairs)
        )

    def read(self) -> tuple[int, float, float, frozenset[tuple[int, int]], str] | None:
        """(generation, deadline, timeout, before, test id) while armed, else None."""
        for _ in range(1000):
            seq, generation, deadline, timeout, armed, length, count = self._HEAD.unpack_from(
                self._page, 0
            )
            if seq % 2:
                time.sleep(0.0001)
                continue
            name = bytes(self._page[self._ID_AT : self._ID_AT + length])
            pairs = frozenset(
                self._PAIR.unpack_from(self._page, self._PAIRS_AT + i * self._PAIR.size)
                for i in range(count)
            )
            if struct.unpack_from("<Q", self._page, 0)[0] != seq:
                continue  # torn: written meanwhile
            if not armed:
                return None
            return generation, deadline, timeout, pairs, name.decode("utf-8", "replace")
        return None


class MonitorClient:
    """The pytest side of the monitor process: started on first use, told of deadlines by a
    shared page (``DeadlineBoard``) and of rare events by a pipe."""

    def __init__(
        self, dump_dir: str, stderr_fd: int, report_dir: str | None, spare_root: bool = False
    ) -> None:
        self._dump_dir = dump_dir
        self._stderr_fd = stderr_fd
        self._report_dir = report_dir
        self._spare_root = spare_root
        self._proc: subprocess.Popen[bytes] | None = None
        self._write_fd: int | None = None
        self._lock = threading.RLock()  # the test's thread and the watchdog's both use it
        self.board = DeadlineBoard(os.path.join(dump_dir, f"monitor-{os.getpid()}.page"), True)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _start(self) -> None:
        from . import processwide

        read_fd, write_fd = os.pipe()
        env = {k: v for k, v in os.environ.items() if k != DUMP_DIR_ENV}
        self._proc = processwide.launch(lambda: self._popen(read_fd, env))
        os.close(read_fd)
        os.set_inheritable(write_fd, False)
        self._write_fd = write_fd

    def _popen(self, read_fd: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pytest_torchhang.monitor",
                str(os.getpid()),
                str(read_fd),
                self._dump_dir,
                self._report_dir or "",
                self.board.path,
                *(["--spare-root"] if self._spare_root else []),
            ],
            pass_fds=(read_fd,),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._stderr_fd,
            env=env,
            close_fds=True,
            start_new_session=True,  # Ctrl-C in the terminal is pytest's, not the monitor's
        )

    def ensure_started(self) -> int:
        """Start the monitor if it is not running; returns its pid."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._close_pipe()
                self._start()
            assert self._proc is not None
            return self._proc.pid

    def check(self) -> str | None:
        """Restart a monitor that died (the GIL backstop must never be gone silently); returns
        what happened, for the session's notes, or None when it runs."""
        with self._lock:
            proc = self._proc
            if proc is None or proc.poll() is None:
                return None
            code = proc.returncode
            self.ensure_started()  # it reads the current deadline from the page, which outlives it
        return (
            f"pytest-torchhang's monitor (the last resort when a thread holds the GIL) exited "
            f"with status {code} and was restarted"
        )

    def send(self, line: str) -> None:
        """Tell the monitor ``line``; restart it once if it died."""
        with self._lock:
            self._send(line)

    def _send(self, line: str) -> None:
        for _ in range(2):
            self.ensure_started()
            assert self._write_fd is not None
            try:
                os.write(self._write_fd, (line + "\n").encode())
                return
            except OSError:
                self._close_pipe()
                self._proc = None

    def _close_pipe(self) -> None:
        if self._write_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._write_fd)
            self._write_fd = None

    def stop(self) -> None:
        """End the monitor: closing the pipe makes it exit; bounded wait, then kill."""
        self._close_pipe()
        if self._proc is not None:
            from .proctree import end_helper

            end_helper(self._proc, 2.0)
            self._proc = None


def _take_over(
    pytest_pid: int,
    dump_dir: str,
    report_dir: str,
    armed: tuple[float, float, frozenset[tuple[int, int]], str],
    fired: bool,
    spare_root: bool,
) -> None:
    from .guard import GuardTarget, capture, kill
    from .procfs import call_with_timeout
    from .report import HangReport, Hint

    deadline, timeout, before, test_id = armed
    target = GuardTarget(
        test_id=test_id,
        timeout_s=timeout,
        root_pid=pytest_pid,
        dump_dir=dump_dir,
        started=deadline - timeout,
        exclude={os.getpid()},
        root_in_process=False,
        kill_root=not spare_root,
        # When the whole session goes down, its fixtures' processes go with it; a host program
        # that ran pytest in a thread keeps its session's processes.
        before=before if spare_root else None,
    )
    try:  # every step of a capture is bounded; their sum must be too, or the kill never comes
        report = call_with_timeout(target.capture_budget_s + CAPTURE_EXTRA_S, capture, target)
    except Exception as exc:
        report = HangReport(
            test_id=test_id,
            timeout_s=timeout,
            elapsed_s=time.monotonic() - target.started,
            phase="call",
            headline=f"HANG in {test_id}: the stacks could not be taken",
            notes=[f"pytest-torchhang's last-resort capture failed: {exc}"],
        )
    why = (
        "the test did not finish after the watchdog had fired and killed its children"
        if fired
        else "the pytest process's own watchdog could not run"
    )
    ending = (
        "pytest runs in a thread of a host program here, which pytest-torchhang never kills: the "
        "test's processes are killed, and the test stays blocked until that call returns"
        if spare_root
        else "pytest-torchhang ends the whole session here"
    )
    report.hints.insert(
        0,
        Hint(
            f"{why}: its {'pytest thread' if spare_root else 'main thread'} is blocked in C "
            "code holding the GIL (or the process is frozen), "
            f"so nothing inside it can move. {ending}; the stack of the pytest process below "
            "shows the call that blocks.",
            [f"pytest (pid {pytest_pid})"],
        ),
    )
    banner = "!" * 30 + " pytest-torchhang: session stopped " + "!" * 30
    text = report.to_text().rsplit("\ncleanup:", 1)[0]  # printed before the kill: no cleanup yet
    victims = "the test's processes" if spare_root else "the whole tree, pytest included"
    sys.stderr.write(f"\n{banner}\n{text}\nkilling {victims}\n")
    sys.stderr.flush()  # before the kill: whoever waits for pytest reads this when it returns
    kill(target, report)
    sys.stderr.write(report.to_text().rsplit("\n", 1)[-1] + "\n")
    sys.stderr.flush()
    if not spare_root:
        shutil.rmtree(dump_dir, ignore_errors=True)  # pytest, which would have removed it, is gone
    if report_dir:
        os.makedirs(report_dir, exist_ok=True)
        name = f"session-stop-{pytest_pid}-{int(time.time())}.json"
        with open(os.path.join(report_dir, name), "w") as out:
            json.dump(report.to_json(), out, indent=1, default=str)


def main(argv: list[str]) -> int:
    """Follow the pytest process's deadlines until it closes the pipe."""
    # Interrupts are pytest's to handle: the monitor exits when pytest is gone, not at Ctrl-C.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pytest_pid, fd, dump_dir, report_dir = int(argv[0]), int(argv[1]), argv[2], argv[3]
    board = DeadlineBoard(argv[4])
    spare_root = "--spare-root" in argv[5:]
    fired: tuple[int, float] | None = None  # (generation, when) of the last FIRED
    pending = b""
    # A monitor restarted late may find a deadline already past on the page: the watchdog,
    # which restarted it, gets its grace from now, not from then.
    earliest = time.monotonic() + GIL_GRACE_S
    while True:
        current = board.read()
        if current is None or (fired is not None and fired[0] != current[0]):
            fired = None  # disarmed, or a new deadline since: an earlier fire no longer counts
        due = None
        if current is not None:
            due = fired[1] + HARD_GRACE_S if fired is not None else current[1] + GIL_GRACE_S
            due = max(due, earliest)
        now = time.monotonic()
        if current is not None and due is not None and now >= due:
            deadline, timeout_s, before, test_id = current[1:]
            _take_over(
                pytest_pid,
                dump_dir,
                report_dir,
                (deadline, timeout_s, before, test_id),
                fired is not None,
                spare_root,
            )
            if spare_root:  # the host goes on: so does the monitor, for later tests
                board_generation = current[0]
                while (again := board.read()) is not None and again[0] == board_generation:
                    time.sleep(0.2)  # until the host moves on to another deadline
                fired = None
                continue
            return 1
        # Forked children of pytest inherit the pipe's write end, so pytest's death need not close
        # it: look at our parent at least twice a second as well (and at the board).
        if os.getppid() != pytest_pid:
            return 0
        wait = POLL_S if due is None else min(POLL_S, max(0.0, due - now))
        ready, _, _ = select.select([fd], [], [], wait)
        if ready:
            data = os.read(fd, 65536)
            if not data:
                return 0  # pytest closed the pipe: the session is over, or pytest is gone
            pending += data
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                if raw.strip() == b"FIRED":
                    armed_now = board.read()
                    if armed_now is not None:
                        fired = (armed_now[0], time.monotonic())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

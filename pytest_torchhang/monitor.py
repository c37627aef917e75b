"""The last resort: a process that acts when the pytest process cannot.

The watchdog thread needs the GIL. If the test's main thread holds it in C code (or the process
is frozen), the monitor, told of each deadline through a pipe, captures every stack from outside
(the pytest process answers the dump signal in C, without the GIL), prints the report to the
terminal pytest started on, writes the JSON report, and kills the whole tree, pytest included.
Run as ``python -m pytest_torchhang.monitor PYTEST_PID FD DUMP_DIR REPORT_DIR [--spare-root]``;
with ``--spare-root`` (pytest runs in a thread of a host program, such as an IDE) it reports and
kills the test's processes but never the host. ``MonitorClient`` is the pytest side.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time

from ._hook import DUMP_DIR_ENV

#: How long after the deadline the watchdog thread has to say it fired.
GIL_GRACE_S = 3.0
#: How long after the watchdog fired the test has to finish.
HARD_GRACE_S = 20.0


class MonitorClient:
    """The pytest side of the monitor process: started on first use, told of deadlines by a pipe."""

    def __init__(
        self, dump_dir: str, stderr_fd: int, report_dir: str | None, spare_root: bool = False
    ) -> None:
        self._dump_dir = dump_dir
        self._stderr_fd = stderr_fd
        self._report_dir = report_dir
        self._spare_root = spare_root
        self._proc: subprocess.Popen[bytes] | None = None
        self._write_fd: int | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _start(self) -> None:
        read_fd, write_fd = os.pipe()
        env = {k: v for k, v in os.environ.items() if k != DUMP_DIR_ENV}
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pytest_torchhang.monitor",
                str(os.getpid()),
                str(read_fd),
                self._dump_dir,
                self._report_dir or "",
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
        os.close(read_fd)
        os.set_inheritable(write_fd, False)
        self._write_fd = write_fd

    def ensure_started(self) -> int:
        """Start the monitor if it is not running; returns its pid."""
        if self._proc is None or self._proc.poll() is not None:
            self._close_pipe()
            self._start()
        assert self._proc is not None
        return self._proc.pid

    def send(self, line: str) -> None:
        """Tell the monitor ``line``; restart it once if it died."""
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
            try:
                self._proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(timeout=2.0)
            self._proc = None


def _parse_before(field: str) -> frozenset[tuple[int, int]]:
    pairs = (word.split(":") for word in field.split(",") if ":" in word)
    return frozenset((int(pid), int(ticks)) for pid, ticks in pairs)


def _take_over(
    pytest_pid: int,
    dump_dir: str,
    report_dir: str,
    armed: tuple[float, float, frozenset[tuple[int, int]], str],
    fired: bool,
    spare_root: bool,
) -> None:
    from .guard import GuardTarget, capture, kill
    from .report import Hint

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
    report = capture(target)
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
    spare_root = "--spare-root" in argv[4:]
    armed: tuple[float, float, frozenset[tuple[int, int]], str] | None = None
    fired_at: float | None = None
    pending = b""
    while True:
        due = None
        if armed is not None:
            due = fired_at + HARD_GRACE_S if fired_at is not None else armed[0] + GIL_GRACE_S
        # Forked children of pytest inherit the pipe's write end, so pytest's death need not close
        # it: look at our parent at least once a second as well.
        timeout = 1.0 if due is None else min(1.0, max(0.0, due - time.monotonic()))
        if os.getppid() != pytest_pid:
            return 0
        ready, _, _ = select.select([fd], [], [], timeout)
        if ready:
            data = os.read(fd, 65536)
            if not data:
                return 0  # pytest closed the pipe: the session is over, or pytest is gone
            pending += data
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                word, _, rest = raw.decode(errors="replace").partition(" ")
                if word == "ARM":
                    deadline, timeout_s, before, test_id = rest.split(" ", 3)
                    armed = (float(deadline), float(timeout_s), _parse_before(before), test_id)
                    fired_at = None
                elif word == "FIRED":
                    fired_at = time.monotonic()
                elif word == "DISARM":
                    armed, fired_at = None, None
        elif armed is not None and due is not None and time.monotonic() >= due:
            _take_over(pytest_pid, dump_dir, report_dir, armed, fired_at is not None, spare_root)
            if spare_root:  # the host goes on: so does the monitor, for later tests
                armed, fired_at = None, None
                continue
            return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

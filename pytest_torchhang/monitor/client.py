"""The pytest side of the monitor: start it (from the launcher thread), restart it, tell it."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Callable

from ..inject.protocol import DUMP_DIR_ENV
from .page import DeadlineBoard

#: A start in flight is waited for at most this long where the process itself is needed.
LAUNCH_WAIT_S = 30.0
#: The directory that holds the pytest_torchhang package, for a monitor started without site.
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
        #: a start in flight on the launcher thread (``start_soon``): its result, and the pipe
        self._starting: tuple[Callable[[float], subprocess.Popen[bytes]], int, int] | None = None
        self._start_failed: BaseException | None = None
        self.board = DeadlineBoard(os.path.join(dump_dir, f"monitor-{os.getpid()}.page"), True)

    @property
    def pid(self) -> int | None:
        """The monitor's pid; None while it is still starting (this never waits for it)."""
        proc = self._proc
        if proc is not None and self._starting is None:
            return proc.pid
        with self._lock:
            self._settle(0.0)
            return self._proc.pid if self._proc is not None else None

    def settled_pid(self) -> int | None:
        """The monitor's pid once a start in flight is over (bounded wait)."""
        with self._lock:
            self._settle(LAUNCH_WAIT_S)
            return self._proc.pid if self._proc is not None else None

    def start_soon(self) -> None:
        """Start the monitor without waiting for it: the launcher thread forks and executes it
        while the session goes on (its first test included). Whoever needs the process itself
        (a fire, its pid for a kill, the session's end) waits for the start then."""
        from .. import processwide

        with self._lock:
            if self._proc is not None or self._starting is not None:
                return
            read_fd, write_fd = os.pipe()
            env = {k: v for k, v in os.environ.items() if k != DUMP_DIR_ENV}
            result = processwide.launch_soon(lambda: self._popen(read_fd, env))
            self._starting = (result, read_fd, write_fd)

    def _settle(self, wait_s: float) -> None:
        """With the lock held: take over a start in flight once it is over (up to ``wait_s``)."""
        if self._starting is None:
            return
        result, read_fd, write_fd = self._starting
        try:
            proc = result(wait_s)
        except TimeoutError:
            return  # still starting
        except Exception as exc:  # ensure_started starts it again, and raises its own failure
            self._starting, self._start_failed = None, exc
            for fd in (read_fd, write_fd):
                with contextlib.suppress(OSError):
                    os.close(fd)
            return
        self._starting = None
        os.close(read_fd)  # the child has its copy
        self._proc, self._write_fd = proc, write_fd

    def _start(self) -> None:
        from .. import processwide

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
                "-S",  # no site-packages scan (.pth files): a start in ~10 ms of CPU, not ~40
                "-c",
                "import sys; sys.path.insert(0, sys.argv.pop(1)); "
                "from pytest_torchhang.monitor.process import main; sys.exit(main(sys.argv[1:]))",
                _PACKAGE_PARENT,
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
            self._settle(LAUNCH_WAIT_S)
            if self._proc is None or self._proc.poll() is not None:
                self._close_pipe()
                self._start()
            assert self._proc is not None
            return self._proc.pid

    def check(self) -> str | None:
        """Restart a monitor that died (the GIL backstop must never be gone silently); returns
        what happened, for the session's notes, or None when it runs."""
        with self._lock:
            self._settle(0.0)
            if self._start_failed is not None:  # the start in the background failed: again
                failed, self._start_failed = self._start_failed, None
                self.ensure_started()
                return f"pytest-torchhang's monitor failed to start ({failed!r}) and was restarted"
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
        with self._lock:
            self._settle(LAUNCH_WAIT_S)
        self._close_pipe()
        if self._proc is not None:
            # A monitor still starting would be waited for until it has read the closed pipe;
            # SIGTERM ends it at once (a last-resort capture in progress ignores it, and is
            # killed after the grace below, as before).
            with contextlib.suppress(OSError):
                self._proc.terminate()
            from ..processwide import end_helper

            end_helper(self._proc, 2.0)
            self._proc = None

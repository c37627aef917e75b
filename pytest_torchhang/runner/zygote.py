"""The warm parent: a process that imported torch (and never ran a torch op) and forks children.

``python -m pytest_torchhang.runner.zygote`` reads request paths, one per line, on stdin, and writes
events on stdout: ``PID <request> <pid>`` when a child is forked and ``EXIT <pid> <code>`` when it
is reaped (code < 0: killed by that signal). It exits when stdin closes, killing its children, and
dies with its parent. A torch op in this process would start OpenMP threads and make every later
fork hang in libgomp: nothing here may run one.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys


def _fork(request_path: str) -> int:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)  # the job's, as usual
            os.close(0)
            os.open(os.devnull, os.O_RDONLY)  # fd 0 again
            from .child import run_request

            code = run_request(request_path)
        finally:
            os._exit(code)
    return pid


def main() -> int:
    """Serve fork requests until stdin closes."""
    from ..processwide import die_with_parent

    # Ctrl-C is pytest's to handle; the zygote ends when pytest closes its stdin, or dies.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    preload = os.environ.get("PYTEST_TORCH_HANG_ZYGOTE_PRELOAD", "torch").split(",")
    for name in filter(None, preload):
        with contextlib.suppress(ImportError):
            __import__(name)
    from . import child  # noqa: F401 - warm the child's imports too

    events = sys.stdout.buffer
    events.write(b"READY\n")
    events.flush()
    children: set[int] = set()
    pending = b""
    # SIGCHLD wakes the select below through this pipe: a child is reaped (and reported) at once.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    signal.set_wakeup_fd(wake_w)
    while True:
        ready, _, _ = select.select([0, wake_r], [], [], 1.0 if children else None)
        if wake_r in ready:
            os.read(wake_r, 4096)
        if 0 in ready:
            data = os.read(0, 65536)
            if not data:
                break
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                request = line.decode()
                # A child inherits this buffer, and flushes it into its own output file at its
                # end: it must hold none of our lines (the last request's PID) when we fork.
                events.flush()
                pid = _fork(request)
                children.add(pid)
                events.write(f"PID {request} {pid}\n".encode())
        for pid in list(children):
            got, status = os.waitpid(pid, os.WNOHANG)
            if got == pid:
                children.discard(pid)
                events.write(f"EXIT {pid} {os.waitstatus_to_exitcode(status)}\n".encode())
        events.flush()
    for pid in children:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main())

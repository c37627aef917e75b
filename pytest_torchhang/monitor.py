"""The last resort: a process that acts when the pytest process cannot.

The watchdog thread needs the GIL. If the test's main thread holds it in C code (or the process
is frozen), the monitor, told of each deadline through a pipe, captures every stack from outside
(the pytest process answers the dump signal in C, without the GIL), prints the report to the
terminal pytest started on, writes the JSON report, and kills the whole tree, pytest included.
Run as ``python -m pytest_torchhang.monitor PYTEST_PID FD DUMP_DIR REPORT_DIR``.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import sys
import time

from .guard import GuardTarget, capture, kill
from .report import Hint

#: How long after the deadline the watchdog thread has to say it fired.
GIL_GRACE_S = 3.0
#: How long after the watchdog fired the test has to finish.
HARD_GRACE_S = 20.0


def _take_over(
    pytest_pid: int,
    dump_dir: str,
    report_dir: str,
    test_id: str,
    timeout: float,
    deadline: float,
    fired: bool,
) -> None:
    target = GuardTarget(
        test_id=test_id,
        timeout_s=timeout,
        root_pid=pytest_pid,
        dump_dir=dump_dir,
        started=deadline - timeout,
        exclude={os.getpid()},
        root_in_process=False,
        kill_root=True,
    )
    report = capture(target)
    why = (
        "the test did not finish after the watchdog had fired and killed its children"
        if fired
        else "the pytest process's own watchdog could not run"
    )
    report.hints.insert(
        0,
        Hint(
            f"{why}: its main thread is blocked in C code holding the GIL (or the process is frozen), "
            "so nothing inside it can move. pytest-torchhang ends the whole session here; the stack "
            "of the pytest process below shows the call that blocks.",
            [f"pytest (pid {pytest_pid})"],
        ),
    )
    banner = "!" * 30 + " pytest-torchhang: session stopped " + "!" * 30
    text = report.to_text().rsplit("\ncleanup:", 1)[0]  # printed before the kill: no cleanup yet
    sys.stderr.write(f"\n{banner}\n{text}\nkilling the whole tree, pytest included\n")
    sys.stderr.flush()  # before the kill: whoever waits for pytest reads this when it returns
    kill(target, report)
    sys.stderr.write(report.to_text().rsplit("\n", 1)[-1] + "\n")
    sys.stderr.flush()
    shutil.rmtree(dump_dir, ignore_errors=True)  # pytest, which would have removed it, is gone
    if report_dir:
        os.makedirs(report_dir, exist_ok=True)
        name = f"session-stop-{pytest_pid}-{int(time.time())}.json"
        with open(os.path.join(report_dir, name), "w") as out:
            json.dump(report.to_json(), out, indent=1, default=str)


def main(argv: list[str]) -> int:
    """Follow the pytest process's deadlines until it closes the pipe."""
    pytest_pid, fd, dump_dir, report_dir = int(argv[0]), int(argv[1]), argv[2], argv[3]
    armed: tuple[float, float, str] | None = None
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
                    deadline, timeout_s, test_id = rest.split(" ", 2)
                    armed, fired_at = (float(deadline), float(timeout_s), test_id), None
                elif word == "FIRED":
                    fired_at = time.monotonic()
                elif word == "DISARM":
                    armed, fired_at = None, None
        elif armed is not None and due is not None and time.monotonic() >= due:
            _take_over(
                pytest_pid, dump_dir, report_dir, armed[2], armed[1], armed[0], fired_at is not None
            )
            return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The monitor process: the last resort, acting when the pytest process cannot.

The watchdog thread needs the GIL. If the test's main thread holds it in C code (or the process
is frozen), the monitor, told of each deadline through a pipe, captures every stack from outside
(the pytest process answers the dump signal in C, without the GIL), prints the report to the
terminal pytest started on, writes the JSON report, and kills the whole tree, pytest included.
Run as ``python -m pytest_torchhang.monitor PYTEST_PID FD DUMP_DIR REPORT_DIR BOARD [--spare-root]``;
with ``--spare-root`` (pytest runs in a thread of a host program, such as an IDE) it reports and
kills the test's processes but never the host. ``MonitorClient`` is the pytest side.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import sys

from .. import clock
from .page import DeadlineBoard

#: How long after the deadline the watchdog thread has to say it fired.
GIL_GRACE_S = 3.0
#: How long after the watchdog fired the test has to finish.
HARD_GRACE_S = 20.0
#: The last-resort capture may take this much longer than a capture's own budget (native
#: stacks through pystack or py-spy take about 2 s), then the tree is killed all the same.
CAPTURE_EXTRA_S = 8.0
#: The monitor looks at the deadline board (and at its parent) at least this often.
POLL_S = 0.5


def _take_over(
    pytest_pid: int,
    dump_dir: str,
    report_dir: str,
    armed: tuple[float, float, frozenset[tuple[int, int]], str],
    fired: bool,
    spare_root: bool,
) -> None:
    import site

    # The session's end must not cut the last-resort report short (stop() kills after a grace)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    site.main()  # started with -S (a fast start): the capture needs site-packages (psutil)
    from ..capture.pipeline import CaptureTarget, capture, kill
    from ..capture.procfs import call_with_timeout
    from ..report.model import HangReport, Hint

    deadline, timeout, before, test_id = armed
    target = CaptureTarget(
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
            elapsed_s=clock.monotonic() - target.started,
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
        name = f"session-stop-{pytest_pid}-{int(clock.wall())}.json"
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
    earliest = clock.monotonic() + GIL_GRACE_S
    while True:
        current = board.read()
        if current is None or (fired is not None and fired[0] != current[0]):
            fired = None  # disarmed, or a new deadline since: an earlier fire no longer counts
        due = None
        if current is not None:
            due = fired[1] + HARD_GRACE_S if fired is not None else current[1] + GIL_GRACE_S
            due = max(due, earliest)
        now = clock.monotonic()
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
                    clock.sleep(0.2)  # until the host moves on to another deadline
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
                        fired = (armed_now[0], clock.monotonic())

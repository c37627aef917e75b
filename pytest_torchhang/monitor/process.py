"""The monitor process: the last resort, acting when the pytest process cannot.

The watchdog thread needs the GIL, and a test's thread takes its interrupt only when it runs
Python code. If a thread holds the GIL in C code, or the test's thread sits in a call that no
signal interrupts, the monitor, told of each deadline through the page and of each fire through
a pipe, captures every stack from outside (the pytest process answers the dump signal in C,
without the GIL), prints the report to the terminal pytest started on, writes the JSON report,
and kills the whole tree, pytest included. It says why only as far as ``evidence.py`` shows it.
A pytest stopped by job control (Ctrl-Z) is paused, not hung: the monitor holds while it is
stopped, logs the stop on the page for the watchdog, and moves its own deadline on by it.
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
from . import evidence
from .page import DeadlineBoard

#: How long after the deadline the watchdog thread has to say it fired ...
GIL_GRACE_S = 3.0
#: ... or, once it has begun to act (it loads its cold path seconds before the first deadline,
#: checks for a debugger, then fires), how long it has from then: on a loaded machine the
#: import alone took 3.5 s, and a session ended for that would be a false verdict.
BUSY_GRACE_S = 20.0
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
    seen: evidence.Evidence,
    spare_root: bool,
) -> None:
    import site

    # The session's end must not cut the last-resort report short (stop() kills after a grace)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    site.main()  # started with -S (a fast start): the capture needs site-packages (psutil)
    from ..capture.procfs import call_with_timeout
    from ..hang.path import CaptureTarget, capture, kill
    from ..hang.reports import last_resort_failed
    from ..report.model import Hint
    from ..report.text import to_text

    deadline, timeout, before, test_id = armed
    target = CaptureTarget(
        test_id=test_id,
        timeout_s=timeout,
        root_pid=pytest_pid,
        dump_dir=dump_dir,
        started=deadline - timeout,
        exclude=frozenset({os.getpid()}),
        root_in_process=False,
        kill_root=not spare_root,
        # When the whole session goes down, its fixtures' processes go with it; a host program
        # that ran pytest in a thread keeps its session's processes.
        before=before if spare_root else None,
    )
    try:  # every step of a capture is bounded; their sum must be too, or the kill never comes
        report = call_with_timeout(target.capture_budget_s + CAPTURE_EXTRA_S, capture, target)
    except Exception as exc:
        report = last_resort_failed(target, exc)
    ending = (
        "pytest runs in a thread of a host program here, which pytest-torchhang never kills: the "
        "test's processes are killed, and the test stays blocked until that call returns"
        if spare_root
        else "pytest-torchhang ends the whole session here"
    )
    thread = "pytest thread" if spare_root else "main thread"
    call = "" if spare_root else evidence.the_call(report, pytest_pid, pytest_pid)
    report.hints.insert(
        0,
        Hint(evidence.sentence(seen, thread, call, ending), [f"pytest (pid {pytest_pid})"]),
    )
    if seen.why is not evidence.Why.UNINTERRUPTIBLE:  # the watchdog itself did not act
        note = evidence.own_thread_note(report, pytest_pid, seen.watchdog_tid)
        if note is not None:
            report.notes.append(note)
    banner = "!" * 30 + " pytest-torchhang: session stopped " + "!" * 30
    text = to_text(report).rsplit("\ncleanup:", 1)[0]  # printed before the kill: no cleanup yet
    victims = "the test's processes" if spare_root else "the whole tree, pytest included"
    sys.stderr.write(f"\n{banner}\n{text}\nkilling {victims}\n")
    sys.stderr.flush()  # before the kill: whoever waits for pytest reads this when it returns
    kill(target, report)
    sys.stderr.write(to_text(report).rsplit("\n", 1)[-1] + "\n")
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
    stops = _Stops(pytest_pid, board)
    counting: tuple[int, float] = (-1, 0.0)  # (generation, since when the monitor counts it)
    gil_looked = -float("inf")  # when the monitor last sampled a busy watchdog for the GIL
    while True:
        current = board.read()
        if current is None or (fired is not None and fired[0] != current[0]):
            fired = None  # disarmed, or a new deadline since: an earlier fire no longer counts
        now = clock.monotonic()
        resumed = stops.look(now)
        if resumed:  # the watchdog gets its grace from now, to move its deadline by the stop
            earliest = max(earliest, now + GIL_GRACE_S)
        due = None
        if current is not None:
            if counting[0] != current[0]:
                counting = (current[0], now - POLL_S)  # written since the last look
            since = fired[1] if fired is not None else counting[1]
            due = fired[1] + HARD_GRACE_S if fired is not None else current[1] + GIL_GRACE_S
            busy = board.busy_since() if fired is None else 0.0
            if busy:
                # at work on it, the watchdog gets longer, unless it is shown waiting for the
                # GIL (sampled once its plain grace is over, at most once a second)
                held = False
                if now >= due and now - gil_looked >= 1.0:
                    gil_looked, beat = now, board.last_beat()
                    held = beat is not None and evidence.waits_for_gil(
                        *evidence.sample_gil(pytest_pid, beat[0])
                    )
                if not held:
                    due = max(due, busy + BUSY_GRACE_S)
            # a stopped pytest is paused, not hung: its deadline moves on by the stop
            due = max(due + board.stopped_between(since, now), earliest)
        if current is not None and due is not None and now >= due and not stops.stopped:
            deadline, timeout_s, before, test_id = current[1:]
            seen = evidence.gather(
                pytest_pid, fired is not None, deadline, board.last_beat(), board.busy_since()
            )
            _take_over(
                pytest_pid,
                dump_dir,
                report_dir,
                (deadline, timeout_s, before, test_id),
                seen,
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


class _Stops:
    """Whether pytest is stopped by job control (Ctrl-Z, SIGSTOP) or a debugger, logged on the
    page for its watchdog: a stop is logged from the last look that saw pytest running to the
    first that sees it running again (at most a look's interval too long on each side)."""

    def __init__(self, pytest_pid: int, board: DeadlineBoard) -> None:
        self._pid = pytest_pid
        self._board = board
        self._running_at = clock.monotonic()
        self._state = ""
        self.stopped = False

    def look(self, now: float) -> bool:
        """Read pytest's state; True when it runs again after a stop."""
        state, before = evidence.state_of(self._pid), self._state
        self._state = state
        stopped = evidence.is_stopped(state, before)
        if stopped and not self.stopped:
            self._board.stop_began(self._running_at)
        elif self.stopped and not stopped:
            self._board.stop_ended(now)
        resumed = self.stopped and not stopped
        self.stopped = stopped
        if not stopped:
            self._running_at = now
        return resumed

"""One pytest session's guard: its tests' deadlines, its helpers, and what its tests left running."""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import pytest

from . import clock, deadline, settings

# The guard's own modules are imported when a test is first guarded (a session without a
# timeout never pays for them), and the cold path (psutil, the capture, the diagnosis, the
# report's rendering, the runner) only when it is used: most sessions never capture anything.
if TYPE_CHECKING:
    from .capture.target import Births, CaptureTarget
    from .inject import beats
    from .monitor.client import MonitorClient
    from .report.model import HangReport
    from .runner import client
    from .watchdog import TestDeadline, Watchdog

#: How long a test report waits for a capture in progress (capture + kill) to finish.
PIPELINE_WAIT_S = 30.0

DEADLINE = pytest.StashKey["TestDeadline"]()
#: At an arm, the monitor (the GIL backstop) is checked alive (a waitpid) at most this often.
MONITOR_CHECK_S = 1.0


def xdist_worker(config: pytest.Config) -> str | None:
    """This process's pytest-xdist worker id (not an inherited variable: pytester sessions
    started from a worker are not workers)."""
    workerinput = getattr(config, "workerinput", None)
    return str(workerinput["workerid"]) if workerinput else None


@dataclass
class SessionState:
    """Per-config state of the guard, kept in the config's stash."""

    config: pytest.Config
    settings: settings.SessionSettings
    stderr_fd: int
    #: pytest runs in a thread of a host program (an IDE, ``pytest.main`` in a thread)
    in_thread: bool = field(
        default_factory=lambda: threading.current_thread() is not threading.main_thread()
    )
    dump_dir: str | None = None
    watchdog: Watchdog | None = None
    monitor: MonitorClient | None = None
    current: TestDeadline | None = None
    hangs: list[tuple[str, str]] = field(default_factory=list)  # (nodeid, headline)
    hang_files: int = 0
    #: processes that guarded tests started and left running, killed at session end
    started_by_tests: set[tuple[int, int]] = field(default_factory=set)
    leftovers: list[str] = field(default_factory=list)  # what was killed at the end, described
    notes: list[str] = field(default_factory=list)  # the guard's own troubles, said once
    subprocess_runner: client.Runner | None = None
    #: the workers of pools that wider-scoped fixtures' values own now (``fixtures.py``): the
    #: fixtures' to stop, not left running by the test during which they started
    pools: Callable[[], Births] | None = None
    #: given to every deadline: at a fire, marks those workers as spared (``fixtures.py``)
    before_capture: Callable[[CaptureTarget], CaptureTarget] | None = None
    _boards: int = 0  # progress boards made so far: each test gets a new file
    #: What ran before the current run of consecutive guarded tests (one walk of /proc when
    #: the run begins), and the processes wider fixtures started since: context for each of
    #: them. None: no such run is open (the next guarded test opens one).
    _context: Births | None = None
    _monitor_checked: float = -1.0  # when the monitor was last seen alive (at an arm)
    #: pool workers of wider fixtures torn down during the run: theirs, not left by a test
    _pool_births: Births = frozenset()

    def get_runner(self) -> client.Runner:
        """The subprocess runner (and its zygote), created on first use."""
        if self.subprocess_runner is None:
            from .runner import client

            self.subprocess_runner = client.Runner(self.paused_deadline, self._stopped_between)
            if self.dump_dir is not None:
                self.subprocess_runner.use_dump_dir(self.dump_dir)
        return self.subprocess_runner

    def _stopped_between(self, since: float, now: float) -> float:
        """How long this process was stopped (Ctrl-Z) between two times, as the monitor saw."""
        return self.monitor.board.stopped_between(since, now) if self.monitor is not None else 0.0

    def own_pids(self, start: bool = True, wait: bool = True) -> set[int]:
        """The plugin's own processes: never part of a test's tree. ``wait``: for the monitor's
        start in flight, if any (an arm does not: its monitor is excluded again at a fire)."""
        pids = self.subprocess_runner.helper_pids() if self.subprocess_runner is not None else set()
        if self.monitor is not None:
            if start:
                pid: int | None = self.monitor.ensure_started()
            else:
                pid = self.monitor.settled_pid() if wait else self.monitor.pid
            if pid is not None:
                pids.add(pid)
        return pids

    def activate(self) -> Watchdog:
        """First guarded test: join the process-wide guard, start the watchdog and monitor."""
        if self.watchdog is not None:
            return self.watchdog
        from . import processwide
        from .monitor.client import MonitorClient
        from .watchdog import Watchdog

        self.dump_dir = processwide.acquire(self._take_error)
        if self.subprocess_runner is not None:
            self.subprocess_runner.use_dump_dir(self.dump_dir)
        self.monitor = MonitorClient(
            self.dump_dir, self.stderr_fd, self.settings.report_dir, spare_root=self.in_thread
        )
        self.monitor.start_soon()  # the session goes on meanwhile: nothing here waits for it
        self.watchdog = Watchdog(self.monitor, lambda: self.own_pids(start=False), self.notes)
        if self.in_thread:
            self.notes.append(
                "pytest runs in a thread other than the main one here, where no signal can "
                "interrupt it: a hung test is reported and its processes killed, and it fails "
                "when its thread next runs Python code (an asynchronous exception); a call that "
                "never returns keeps it blocked, and the host process is never killed"
            )
        return self.watchdog

    def _open_context(self) -> Births:
        """What ran before the current run of guarded tests: read once, when the run begins.

        A passing guarded test reads nothing of /proc. Ownership is settled at a fire instead
        (``_at_fire``): what the run's snapshot holds, and what was born before the test was
        armed (by its start time), is context; the rest of the tree is the test's.
        """
        if self._context is None:
            from .capture import tree

            self._context = tree.births(os.getpid(), self._monitor_pid())
        return self._context

    def end_guarded_run(self) -> None:
        """The run of guarded tests is over (an unguarded test follows, or the session ends):
        what its tests started and left running is noted, to be killed at the session's end.
        One walk of /proc per run of guarded tests, not per test."""
        context, self._context = self._context, None
        if context is None:
            return
        if self.watchdog is not None:
            self.watchdog.idle()  # the monitor's page: a passing test left its deadline on it
        from .capture import tree

        own = self.own_pids(start=False)
        now = tree.births(os.getpid(), self._monitor_pid())
        started = {birth for birth in now - context if birth[0] not in own}
        if started and self.pools is not None:
            started -= self.pools() | self._pool_births
        self._pool_births = frozenset()
        self.started_by_tests |= started

    def wider_fixture_ends(self) -> None:
        """A wider fixture is torn down: the workers of its value's pools are its own, not left
        running by the test during which they started (``end_guarded_run`` no longer sees it)."""
        if self._context is not None and self.pools is not None:
            self._pool_births |= self.pools()

    def _at_fire(self, held: TestDeadline, target: CaptureTarget) -> CaptureTarget:
        """On the watchdog's thread, at a fire of ``held``: what ran before the test becomes
        ``target.before`` (the context: captured, never killed): the run's snapshot, what wider
        fixtures started, and every descendant born before the test was armed (earlier tests of
        the run left it running: it is theirs, killed at the session's end). A process born in
        the clock tick (10 ms) of the arm and not in the snapshot counts as the test's: it was
        started by this test or by the guarded test just before it, and either way it is killed
        by the plugin (now, or at the session's end)."""
        from .capture import tree

        context = target.before or frozenset()
        earlier = tree.born_before(
            tree.births(os.getpid(), self._monitor_pid()) - context, held.arm_ticks
        )
        target = replace(target, before=context | earlier)
        if self.before_capture is not None:
            target = self.before_capture(target)
        return target

    def _monitor_pid(self) -> tuple[int, ...]:
        pid = self.monitor.pid if self.monitor is not None else None
        return (pid,) if pid is not None else ()

    def _take_error(self) -> BaseException | None:
        current = self.current
        return current.take_error() if current is not None else None

    def arm(
        self,
        item: pytest.Item,
        timeout_s: float,
        stall_s: float = 0.0,
        source: deadline.Source = deadline.Source.TIMEOUT,
    ) -> TestDeadline:
        """Put ``item`` under a limit of ``timeout_s`` from now, from ``source`` (a test already
        armed gets one more limit: the earliest due fires), and, with ``stall_s``, under stall
        detection: fail after that long without progress."""
        watchdog = self.activate()
        held = item.stash.get(DEADLINE, None)
        if held is not None:
            held.feed(deadline.SetLimit(source, timeout_s))  # the fire reads the timeout there
            watchdog.arm(held)
            return held
        from .capture.target import CaptureTarget
        from .watchdog import TestDeadline

        # the plugin's own set-up (the run's context from /proc, the progress board) first:
        # the test's clocks start after it
        context = self._open_context()
        board = self._progress_board() if stall_s > 0 else None
        now = clock.monotonic()
        if now - self._monitor_checked >= MONITOR_CHECK_S:
            self._monitor_checked = now
            restarted = self.monitor.check() if self.monitor is not None else None
            if restarted:
                self.notes.append(restarted)
        state = deadline.start(now, {source: timeout_s}, stall_s)
        worker = xdist_worker(item.config)
        target = CaptureTarget(
            test_id=item.nodeid,
            timeout_s=state.timeout_s,
            root_pid=os.getpid(),
            dump_dir=self.dump_dir,
            started=now,
            exclude=frozenset(self.own_pids(start=False, wait=False)),  # the monitor's: at a fire
            shm_since=clock.wall(),
            native=self.settings.native,
            before=context,  # the rest of it is settled at a fire
            root_role=f"pytest (xdist worker {worker})" if worker else "pytest",
        )
        held = TestDeadline(target, state, threading.get_ident(), item=item)
        held.arm_ticks = clock.boot_ticks()  # ownership, settled at a fire by start times
        held.before_capture = functools.partial(self._at_fire, held)
        held.board = board
        item.stash[DEADLINE] = held
        self.current = held
        held.start(now)  # the model's first wake time: nobody else holds the deadline yet
        watchdog.arm(held, check=False)
        return held

    @contextlib.contextmanager
    def fixture_processes(self) -> Iterator[None]:
        """Count what starts meanwhile (a higher-scoped fixture's setup) as context."""
        from .capture import tree

        me = os.getpid()
        before = tree.births(me)
        try:
            yield
        finally:
            new = tree.births(me) - before
            held = self.current
            if new and self._context is not None:
                self._context = self._context | new  # context for the later tests of the run
            if new and held is not None:
                with held.locked():  # a fire may make the capture's target from it meanwhile
                    before = (held.target.before or frozenset()) | new
                    held.target = replace(held.target, before=before)
                if self.watchdog is not None:
                    self.watchdog.arm(held)  # the monitor learns of them too

    def disarm(self, held: TestDeadline) -> None:
        """Lift a deadline: after the test, or when a debugger takes over."""
        if self.watchdog is not None:
            self.watchdog.disarm(held)
        if self.current is held:
            self.current = None

    def _progress_board(self) -> beats.Reader:
        """A new progress board for the test about to run, named by the session's pointer:
        processes an earlier test left running keep beating into that test's board, never this
        one. The environment names the pointer from the first board to the session's end."""
        from .inject import beats  # only stall detection reads a board

        assert self.dump_dir is not None
        self._boards += 1
        return beats.new_board(self.dump_dir, self._boards)

    def finish(self, held: TestDeadline) -> None:
        """The test is over: lift its deadline (one event; nothing read of /proc)."""
        if held.board is not None:
            from .inject import beats

            beats.end_board(held.board)  # a capture still running reads its last state
        self.disarm(held)
        if held.fired:
            held.wait_for_capture(PIPELINE_WAIT_S)
        # what the test left running is noted when the run of guarded tests ends

    @contextlib.contextmanager
    def paused_deadline(self) -> Iterator[None]:
        """Stop the current test's clocks meanwhile (the zygote's start is the session's cost)."""
        held = self.current
        if held is None or self.watchdog is None:
            yield
            return
        self.pause(held)
        try:
            yield
        finally:
            self.resume(held)

    def pause(self, held: TestDeadline) -> None:
        """Stop ``held``'s clocks (pauses nest: a debugger while the zygote starts)."""
        held.feed(deadline.Pause())
        if self.watchdog is not None:
            self.watchdog.arm(held)

    def resume(self, held: TestDeadline) -> None:
        held.feed(deadline.Resume())
        if self.watchdog is not None:
            self.watchdog.arm(held)

    def json_path(self, hang: HangReport, nodeid: str) -> str | None:
        """Write the hang's JSON report when a report directory is configured."""
        if not self.settings.report_dir:
            return None
        self.hang_files += 1
        worker = xdist_worker(self.config) or "main"
        tag = f"{worker}-{os.getpid()}-{self.hang_files}"
        from .report import handoff

        return handoff.write_json(self.settings.report_dir, hang, nodeid, tag)

    def kill_leftovers(self) -> None:
        """Kill what guarded tests started and left running; never what they did not start."""
        self.end_guarded_run()
        if self.watchdog is None or not self.started_by_tests:
            return
        from .capture import tree

        me = os.getpid()
        alive = tree.births(me)
        seeds = alive & self.started_by_tests
        if not seeds:
            return
        from .processwide import forget_torn_out_modules

        forget_torn_out_modules()  # an inner pytester session may have torn the cold path out
        from .capture import kill

        theirs = tree.births_below(pid for pid, _ in seeds)
        own = self.own_pids(start=False)
        described = {}
        for proc in tree.descendants(me, own, alive - theirs):
            with contextlib.suppress(Exception):
                described[proc.pid] = " ".join(proc.cmdline())[:200]
        result = kill.kill_tree(me, exclude=own, before=alive - theirs)
        self.leftovers = [f"{p.pid}: {described.get(p.pid, '?')}" for p in result.killed]
        # what they made and held (a DataLoader worker's resource_sharer listener and pymp dir)
        kill.remove_leftovers(result, living=[me])

    def close(self) -> None:
        if self.subprocess_runner is not None:
            self.subprocess_runner.close()
        if self.watchdog is None:
            return
        from . import processwide
        from .capture import procfs

        self.watchdog.stop()
        if self.monitor is not None:
            self.monitor.stop()
        if self._boards and self.dump_dir is not None:
            from .inject import beats

            beats.end_session(self.dump_dir)
        processwide.release(self._take_error)
        if procfs.children(os.getpid()):  # orphans adopted as their subreaper may be left
            from .processwide import forget_torn_out_modules

            forget_torn_out_modules()  # an inner pytester session may have torn them out
            from .capture import kill  # the cold path: psutil; most sessions never need it

            kill.reap_orphans()

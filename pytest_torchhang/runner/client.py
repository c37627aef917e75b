"""Run picklable callables in child processes under a deadline: result, exception, crash or hang.

Children start from a warm zygote by default (torch imported once per session, a fork per run),
or with ``spawn`` / ``forkserver``. Outcomes travel through files (see ``child.py``). A hang is
handled by the same guard pipeline as a hung test: every process of the children's trees is
captured, labelled and killed.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import psutil

from .. import clock, processwide
from ..capture.target import CaptureTarget
from ..capture.tree import ProcessId, same_process
from ..exceptions import ChildCrashed, HangError, RemoteTraceback, add_note
from ..hang import path as hang_path
from ..inject import hook
from ..inject.protocol import DUMP_DIR_ENV, STRESS_ENV
from ..processwide import end_helper
from ..report.model import HangReport
from ..report.text import to_text
from .child import Outcome

START_METHODS = ("zygote", "spawn", "forkserver")
#: How long the zygote may take to import torch and say READY.
ZYGOTE_START_S = 120.0
#: How long one fork request may take to be answered.
ZYGOTE_FORK_S = 10.0
_INJECT_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "inject", "site"
)


def signal_description(code: int) -> str:
    """``SIGSEGV`` for -11; SIGKILL also says who usually sends it."""
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    if name == "SIGKILL":
        name += " (possibly the OOM killer)"
    return name


class Zygote:
    """The client of one zygote process (see ``zygote.py``)."""

    def __init__(self, env: dict[str, str]) -> None:
        # Started from the launcher thread: the zygote dies with its parent (PR_SET_PDEATHSIG),
        # which is the thread that started it, and a user's thread may end at any time.
        self.proc = processwide.launch(
            lambda: subprocess.Popen(
                [sys.executable, "-m", "pytest_torchhang.runner.zygote"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
                start_new_session=True,  # Ctrl-C in the terminal is pytest's, not the zygote's
            )
        )
        self._buffer = b""
        self.exits: dict[int, int] = {}
        self._pids: dict[str, int] = {}
        # Fixture calls may come from several threads at once: one reader of the event pipe
        # and one writer of requests at a time.
        self._lock = threading.RLock()
        self._wait_for(lambda: self._ready, ZYGOTE_START_S, "to start (import torch)")

    _ready = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _pump(self, timeout: float) -> None:
        with self._lock:
            self._pump_locked(timeout)

    def _pump_locked(self, timeout: float) -> None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], max(timeout, 0.0))
        if not ready:
            return
        data = os.read(fd, 65536)
        if not data:
            raise RuntimeError("the pytest-torchhang zygote exited unexpectedly")
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            # "PID <request path> <pid>": the path may hold spaces (a TMPDIR with one)
            kind, _, rest = line.decode().partition(" ")
            if kind == "READY":
                self._ready = True
            elif kind == "PID":
                request, _, pid = rest.rpartition(" ")
                self._pids[request] = int(pid)
            elif kind == "EXIT":
                pid, _, code = rest.partition(" ")
                self.exits[int(pid)] = int(code)

    def _wait_for(self, done: Any, timeout: float, what: str) -> None:
        deadline = clock.monotonic() + timeout
        while not done():
            remaining = deadline - clock.monotonic()
            if remaining <= 0 or not self.alive():
                raise RuntimeError(
                    f"the pytest-torchhang zygote did not manage {what} in {timeout:.0f}s"
                )
            self._pump(min(remaining, 0.5))

    def fork(self, request_path: str) -> int:
        assert self.proc.stdin is not None
        with self._lock:
            self.proc.stdin.write(request_path.encode() + b"\n")
            self.proc.stdin.flush()
        self._wait_for(lambda: request_path in self._pids, ZYGOTE_FORK_S, "to fork a child")
        with self._lock:
            return self._pids.pop(request_path)

    def take_exit(self, pid: int) -> int | None:
        """The exit code of child ``pid`` once the zygote reported it (once)."""
        with self._lock:
            return self.exits.pop(pid, None)

    def poll(self) -> None:
        """Read whatever events are there, without blocking."""
        if self.alive():
            self._pump(0)

    def wait_event(self, timeout: float) -> None:
        """Block until the zygote says something (an exit), at most ``timeout`` seconds."""
        if self.alive():
            self._pump(timeout)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        end_helper(self.proc, 3.0)
        with contextlib.suppress(OSError):
            if self.proc.stdout is not None:
                self.proc.stdout.close()


@dataclass
class Child:
    """One started child and where its outcome will appear."""

    ident: ProcessId
    role: str
    method: str
    result_path: str
    crash_path: str
    output_path: str
    popen: subprocess.Popen[bytes] | None = None
    mp_process: Any = None
    exitcode: int | None = None
    outcome: Outcome | None = None
    started: float = field(default_factory=clock.monotonic)
    ended: float = float("inf")

    @property
    def pid(self) -> int:
        return self.ident.pid


class Runner:
    """The session's subprocess runner: one work directory, one zygote started on first use."""

    _ids = itertools.count()

    def __init__(
        self,
        pause_deadline: Callable[[], AbstractContextManager[None]] | None = None,
        stopped_between: Callable[[float, float], float] | None = None,
    ) -> None:
        self.workdir = tempfile.mkdtemp(prefix="torchhang-run-")
        self.dump_dir = os.path.join(self.workdir, "dumps")
        os.mkdir(self.dump_dir)
        self._zygote: Zygote | None = None
        self._lock = threading.Lock()  # one zygote, whichever thread calls first
        # The zygote's start (an import of torch, seconds) is the session's cost, not the test's
        # that happens to need it first: its deadline is paused meanwhile.
        self._pause_deadline = pause_deadline or contextlib.nullcontext
        #: how long pytest was stopped (Ctrl-Z) between two times: a call's deadline moves on
        #: by it, as the test's does (the monitor's log; read only when a call's time is up)
        self.stopped_between = stopped_between or _never_stopped

    def use_dump_dir(self, dump_dir: str) -> None:
        """Have children dump their stacks (and state their roles) into the guard's directory,
        so a hang of the whole test, not only of one call, finds them (a stall, a timeout)."""
        self.dump_dir = dump_dir

    def live_zygote(self) -> Zygote | None:
        return self._zygote if self._zygote is not None and self._zygote.alive() else None

    def helper_pids(self) -> set[int]:
        """Processes of the runner itself, never part of a test's tree."""
        return {self._zygote.pid} if self._zygote is not None and self._zygote.alive() else set()

    def _child_env(self, extra: dict[str, str | None] | None = None) -> dict[str, str]:
        """This process's environment now, with the dump hook's variables and ``extra``."""
        env = dict(os.environ)
        env[DUMP_DIR_ENV] = self.dump_dir
        path = env.get("PYTHONPATH", "")
        if _INJECT_DIR not in path.split(os.pathsep):
            env["PYTHONPATH"] = _INJECT_DIR + (os.pathsep + path if path else "")
        for key, value in hook.guarded_env().items():
            env.setdefault(key, value)
        for key, wanted in (extra or {}).items():
            if wanted is None:
                env.pop(key, None)
            else:
                env[key] = wanted
        return env

    def zygote(self) -> Zygote:
        """The zygote, (re)started when needed: a dead one is replaced, never reused."""
        with self._lock:
            if self._zygote is None or not self._zygote.alive():
                if self._zygote is not None:
                    self._zygote.close()
                with self._pause_deadline():
                    # never stressed itself (a hunt's stressed run may start it): its
                    # children are, through their request's environment
                    self._zygote = Zygote(self._child_env({STRESS_ENV: None}))
            return self._zygote

    def start(
        self,
        fn: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        method: str,
        role: str,
        env: dict[str, str | None] | None = None,
    ) -> Child:
        """Start one child running ``fn(*args, **kwargs)``; pickling errors are raised here."""
        if method not in START_METHODS:
            raise ValueError(
                f"start_method must be one of {', '.join(START_METHODS)}, got {method!r}"
            )
        payload = pickle.dumps((fn, args, kwargs))
        base = os.path.join(self.workdir, f"{os.getpid()}-{next(self._ids)}")
        # The zygote's environment was fixed when it started: the child gets the calling test's
        # own, as it is now (monkeypatch.setenv, a marker's CUDA_VISIBLE_DEVICES), as a spawned
        # child would, plus the call's ``env``.
        child_env = self._child_env(env)
        request = self._write_request(base, payload, role, child_env)
        popen = mp_process = None
        if method == "zygote":
            pid = self.zygote().fork(request)
        elif method == "spawn":
            popen = subprocess.Popen(
                [sys.executable, "-m", "pytest_torchhang.runner.child", request], env=child_env
            )
            pid = popen.pid
        else:
            mp_process = _forkserver_process(request, role)
            pid = mp_process.pid
        try:
            ident = ProcessId(pid, psutil.Process(pid).create_time())
        except psutil.Error:
            ident = ProcessId(pid, 0.0)
        return Child(
            ident,
            role,
            method,
            f"{base}.result",
            f"{base}.crash",
            f"{base}.out",
            popen=popen,
            mp_process=mp_process,
        )

    def _write_request(self, base: str, payload: bytes, role: str, env: dict[str, str]) -> str:
        """The request file a child reads: where to answer, its world, then the job itself."""
        main = sys.modules.get("__main__")
        main_path = getattr(main, "__file__", None) if b"__main__" in payload else None
        header = (
            f"{base}.result",
            f"{base}.crash",
            self.dump_dir,
            role,
            env,
            list(sys.path),
            os.getcwd(),
            f"{base}.out",
            main_path,
        )
        request = f"{base}.request"
        with open(request, "wb") as out:
            pickle.dump(header, out)
            out.write(payload)
        return request

    def poll(self, child: Child) -> bool:
        """True once the child has exited (its exit code and outcome are then set)."""
        if child.exitcode is not None:
            return True
        code: int | None = None
        if child.popen is not None:
            code = child.popen.poll()
        elif child.mp_process is not None:
            code = child.mp_process.exitcode
        elif self._zygote is not None:
            self._zygote.poll()
            code = self._zygote.take_exit(child.pid)
            if code is None and not self._zygote.alive():
                code = -signal.SIGKILL  # the zygote died and took its children along
        if code is None:
            return False
        child.exitcode = code
        child.ended = min(child.ended, clock.monotonic())
        self.peek(child)
        return True

    def peek(self, child: Child) -> Outcome | None:
        """The child's outcome as soon as it is written, even while the child still runs."""
        if child.outcome is None and os.path.exists(child.result_path):
            with (
                contextlib.suppress(OSError, EOFError, pickle.UnpicklingError),
                open(child.result_path, "rb") as raw,
            ):
                child.outcome = pickle.load(raw)
                child.ended = min(child.ended, clock.monotonic())
        return child.outcome

    def failed(self, child: Child) -> bool:
        """The child raised (outcome written) or died without a result."""
        outcome = self.peek(child)
        if outcome is not None:
            return not outcome.ok
        return self.poll(child)

    def is_running(self, child: Child) -> bool:
        if self.poll(child):
            return False
        try:
            return same_process(psutil.Process(child.pid), child.ident)
        except psutil.Error:
            return False

    def output(self, child: Child) -> str:
        with contextlib.suppress(OSError), open(child.output_path, errors="replace") as out:
            return out.read()
        return ""

    def forget(self, children: list[Child]) -> None:
        """Remove the files of calls that are over (a long session makes thousands)."""
        for child in children:
            base = child.result_path[: -len(".result")]
            for suffix in (".request", ".result", ".crash", ".out"):
                with contextlib.suppress(OSError):
                    os.unlink(base + suffix)

    def close(self) -> None:
        if self._zygote is not None:
            self._zygote.close()
            self._zygote = None
        shutil.rmtree(self.workdir, ignore_errors=True)


class _ForkserverPreload:
    """Whether this process set the forkserver's preload (there is one forkserver a process).

    Remembered here because multiprocessing has no public way to ask whether its forkserver
    runs; a preload set after its start only applies to a restarted server, so setting it once,
    at the first forkserver run, is what matters.
    """

    lock: ClassVar[threading.Lock] = threading.Lock()
    done: ClassVar[bool] = False


def _forkserver_process(request: str, role: str) -> Any:
    """A started ``multiprocessing`` forkserver Process that runs ``request``."""
    import multiprocessing

    from .child import run_request

    context = multiprocessing.get_context("forkserver")
    with _ForkserverPreload.lock:
        if not _ForkserverPreload.done:
            # let the server import torch once instead of every child
            context.set_forkserver_preload(["torch", "pytest_torchhang.runner.child"])
            _ForkserverPreload.done = True
    process = context.Process(target=run_request, args=(request,), name=role, daemon=False)
    process.start()
    assert process.pid is not None
    return process


def _never_stopped(since: float, now: float) -> float:
    return 0.0


def wait(runner: Runner, children: list[Child], timeout: float, *, stop_on_error: bool) -> float:
    """Wait (bounded) until every child exits, or one fails when ``stop_on_error``.

    Returns the time left (<= 0: the deadline passed with children still running).
    """
    counted = clock.monotonic()  # stops of pytest (Ctrl-Z) before this are in the deadline
    deadline = counted + timeout
    delay = 0.001
    while True:
        running = [c for c in children if not runner.poll(c)]
        if not running:
            return deadline - clock.monotonic()
        if stop_on_error and any(runner.failed(c) for c in children):
            return deadline - clock.monotonic()
        now = clock.monotonic()
        left = deadline - now
        if left <= 0:
            stopped, counted = runner.stopped_between(counted, now), now
            if stopped <= 0:
                return left
            deadline += stopped  # paused, not hung: the call's clock stood still meanwhile
            continue
        zygote = runner.live_zygote()
        if zygote is not None and all(c.method == "zygote" for c in running):
            zygote.wait_event(min(0.05, left))  # returns as soon as the zygote reports an exit
        else:
            clock.sleep(min(delay, left))
            delay = min(delay * 2, 0.02)


def _target(
    runner: Runner,
    live: list[Child],
    label: str,
    timeout: float,
    native: bool,
    started: float | None = None,
) -> CaptureTarget:
    """The trees of ``live`` children, roots included, never the runner's own zygote; the
    call began at ``started`` (clock time; now when None)."""
    return CaptureTarget(
        test_id=label,
        timeout_s=timeout,
        root_pid=os.getpid(),
        dump_dir=runner.dump_dir,
        started=clock.monotonic() if started is None else started,
        roots=[c.pid for c in live],
        exclude=frozenset(runner.helper_pids()),
        root_in_process=False,
        kill_root=True,
        root_role="",
        native=native,
    )


def hang_report(
    runner: Runner, children: list[Child], label: str, timeout: float, native: bool = False
) -> HangReport:
    """Capture and kill the trees of ``children`` that still run; the report says where they were."""
    live = [c for c in children if runner.is_running(c)]
    started = min(c.started for c in children)
    report = hang_path.capture_and_kill(_target(runner, live, label, timeout, native, started))
    _reap(runner, live)
    return report


def stop(runner: Runner, children: list[Child]) -> None:
    """Kill (identity-checked, with their trees) the children that still run, and reap them."""
    live = [c for c in children if runner.is_running(c)]
    if not live:
        return
    hang_path.kill(_target(runner, live, "", 0.0, False))
    _reap(runner, live)


def _reap(runner: Runner, children: list[Child]) -> None:
    # Polled on the plugin's clock: Popen.wait and Process.join count their timeouts on a clock
    # a test may have frozen (freezegun replaces subprocess's bound monotonic; a monkeypatched
    # time.monotonic stops multiprocessing's), and would then wait for ever.
    deadline = clock.monotonic() + 2.0
    for child in children:
        while not runner.poll(child) and clock.monotonic() < deadline:
            clock.sleep(0.005)


def raise_outcome(runner: Runner, child: Child) -> Any:
    """The child's result, or its exception (with the remote traceback), or ChildCrashed."""
    outcome = child.outcome
    if outcome is not None and outcome.ok:
        return outcome.value
    if outcome is not None:
        exc = (
            outcome.value
            if isinstance(outcome.value, BaseException)
            else RuntimeError(f"{outcome.exc_type}: {outcome.exc_message}")
        )
        exc.__cause__ = RemoteTraceback(outcome.traceback)
        add_note(exc, f"raised in {child.role} (pid {child.pid}); its traceback is shown above")
        raise exc
    code = child.exitcode if child.exitcode is not None else -signal.SIGKILL
    crash = ""
    with contextlib.suppress(OSError), open(child.crash_path, errors="replace") as trace:
        crash = trace.read()
    if code < 0:
        sig = signal_description(code)
        message = f"{child.role} (pid {child.pid}) was killed by {sig}"
        raise ChildCrashed(message, signal=sig.split()[0], exitcode=code, crash_trace=crash)
    raise ChildCrashed(
        f"{child.role} (pid {child.pid}) exited with code {code} without returning a result",
        exitcode=code,
        crash_trace=crash,
    )


def raise_hang(report: HangReport) -> None:
    raise HangError(to_text(report), report)

"""pytest hooks: options, markers, the per-test guard, and the hang's place in the test report."""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import pytest
from _pytest._code.code import TerminalRepr
from _pytest._io import TerminalWriter

from . import _hook, devices, fixtures, guard, proctree, runner, settings
from .exceptions import HangError
from .report import HangReport
from .watchdog import INTERRUPT_SIGNAL, ItemGuard, MonitorClient, Watchdog

#: After a session that had a hang, interpreter exit gets this long before it is forced.
EXIT_GRACE_S = 15.0
#: How long a test report waits for the guard pipeline (capture + kill) to finish.
PIPELINE_WAIT_S = 30.0
HANG_PROPERTY = "torch_hang"

_INJECT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_inject")


@dataclass
class _Session:
    """Per-config state of the plugin, kept in the config's stash."""

    config: pytest.Config
    settings: settings.SessionSettings
    stderr_fd: int
    dump_dir: str | None = None
    watchdog: Watchdog | None = None
    monitor: MonitorClient | None = None
    saved_env: dict[str, str | None] = field(default_factory=dict)
    hangs: list[tuple[str, str]] = field(default_factory=list)  # (nodeid, headline)
    hang_files: int = 0
    current: ItemGuard | None = None
    previous_interrupt: Any = None
    leftovers: list[str] = field(default_factory=list)  # what tests left running, killed at the end
    subprocess_runner: runner.Runner | None = None

    def get_runner(self) -> runner.Runner:
        """The subprocess runner (and its zygote), created on first use."""
        if self.subprocess_runner is None:
            self.subprocess_runner = runner.Runner(self.paused_deadline)
        return self.subprocess_runner

    def own_pids(self, start: bool = True) -> set[int]:
        """The plugin's own processes: never part of a test's tree."""
        pids = self.subprocess_runner.helper_pids() if self.subprocess_runner is not None else set()
        if self.monitor is not None:
            pid = self.monitor.ensure_started() if start else self.monitor.pid
            if pid is not None:
                pids.add(pid)
        return pids

    def activate(self) -> Watchdog:
        """First guarded test: start the watchdog, the dump hook, the subreaper (once a session)."""
        if self.watchdog is not None:
            return self.watchdog
        self.dump_dir = tempfile.mkdtemp(prefix="torchhang-")
        self.monitor = MonitorClient(self.dump_dir, self.stderr_fd, self.settings.report_dir)
        self.monitor.ensure_started()
        self.watchdog = Watchdog(self.monitor, lambda: self.own_pids(start=False))
        _hook.install(self.dump_dir)
        proctree.become_subreaper()
        if threading.current_thread() is threading.main_thread():
            # One handler for the whole session: a late interrupt (the test ended just as the
            # watchdog fired) then finds no test in phase and does nothing, instead of meeting
            # the signal's default action, which would terminate pytest.
            self.previous_interrupt = signal.signal(INTERRUPT_SIGNAL, self._interrupt)
        for key, value in ((_hook.DUMP_DIR_ENV, self.dump_dir), ("PYTHONPATH", _pythonpath())):
            self.saved_env[key] = os.environ.get(key)
            os.environ[key] = value
        return self.watchdog

    @contextlib.contextmanager
    def paused_deadline(self) -> Iterator[None]:
        """Stop the current test's clock meanwhile (the zygote's start is the session's cost)."""
        held = self.current
        if held is None or held.fires or self.watchdog is None:
            yield
            return
        saved, started = held.deadline, time.monotonic()
        held.deadline = float("inf")
        self.watchdog.arm(held)
        try:
            yield
        finally:
            held.deadline = saved + (time.monotonic() - started)
            self.watchdog.arm(held)

    def _interrupt(self, signum: int, frame: FrameType | None) -> None:
        held = self.current
        if held is None or not held.in_phase or held.report is None:
            return
        held.raised = True
        raise HangError(held.report.headline, held.report)

    def write_json(self, hang: HangReport, nodeid: str) -> str | None:
        """One JSON file per hang in the report directory; names never collide under xdist."""
        report_dir = self.settings.report_dir
        if not report_dir:
            return None
        self.hang_files += 1
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid)[-120:]
        worker = _xdist_worker(self.config) or "main"
        path = os.path.join(report_dir, f"{safe}-{worker}-{os.getpid()}-{self.hang_files}.json")
        try:
            os.makedirs(report_dir, exist_ok=True)
            with open(path, "w") as out:
                json.dump(hang.to_json(), out, indent=1, default=str)
        except OSError as exc:  # a report that cannot be written must not end the session
            hang.notes.append(f"the JSON report could not be written to {path}: {exc}")
            return None
        return path

    def close(self) -> None:
        if self.subprocess_runner is not None:
            self.subprocess_runner.close()
        if self.watchdog is None:
            return
        self.watchdog.stop()
        if self.monitor is not None:
            self.monitor.stop()
        _hook.uninstall()
        if self.previous_interrupt is not None:
            signal.signal(INTERRUPT_SIGNAL, self.previous_interrupt)
        for key, value in self.saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if self.dump_dir:
            shutil.rmtree(self.dump_dir, ignore_errors=True)
        _reap_zombie_children()


def _xdist_worker(config: pytest.Config) -> str | None:
    """This process's pytest-xdist worker id (not an inherited variable: pytester sessions
    started from a worker are not workers)."""
    workerinput = getattr(config, "workerinput", None)
    return str(workerinput["workerid"]) if workerinput else None


def _pythonpath() -> str:
    current = os.environ.get("PYTHONPATH")
    return _INJECT_DIR + (os.pathsep + current if current else "")


def _reap_zombie_children() -> None:
    for _ in range(10_000):
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


@dataclass(frozen=True)
class _Crash:
    """What pytest's short summary and JUnit XML read from ``longrepr.reprcrash``."""

    message: str
    path: str = ""
    lineno: int = 0


class HangLongRepr(TerminalRepr):
    """A hang's ``longrepr``: the headline is the failure message, the report is the text."""

    def __init__(self, headline: str, text: str, path: str = "", lineno: int = 0) -> None:
        self.reprcrash = _Crash(headline, path, lineno)
        self.text = text

    def toterminal(self, tw: TerminalWriter) -> None:
        for number, line in enumerate(self.text.splitlines()):
            if number == 0:
                tw.line(line, red=True, bold=True)
            elif line.startswith("hint:"):
                tw.line(line, yellow=True, bold=True)
            else:
                tw.line(line)

    def __str__(self) -> str:
        return self.text


_SESSION = pytest.StashKey[_Session]()
_ITEM_SETTINGS = pytest.StashKey[settings.ItemSettings]()
_ITEM_GUARD = pytest.StashKey[ItemGuard]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("torch-hang", "hang detection for PyTorch multiprocess tests")
    group.addoption(
        settings.TIMEOUT_OPTION,
        dest="torch_hang_timeout",
        default=None,
        metavar="SECONDS",
        help="Fail a test that runs longer than SECONDS, with the stacks of every process in its "
        f"tree, then kill that tree; 0 turns it off (env {settings.TIMEOUT_ENV}, "
        f"ini {settings.TIMEOUT_INI})",
    )
    group.addoption(
        settings.REPORT_DIR_OPTION,
        dest="torch_hang_report_dir",
        default=None,
        metavar="DIR",
        help="Write one JSON report per hang into DIR",
    )
    group.addoption(
        settings.NATIVE_OPTION,
        dest="torch_hang_native",
        action="store_true",
        default=False,
        help="Add native stacks through py-spy where installed and permitted",
    )
    parser.addini(
        settings.TIMEOUT_INI, "Seconds before a test counts as hung (0 = off)", default=""
    )
    parser.addini(settings.REPORT_DIR_INI, "Directory for one JSON report per hang", default="")
    parser.addini(
        settings.NATIVE_INI, "Add native stacks through py-spy", type="bool", default=False
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{settings.MARKER}(timeout=None, isolate=False): bound this test by timeout seconds "
        "(0 = off) with pytest-torchhang; isolate=True runs it in a subprocess",
    )
    session_settings = settings.session_settings(config)  # raises a usage error when invalid
    config.stash[_SESSION] = _Session(config, session_settings, os.dup(2))
    config.pluginmanager.register(devices.DevicePlugin(config), "torchhang-devices")


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    state = config.stash.get(_SESSION, None)
    if state is None:
        return
    active = state.watchdog is not None
    state.close()
    main = threading.main_thread()
    blocking = [t for t in threading.enumerate() if t is not main and t.is_alive() and not t.daemon]
    if active and (state.hangs or blocking):
        # Python joins non-daemon threads at exit, and a test (hung or not) may have left one
        # blocked forever: bound the exit. The dump says which thread blocked it. The fd stays
        # open for that dump.
        faulthandler.dump_traceback_later(EXIT_GRACE_S, exit=True, file=state.stderr_fd)
    else:
        with contextlib.suppress(OSError):
            os.close(state.stderr_fd)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Kill what guarded tests left running, so nothing blocks exit or outlives the session."""
    state = session.config.stash.get(_SESSION, None)
    if state is None or state.watchdog is None:
        return
    own = state.own_pids(start=False)
    leftovers = [p for p in proctree.descendants(os.getpid(), own) if not proctree.is_zombie(p)]
    if not leftovers:
        return
    described = {}
    for proc in leftovers:
        with contextlib.suppress(Exception):
            described[proc.pid] = " ".join(proc.cmdline())[:200]
    result = proctree.kill_tree(os.getpid(), exclude=own)
    state.leftovers = [f"{p.pid}: {described.get(p.pid, '?')}" for p in result.killed]


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    # On a pytest-xdist worker a usage error raised during collection becomes an INTERNALERROR
    # that loses its message: there, a bad torch_hang marker fails its module's collection.
    report = yield
    if not hasattr(collector.config, "workerinput"):
        return report
    state = collector.config.stash[_SESSION]
    return settings.fail_collection_on_bad_markers(
        report, lambda item: settings.item_settings(item, state.settings), (pytest.UsageError,)
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    state = config.stash[_SESSION]
    for item in items:  # validate every marker now: a bad one is a usage error, not a late surprise
        item.stash[_ITEM_SETTINGS] = settings.item_settings(item, state.settings)


def _arm(item: pytest.Item, timeout_s: float) -> ItemGuard:
    """Put ``item`` under a deadline ``timeout_s`` from now (or tighten the one it has)."""
    state = item.config.stash[_SESSION]
    watchdog = state.activate()
    held = item.stash.get(_ITEM_GUARD, None)
    deadline = time.monotonic() + timeout_s
    if held is not None:
        if deadline < held.deadline and held.fires == 0:
            held.deadline = deadline
            held.target.timeout_s = min(held.target.timeout_s, timeout_s)
            watchdog.arm(held)
        return held
    target = guard.GuardTarget(
        test_id=item.nodeid,
        timeout_s=timeout_s,
        root_pid=os.getpid(),
        dump_dir=state.dump_dir,
        exclude=state.own_pids(),
        shm_baseline=proctree.shm_entries(),
        native=state.settings.native,
    )
    worker = _xdist_worker(item.config)
    if worker:
        target.root_role = f"pytest (xdist worker {worker})"
    held = ItemGuard(target, deadline, threading.get_ident(), item=item)
    item.stash[_ITEM_GUARD] = held
    state.current = held
    watchdog.arm(held)
    return held


def _disarm(item: pytest.Item) -> None:
    """Lift ``item``'s deadline: after the test, or when a debugger takes over."""
    held = item.stash.get(_ITEM_GUARD, None)
    state = item.config.stash[_SESSION]
    if held is None or held.disarmed:
        return
    held.disarmed = True
    if state.watchdog is not None:
        state.watchdog.disarm()
    state.current = None


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, object, object]:
    state = item.config.stash[_SESSION]
    item_settings = item.stash.get(_ITEM_SETTINGS, None) or settings.item_settings(
        item, state.settings
    )
    if item_settings.timeout > 0:
        _arm(item, item_settings.timeout)
    try:
        return (yield)
    finally:
        held = item.stash.get(_ITEM_GUARD, None)
        if held is not None:
            _disarm(item)
            if held.fires:
                held.done.wait(PIPELINE_WAIT_S)
            del item.stash[_ITEM_GUARD]


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: pytest-timeout may be disabled
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool:
    """Take over pytest-timeout's ``--timeout`` / ``@pytest.mark.timeout`` deadline.

    The test then gets the whole-tree report and cleanup instead of pytest-timeout's stack dump
    and ``os._exit`` (thread method) or bare SIGALRM (signal method). When both plugins set a
    timeout, the earlier deadline applies.
    """
    _arm(item, float(settings.timeout))
    return True


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> bool:
    # Our protocol wrapper lifts the deadline after teardown; here only pdb's post-mortem
    # (pytest-timeout calls this from pytest_exception_interact) matters, handled below.
    return True


def pytest_enter_pdb(config: pytest.Config) -> None:
    """No hang is declared, and nothing killed, while a user sits in the debugger."""
    state = config.stash.get(_SESSION, None)
    if state is not None and state.current is not None:
        item = state.current.item
        if item is not None:
            _disarm(item)


def pytest_exception_interact(node: pytest.Item | pytest.Collector) -> None:
    if isinstance(node, pytest.Item) and node.config.getvalue("usepdb"):
        _disarm(node)


def _phase(item: pytest.Item, name: str) -> Generator[None, object, object]:
    held = item.stash.get(_ITEM_GUARD, None)
    if held is None:
        return (yield)
    held.target.phase = name
    held.in_phase = True
    try:
        return (yield)
    finally:
        held.in_phase = False


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _phase(item, "setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _phase(item, "call"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, object, object]:
    return (yield from _phase(item, "teardown"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    held = item.stash.get(_ITEM_GUARD, None)
    if held is None or held.fires == 0 or held.attached:
        raised = call.excinfo.value if call.excinfo is not None else None
        if isinstance(raised, HangError) and raised.report is not None:
            _mark_hang(item, report, raised.report)  # from the fixture or an isolated test
        return report
    held.done.wait(PIPELINE_WAIT_S)
    hang = held.report
    if hang is None:
        return report
    held.attached = True
    _mark_hang(item, report, hang)
    return report


def _mark_hang(item: pytest.Item, report: pytest.TestReport, hang: HangReport) -> None:
    state = item.config.stash[_SESSION]
    path, lineno, _ = item.location
    report.outcome = "failed"
    properties = [
        (HANG_PROPERTY, "true"),
        ("torch_hang_timeout", f"{hang.timeout_s:g}"),
        ("torch_hang_processes", str(len(hang.processes))),
        ("torch_hang_headline", hang.headline),
    ]
    json_path = state.write_json(hang, item.nodeid)
    if json_path:
        properties.append(("torch_hang_report", json_path))
    report.longrepr = HangLongRepr(hang.headline, hang.to_text(), path, (lineno or 0) + 1)
    report.user_properties.extend(properties)
    if report.when != "teardown":
        # JUnit XML writes the properties of the teardown report, a copy of the item's
        item.user_properties.extend(properties)
    state.hangs.append((item.nodeid, hang.headline))


def _is_hang(report: pytest.TestReport | pytest.CollectReport) -> bool:
    return any(k == HANG_PROPERTY for k, _ in getattr(report, "user_properties", ()))


def _headline(report: pytest.TestReport) -> str:
    return str(next((v for k, v in report.user_properties if k == "torch_hang_headline"), ""))


@pytest.hookimpl(tryfirst=True)
def pytest_report_from_serializable(
    config: pytest.Config, data: dict[str, object]
) -> pytest.TestReport | None:
    """On the pytest-xdist controller, give a worker's hang report its headline back.

    A worker sends a hang's longrepr as plain text; rebuilt here, the controller's JUnit XML and
    short summary show the headline as the failure message, as they do without xdist.
    """
    if data.get("$report_type") != "TestReport":
        return None
    properties = data.get("user_properties")
    if not isinstance(properties, list) or not any(
        isinstance(p, (list, tuple)) and p and p[0] == HANG_PROPERTY for p in properties
    ):
        return None
    report = pytest.TestReport._from_json(data)
    if isinstance(report.longrepr, str):
        path, lineno, _ = report.location
        report.longrepr = HangLongRepr(_headline(report), report.longrepr, path, (lineno or 0) + 1)
    return report


def pytest_report_teststatus(
    report: pytest.TestReport, config: pytest.Config
) -> tuple[str, str, str] | None:
    if report.failed and _is_hang(report):
        # like any failure outside the test body, a hang in setup or teardown counts as an error
        category = "failed" if report.when == "call" else "error"
        return category, "H", ("HANG", {"red": True, "bold": True})  # type: ignore[return-value]
    return None


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config
) -> None:
    state = config.stash.get(_SESSION, None)
    if state is not None and state.leftovers:
        terminalreporter.write_sep("=", "torch-hang: processes left running by tests", yellow=True)
        for line in state.leftovers:
            terminalreporter.write_line(line)
        terminalreporter.write_line(
            f"killed {len(state.leftovers)} process(es) at session end (they would have blocked "
            "pytest's exit or outlived it)"
        )
    stats = terminalreporter.stats
    hangs = [r for r in stats.get("failed", []) + stats.get("error", []) if _is_hang(r)]
    if not hangs:
        return
    terminalreporter.write_sep("=", "torch-hang summary", red=True, bold=True)
    for report in hangs:
        terminalreporter.write_line(_headline(report))
    if os.environ.get("GITHUB_ACTIONS") == "true":
        for report in hangs:  # one annotation per hang, on the test's line
            path, lineno, _ = report.location
            message = _gh_data(f"{_headline(report)} (the job log has every process's stack)")
            terminalreporter.write_line(
                f"::error file={_gh_property(path)},line={(lineno or 0) + 1},title=HANG::{message}"
            )


def _gh_data(text: str) -> str:
    """Escape a workflow command's message (GitHub Actions' rules)."""
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _gh_property(text: str) -> str:
    """Escape a workflow command's property value (GitHub Actions' rules)."""
    return _gh_data(text).replace(":", "%3A").replace(",", "%2C")


def _deadline(item: pytest.Item) -> float | None:
    held = item.stash.get(_ITEM_GUARD, None)
    return held.deadline if held is not None else None


@pytest.fixture
def torch_hang(request: pytest.FixtureRequest) -> fixtures.TorchHang:
    """Run callables, DataLoader iterations and N-rank distributed steps in subprocesses.

    ``torch_hang.run(fn, *args, timeout=None, start_method=None, env=None, **kwargs)``,
    ``torch_hang.dataloader(dataset_or_factory, batches=None, ...)`` and
    ``torch_hang.distributed(fn, *args, world_size=2, backend=None, ...)``; see the README.
    """
    state = request.config.stash[_SESSION]
    node = request.node
    gpus = devices.leased_devices(node)
    return fixtures.TorchHang(
        state.get_runner, node.nodeid, lambda: _deadline(node), gpus, native=state.settings.native
    )


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    item_settings = pyfuncitem.stash.get(_ITEM_SETTINGS, None)
    if item_settings is None or not item_settings.isolate:
        return None
    state = pyfuncitem.config.stash[_SESSION]
    names = pyfuncitem._fixtureinfo.argnames
    funcargs = {name: pyfuncitem.funcargs[name] for name in names}
    deadline = _deadline(pyfuncitem)
    timeout = (
        max(deadline - time.monotonic() - fixtures.MARGIN_S, 0.1)
        if deadline is not None
        else fixtures.DEFAULT_TIMEOUT_S
    )
    fixtures.run_isolated(state.get_runner(), pyfuncitem.obj, funcargs, pyfuncitem.nodeid, timeout)
    return True

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
from collections.abc import Generator
from dataclasses import dataclass, field
from types import FrameType

import pytest

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
    subprocess_runner: runner.Runner | None = None

    def get_runner(self) -> runner.Runner:
        """The subprocess runner (and its zygote), created on first use."""
        if self.subprocess_runner is None:
            self.subprocess_runner = runner.Runner()
        return self.subprocess_runner

    def own_pids(self) -> set[int]:
        """The plugin's own processes: never part of a test's tree."""
        pids = self.subprocess_runner.helper_pids() if self.subprocess_runner is not None else set()
        if self.monitor is not None:
            pids.add(self.monitor.ensure_started())
        return pids

    def activate(self) -> Watchdog:
        """First guarded test: start the watchdog, the dump hook, the subreaper (once a session)."""
        if self.watchdog is not None:
            return self.watchdog
        self.dump_dir = tempfile.mkdtemp(prefix="torchhang-")
        self.monitor = MonitorClient(self.dump_dir, self.stderr_fd, self.settings.report_dir)
        self.monitor.ensure_started()
        self.watchdog = Watchdog(self.monitor, self._on_report)
        _hook.install(self.dump_dir)
        proctree.become_subreaper()
        for key, value in ((_hook.DUMP_DIR_ENV, self.dump_dir), ("PYTHONPATH", _pythonpath())):
            self.saved_env[key] = os.environ.get(key)
            os.environ[key] = value
        return self.watchdog

    def _on_report(self, item: ItemGuard) -> None:
        report_dir = self.settings.report_dir
        if report_dir and item.report is not None:
            os.makedirs(report_dir, exist_ok=True)
            self.hang_files += 1
            safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", item.target.test_id)[-120:]
            path = os.path.join(report_dir, f"{safe}-{os.getpid()}-{self.hang_files}.json")
            with open(path, "w") as out:
                json.dump(item.report.to_json(), out, indent=1, default=str)

    def close(self) -> None:
        if self.subprocess_runner is not None:
            self.subprocess_runner.close()
        if self.watchdog is None:
            return
        self.watchdog.stop()
        if self.monitor is not None:
            self.monitor.stop()
        _hook.uninstall()
        for key, value in self.saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if self.dump_dir:
            shutil.rmtree(self.dump_dir, ignore_errors=True)
        _reap_zombie_children()


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
    state.close()
    if state.hangs:
        # A hung test may have left a thread of this process blocked forever; Python joins
        # non-daemon threads at exit. Bound the exit (the dump says which thread blocked it).
        faulthandler.dump_traceback_later(EXIT_GRACE_S, exit=True, file=state.stderr_fd)
    with contextlib.suppress(OSError):
        os.close(state.stderr_fd)


def pytest_report_header(config: pytest.Config) -> str | None:
    state = config.stash.get(_SESSION, None)
    if state is None or state.settings.timeout <= 0:
        return None
    return f"torch-hang: timeout {state.settings.timeout:g}s (from {state.settings.source})"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    state = config.stash[_SESSION]
    for item in items:  # validate every marker now: a bad one is a usage error, not a late surprise
        item.stash[_ITEM_SETTINGS] = settings.item_settings(item, state.settings)


def _interrupt_handler(item: pytest.Item) -> signal.Handlers | object:
    def handler(signum: int, frame: FrameType | None) -> None:
        held = item.stash.get(_ITEM_GUARD, None)
        if held is None or not held.in_phase or held.report is None:
            return
        held.raised = True
        raise HangError(held.report.headline, held.report)

    return handler


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, object, object]:
    state = item.config.stash[_SESSION]
    item_settings = item.stash.get(_ITEM_SETTINGS, None) or settings.item_settings(
        item, state.settings
    )
    if item_settings.timeout <= 0:
        return (yield)
    watchdog = state.activate()
    target = guard.GuardTarget(
        test_id=item.nodeid,
        timeout_s=item_settings.timeout,
        root_pid=os.getpid(),
        dump_dir=state.dump_dir,
        exclude=state.own_pids(),
        shm_baseline=proctree.shm_entries(),
    )
    held = ItemGuard(target, target.started + item_settings.timeout, threading.get_ident())
    item.stash[_ITEM_GUARD] = held
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(INTERRUPT_SIGNAL, _interrupt_handler(item))  # type: ignore[arg-type]
    watchdog.arm(held)
    try:
        return (yield)
    finally:
        watchdog.disarm()
        if previous is not None:
            signal.signal(INTERRUPT_SIGNAL, previous)
        if held.fires:
            held.done.wait(PIPELINE_WAIT_S)
        del item.stash[_ITEM_GUARD]


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
    report.outcome = "failed"
    report.longrepr = hang.to_text()
    report.user_properties.append((HANG_PROPERTY, "true"))
    report.user_properties.append(("torch_hang_timeout", f"{hang.timeout_s:g}"))
    report.user_properties.append(("torch_hang_processes", str(len(hang.processes))))
    report.user_properties.append(("torch_hang_headline", hang.headline))
    item.config.stash[_SESSION].hangs.append((item.nodeid, hang.headline))


def _is_hang(report: pytest.TestReport | pytest.CollectReport) -> bool:
    return any(k == HANG_PROPERTY for k, _ in getattr(report, "user_properties", ()))


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
    stats = terminalreporter.stats
    hangs = [r for r in stats.get("failed", []) + stats.get("error", []) if _is_hang(r)]
    if not hangs:
        return
    terminalreporter.write_sep("=", "torch-hang summary", red=True, bold=True)
    for report in hangs:
        headline = next(v for k, v in report.user_properties if k == "torch_hang_headline")
        terminalreporter.write_line(str(headline))


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
    gpus = devices.leased_gpus(node) if hasattr(devices, "leased_gpus") else None
    return fixtures.TorchHang(state.get_runner, node.nodeid, _deadline(node), gpus)


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

"""pytest hooks: options, markers, each test's deadline, and the hang's place in its report.

The hooks translate between pytest and the guard's own objects (``SessionState``,
``TestDeadline``, ``HangReport``). Off Linux the plugin only registers its options and markers
and says once, in the header, that the guard needs Linux.
"""

from __future__ import annotations

import contextlib
import faulthandler
import inspect
import math
import os
import sys
import threading
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import pytest

from . import settings

if TYPE_CHECKING:
    from .debuggers import DebuggerWatch
    from .hunt import HuntPlugin
    from .report.model import HangReport
    from .runner.api import TorchHang
    from .session import SessionState
    from .watchdog import TestDeadline

#: The guard relies on /proc, prctl and real-time signals.
SUPPORTED = sys.platform.startswith("linux")
#: After a session that had a hang, interpreter exit gets this long before it is forced.
EXIT_GRACE_S = 15.0

_SESSION = pytest.StashKey["SessionState"]()
_PER_TEST = "torchhang-per-test"
_HUNT = "torchhang-hunt"
_ITEM_SETTINGS = pytest.StashKey[settings.ItemSettings]()
#: pytest-timeout's --timeout-disable-debugger-detection (or its ini key) is set
_NO_DEBUGGER_DETECTION = pytest.StashKey[bool]()
_DEBUGGER_WATCH = pytest.StashKey["DebuggerWatch"]()
#: the deadline a phase of the item ran under: a setup under it is a rerun (rerunfailures)
_PHASED = pytest.StashKey["TestDeadline"]()
#: within pytest_exception_interact of a failure (without --pdb: nobody debugs it)
_INTERACTING = pytest.StashKey[bool]()

_TORCH_HANG_HELP = (
    f"{settings.MARKER}(timeout=None, stall=None, isolate=False): bound this test by timeout "
    "seconds, and fail it after stall seconds without progress (0 = off), with pytest-torchhang; "
    "isolate=True runs it in a subprocess"
)


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
        settings.STALL_OPTION,
        dest="torch_hang_stall",
        default=None,
        metavar="SECONDS",
        help="Fail a test whose process tree makes no progress (DataLoader batches, optimizer "
        "steps, collectives, pytest_torchhang.progress()) for SECONDS; 0 turns it off "
        f"(env {settings.STALL_ENV}, ini {settings.STALL_INI})",
    )
    group.addoption(
        settings.HUNT_OPTION,
        dest="torch_hang_hunt",
        default=None,
        metavar="N",
        help="Hunt rare hangs: run each selected test up to N times under the guard, stopping "
        "at its first hang, and show each distinct way it hung once",
    )
    group.addoption(
        settings.HUNT_ALL_OPTION,
        dest="torch_hang_hunt_all",
        action="store_true",
        default=False,
        help=f"With {settings.HUNT_OPTION}: run all N runs and count the hangs",
    )
    group.addoption(
        settings.HUNT_STRESS_OPTION,
        dest="torch_hang_hunt_stress",
        action="store_true",
        default=False,
        help=f"With {settings.HUNT_OPTION}: make races likelier: odd runs wait briefly, at "
        "random, where the tree's processes and threads meet (queues, pipes, locks, events, "
        "shared values, process start and join, collectives), even runs stay plain for "
        "comparison; changes timing, not semantics",
    )
    group.addoption(
        settings.HUNT_SEED_OPTION,
        dest="torch_hang_hunt_seed",
        default=None,
        metavar="SEED",
        help=f"With {settings.HUNT_OPTION}: stress every run with the schedule of SEED, as a "
        "stressed run that hung printed it",
    )
    group.addoption(
        "--torch-hang-rerun",
        dest="torch_hang_rerun",
        action="store_true",
        default=False,
        help="Run only the tests that hung or stalled last time (pytest's cache, as --lf), or "
        "every test when none did",
    )
    group.addoption(
        settings.REPORT_DIR_OPTION,
        dest="torch_hang_report_dir",
        default=None,
        metavar="DIR",
        help="Write one JSON report per hang into DIR (relative to the invocation directory)",
    )
    group.addoption(
        settings.NATIVE_OPTION,
        dest="torch_hang_native",
        action="store_true",
        default=False,
        help="Add native stacks through pystack (or else py-spy) where installed and permitted",
    )
    parser.addini(
        settings.TIMEOUT_INI, "Seconds before a test counts as hung (0 = off)", default=""
    )
    parser.addini(
        settings.STALL_INI,
        "Seconds without progress before a test counts as stalled (0 = off)",
        default="",
    )
    parser.addini(settings.REPORT_DIR_INI, "Directory for one JSON report per hang", default="")
    parser.addini(
        # a string checked by the plugin: pytest's own "bool" type fails without naming the key
        settings.NATIVE_INI,
        "Add native stacks through pystack or py-spy (true/false)",
        default="",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", _TORCH_HANG_HELP)
    session_settings = settings.session_settings(config)  # raises a usage error when invalid
    if not SUPPORTED:
        config.addinivalue_line("markers", "gpu(count=1): needs count CUDA GPUs (pytest-torchhang)")
        config.addinivalue_line("markers", "cpu: must not touch a GPU (pytest-torchhang)")
        return
    from . import debuggers, devices, rerun
    from .session import SessionState

    rerun.register(config, bool(config.getoption("torch_hang_rerun", False)))
    config.pluginmanager.register(_ShortSummary(), "torchhang-short-summary")
    config.stash[_SESSION] = SessionState(config, session_settings, os.dup(2))
    config.stash[_NO_DEBUGGER_DETECTION] = debuggers.detection_disabled(config)
    config.pluginmanager.register(devices.DevicePlugin(config), "torchhang-devices")
    if session_settings.hunt:
        from .hunt import HuntPlugin

        hunter = HuntPlugin(
            config,
            session_settings.hunt,
            session_settings.hunt_all,
            session_settings.hunt_stress,
            session_settings.hunt_seed,
        )
        config.pluginmanager.register(hunter, _HUNT)


def pytest_report_header(config: pytest.Config) -> str | None:
    if SUPPORTED:
        return None  # the devices plugin writes the one header line
    return (
        f"torch-hang: off on {sys.platform}: the guard needs Linux (/proc, prctl and real-time "
        "signals); options and markers are accepted and do nothing"
    )


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    state = config.stash.get(_SESSION, None)
    if state is None:
        return
    active = state.watchdog is not None
    state.close()
    main = threading.main_thread()
    blocking = [t for t in threading.enumerate() if t is not main and t.is_alive() and not t.daemon]
    if active and (state.hangs or blocking) and threading.current_thread() is main:
        # Python joins non-daemon threads at exit, and a test (hung or not) may have left one
        # blocked forever: bound the exit. The dump says which thread blocked it. The fd stays
        # open for that dump.
        faulthandler.dump_traceback_later(EXIT_GRACE_S, exit=True, file=state.stderr_fd)
    else:
        with contextlib.suppress(OSError):
            os.close(state.stderr_fd)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Kill what guarded tests started and left running (never what they did not start)."""
    state = session.config.stash.get(_SESSION, None)
    if state is not None:
        state.kill_leftovers()


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    # On a pytest-xdist worker a usage error raised during collection becomes an INTERNALERROR
    # that loses its message: there, a bad torch_hang marker fails its module's collection.
    report = yield
    if not hasattr(collector.config, "workerinput"):
        return report
    session_settings = settings.session_settings(collector.config)
    return settings.fail_collection_on_bad_markers(
        report, lambda item: settings.item_settings(item, session_settings), (pytest.UsageError,)
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    state = config.stash.get(_SESSION, None)
    session_settings = state.settings if state is not None else settings.session_settings(config)
    for item in items:  # validate every marker now: a bad one is a usage error, not a late surprise
        item.stash[_ITEM_SETTINGS] = settings.item_settings(item, session_settings)
    if (
        state is not None
        and not config.pluginmanager.has_plugin(_PER_TEST)
        and _needs_per_test_hooks(config, items)
    ):
        config.pluginmanager.register(_PerTestHooks(state), _PER_TEST)


def _hunter(config: pytest.Config) -> HuntPlugin | None:
    return config.pluginmanager.get_plugin(_HUNT)


def _deadline(item: pytest.Item) -> TestDeadline | None:
    from .session import DEADLINE

    return item.stash.get(DEADLINE, None)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: pytest-timeout may be disabled
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    """Take over pytest-timeout's ``--timeout`` / ``@pytest.mark.timeout`` deadline.

    The test then gets the whole-tree report and cleanup instead of pytest-timeout's stack dump
    and ``os._exit`` (thread method) or bare SIGALRM (signal method). Its limit joins the
    test's deadline model with the plugin's own: whichever is due first fires.
    """
    state = item.config.stash.get(_SESSION, None)
    if state is None:
        return None  # off Linux: pytest-timeout keeps its own deadline
    from .deadline import Source

    item_settings = item.stash.get(_ITEM_SETTINGS, None)
    stall = item_settings.stall if item_settings else 0.0
    _watch_debuggers(item, state.arm(item, float(settings.timeout), stall, Source.PYTEST_TIMEOUT))
    return True


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> bool | None:
    """pytest-timeout's timer ends (after the call with ``func_only``, after the test, or at a
    post-mortem debugger): its limit leaves the model; the plugin's own stays."""
    state = item.config.stash.get(_SESSION, None)
    if state is None:
        return None
    if item.stash.get(_INTERACTING, False):  # a failure without --pdb: the limit stays
        return True
    held = _deadline(item)
    if held is not None:
        from .deadline import ClearLimit, Source

        held.feed(ClearLimit(Source.PYTEST_TIMEOUT))
    return True


def _watch_debuggers(item: pytest.Item, held: TestDeadline) -> None:
    """Give the test's deadline its debugger check (pytest-timeout's rule, ``debuggers.py``),
    unless pytest-timeout's switch turns detection off; on the test's thread."""
    if item.config.stash.get(_NO_DEBUGGER_DETECTION, False):
        return
    watch = item.stash.get(_DEBUGGER_WATCH, None)
    if watch is None or held.debugger is not watch:
        from .debuggers import DebuggerWatch

        ask = held.ask_trace
        watch = item.stash[_DEBUGGER_WATCH] = DebuggerWatch(item.nodeid, held.thread_id, ask=ask)
        held.debugger = watch
    watch.saw(sys.gettrace())


def pytest_enter_pdb(config: pytest.Config) -> None:
    """No hang is declared, and nothing killed, once a user has sat in the debugger: every clock
    of the current test stops for the rest of it (pytest-timeout's rule too, which users know:
    after ``continue`` a test is being debugged, and killing it a second later would surprise).
    pytest-timeout's ``--timeout-disable-debugger-detection`` turns it off, as there."""
    if config.stash.get(_NO_DEBUGGER_DETECTION, False):
        return
    state = config.stash.get(_SESSION, None)
    if state is not None and state.current is not None:
        state.pause(state.current)


@pytest.hookimpl(wrapper=True)
def pytest_exception_interact(
    node: pytest.Item | pytest.Collector,
) -> Generator[None, object, object]:
    """Under ``--pdb`` a failure of setup, call or teardown opens the post-mortem debugger
    before the rest of the test runs: its clocks stop first, for the rest of it (pytest-timeout
    cancels its timer here too). Without ``--pdb`` nothing waits for a user: pytest-timeout's
    cancel, which it makes here at every failure, is ignored, so that the rest of a failing test
    (its teardown, where joins of workers hang) stays bounded by ``--timeout`` too."""
    state = node.config.stash.get(_SESSION, None)
    held = _deadline(node) if isinstance(node, pytest.Item) else None
    if state is None or held is None:
        return (yield)
    if node.config.getoption("usepdb", False):
        state.pause(held)
        return (yield)
    node.stash[_INTERACTING] = True
    try:
        return (yield)
    finally:
        del node.stash[_INTERACTING]


@pytest.hookimpl(wrapper=True)
def pytest_report_from_serializable(
    config: pytest.Config, data: dict[str, object]
) -> Generator[None, object, object]:
    """On the pytest-xdist controller, give a worker's hang report its headline back (pytest
    rebuilds the report; the hang's longrepr arrives as its text)."""
    report = yield
    if SUPPORTED and isinstance(report, pytest.TestReport) and report.failed:
        from .report import handoff

        handoff.restore_longrepr(report)
    return report


def pytest_report_teststatus(
    report: pytest.TestReport, config: pytest.Config
) -> tuple[str, str, str] | None:
    """A hang counts as ``hang`` and a stall as ``stall`` on the summary line (``1 failed, 2
    hang``), ``H``/``S`` in the progress and ``HANG``/``STALL`` in verbose mode. The report
    stays failed: exit code 1, ``-x``, ``--maxfail`` and ``--lf`` treat it as a failure."""
    if not SUPPORTED or not report.failed:
        return None
    from .report import handoff

    if handoff.is_hang(report):
        category, letter, word = handoff.outcome(report)
        # pytest >= 8.3 renders the (word, markup) form; its hookspec still types a str
        return category, letter, (word, {"red": True, "bold": True})  # type: ignore[return-value]
    return None


def _hang_reports(terminalreporter: pytest.TerminalReporter) -> list[pytest.TestReport]:
    stats = terminalreporter.stats
    if not any(stats.get(c) for c in ("failed", "error", "hang", "stall")):
        return []  # a passing session: the report's code (the cold path) stays unloaded
    from .report import handoff

    found = [
        r
        for category in (*handoff.OUTCOMES, "failed", "error")
        for r in stats.get(category, [])
        if isinstance(r, pytest.TestReport) and handoff.is_hang(r)
    ]
    return list({id(r): r for r in found}.values())


def _write_hang_sections(
    terminalreporter: pytest.TerminalReporter, hangs: list[pytest.TestReport]
) -> None:
    """Each hang's report in full, as pytest writes a failure's in its FAILURES section (which
    lists the "failed" category only)."""
    from .report import handoff

    config = terminalreporter.config
    if config.option.tbstyle == "no" or getattr(config.option, "no_summary", False):
        return
    terminalreporter.write_sep("=", "HANGS", red=True, bold=True)
    showcapture = config.option.showcapture
    for report in hangs:
        terminalreporter.write_sep("_", handoff.section_title(report), red=True, bold=True)
        report.toterminal(terminalreporter)  # type: ignore[arg-type]  # it calls .line() only
        if showcapture == "no":
            continue
        for name, content in report.sections:
            if showcapture != "all" and showcapture not in name:
                continue
            terminalreporter.write_sep("-", name)
            terminalreporter.line(content[:-1] if content.endswith("\n") else content)


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config
) -> None:
    state = config.stash.get(_SESSION, None)
    stats = terminalreporter.stats
    hunter = _hunter(config)
    failures = [*stats.get("failed", []), *stats.get("error", [])]
    failures += [*stats.get("hang", []), *stats.get("stall", [])]
    if state is None or not (
        state.notes or state.leftovers or failures or hunter or stats.get("rerun")
    ):
        return  # nothing to say (and nothing more to import)
    from .report import handoff

    hangs = _hang_reports(terminalreporter)
    if hangs:
        _write_hang_sections(terminalreporter, hangs)

    write = terminalreporter.write_line
    if state.notes:
        terminalreporter.write_sep("=", "torch-hang: notes", yellow=True)
        for note in dict.fromkeys(state.notes):  # each said once
            write(note)
    if state.leftovers:
        terminalreporter.write_sep("=", "torch-hang: processes left running by tests", yellow=True)
        for line in state.leftovers:
            write(line)
        write(
            f"killed {len(state.leftovers)} process(es) at session end: tests started them and "
            "left them running (they would have blocked pytest's exit or outlived it)"
        )
    if hunter is not None and hunter.tests:
        terminalreporter.write_sep("=", "torch-hang hunt", bold=True)
        for line in hunter.summary_lines():
            write(line)
        hunter.write_json(state.settings.report_dir)
    # pytest-rerunfailures: an attempt that hung and was run again is a "rerun", not a failure
    reruns = [r for r in stats.get("rerun", []) if handoff.is_hang(r)]
    if not hangs and not reruns:
        return
    terminalreporter.write_sep("=", "torch-hang summary", red=True, bold=True)
    for report in reruns:
        write(f"attempt {getattr(report, 'rerun', 0) + 1}, run again: {handoff.headline(report)}")
    for report in hangs:
        write(handoff.headline(report))
    if os.environ.get("GITHUB_ACTIONS") == "true":
        for report in hangs:  # one annotation per hang, on the test's line
            write(handoff.github_annotation(report))
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary and not hasattr(config, "workerinput"):  # the controller writes, once per hang
        from .report import views

        for report in hangs:
            hang = handoff.hang_model(report)
            problem = views.append_job_summary(summary, hang) if hang is not None else None
            if problem:
                write(f"torch-hang: {problem}")


#: pytest's report characters (``-r``) and the categories whose lines they add to its short
#: summary: pytest writes the summary's title only when one of them has a line.
_REPORTCHARS = {"f": "failed", "E": "error", "s": "skipped", "x": "xfailed", "X": "xpassed"}


class _ShortSummary:
    """Hangs in pytest's short test summary (``HANG test_x.py::test_x - HANG after ...``),
    which lists its own categories only: written just after it, by a wrapper around pytest's."""

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_terminal_summary(
        self, terminalreporter: pytest.TerminalReporter
    ) -> Generator[None, None, None]:
        try:
            return (yield)
        finally:
            self._write(terminalreporter)

    @staticmethod
    def _write(terminalreporter: pytest.TerminalReporter) -> None:
        chars = terminalreporter.reportchars
        if "f" not in chars or getattr(terminalreporter.config.option, "no_summary", False):
            return
        hangs = _hang_reports(terminalreporter)
        if not hangs:
            return
        from .report import handoff

        stats = terminalreporter.stats
        if not any(stats.get(_REPORTCHARS[c]) for c in chars if c in _REPORTCHARS):
            # pytest wrote no title: it had no line of its own
            terminalreporter.write_sep("=", "short test summary info", cyan=True, bold=True)
        for report in hangs:
            word = handoff.outcome(report)[2]
            terminalreporter.write_line(f"{word} {report.nodeid} - {handoff.headline(report)}")


@pytest.fixture
def torch_hang(request: pytest.FixtureRequest) -> TorchHang:
    """Run callables, DataLoader iterations and N-rank distributed steps in subprocesses.

    ``torch_hang.run(fn, *args, timeout=None, start_method=None, env=None, **kwargs)``,
    ``torch_hang.dataloader(dataset_or_factory, batches=None, ...)`` and
    ``torch_hang.distributed(fn, *args, world_size=2, backend=None, ...)``; see the README.
    """
    state = request.config.stash.get(_SESSION, None)
    if state is None:
        pytest.skip(f"the torch_hang fixture needs Linux (this is {sys.platform})")
    # The plugin's own first use is the session's cost, not the test's: on a loaded machine
    # these imports took 4 s of a test's setup, and a 2 s stall time fired on them.
    with state.paused_deadline():
        from . import devices
        from .runner import api

    if not request.config.pluginmanager.has_plugin(_PER_TEST):  # requested dynamically
        request.config.pluginmanager.register(_PerTestHooks(state), _PER_TEST)
    node = request.node

    def deadline() -> float | None:
        held = _deadline(node)
        due = held.deadline if held is not None else math.inf
        return due if due < math.inf else None

    return api.TorchHang(
        state.get_runner,
        node.nodeid,
        deadline,
        devices.leased_devices(node),
        native=state.settings.native,
        watch=lambda: _deadline(node),
    )


def _needs_per_test_hooks(config: pytest.Config, items: list[pytest.Item]) -> bool:
    """Whether any test of this session can be guarded, or use the fixture or ``isolate``.

    Without one, the per-test hooks are never registered: the plugin then costs a passing test
    nothing but pytest's own call of the few hooks below.
    """
    state = config.stash.get(_SESSION, None)
    if state is None:
        return False
    if state.settings.timeout > 0 or state.settings.stall > 0:
        return True
    if settings.pytest_timeout_seconds(config) > 0:  # pytest-timeout's: taken over here
        return True
    for item in items:
        item_settings = item.stash.get(_ITEM_SETTINGS, None)
        if item_settings is not None and (
            item_settings.timeout > 0 or item_settings.stall > 0 or item_settings.isolate
        ):
            return True
        if "torch_hang" in getattr(item, "fixturenames", ()):
            return True
        if item.get_closest_marker("timeout") is not None:
            return True
    return False


class _PerTestHooks:
    """The hooks that run for every test: registered only in sessions that can need them."""

    def __init__(self, state: SessionState) -> None:
        from . import exceptions, fixtures, session

        self.state = state
        self._fixtures = fixtures.WideFixtures(state)
        state.pools, state.before_capture = self._fixtures.pool_births, self._fixtures.spare_pools
        # bound once: these hooks run for every test
        self._key = session.DEADLINE
        self._wait_s = session.PIPELINE_WAIT_S
        self._hang_error = exceptions.HangError
        self._make_renderable = exceptions.make_renderable
        self._hunter = _hunter(state.config)  # registered at configure, before these hooks

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_protocol(
        self, item: pytest.Item, nextitem: pytest.Item | None
    ) -> Generator[None, object, object]:
        state = self.state
        item_settings = item.stash.get(_ITEM_SETTINGS, None) or settings.item_settings(
            item, state.settings
        )
        if item_settings.timeout > 0 or item_settings.stall > 0:
            _watch_debuggers(item, state.arm(item, item_settings.timeout, item_settings.stall))
        else:
            state.end_guarded_run()
        hunter = self._hunter
        if hunter is not None:
            hunter.begin_run(item)
        try:
            return (yield)
        finally:
            if hunter is not None:
                hunter.end_run(item)
            held = item.stash.get(self._key, None)
            if held is not None:
                state.finish(held)
                del item.stash[self._key]
            if _PHASED in item.stash:  # the next run of the item starts afresh
                del item.stash[_PHASED]
            if _DEBUGGER_WATCH in item.stash:
                del item.stash[_DEBUGGER_WATCH]

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(
        self, fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest
    ) -> Generator[None, object, object]:
        """Processes a module-, class- or session-scoped fixture starts are that fixture's:
        context for every test's hang and for the session's end, even when a test's setup
        started them. A hang in its setup fails the setup (once: ``fixtures.py``)."""
        if fixturedef.scope == "function":
            return (yield)
        return (yield from self._fixtures.setup(fixturedef, request))

    def pytest_fixture_post_finalizer(self, fixturedef: pytest.FixtureDef[Any]) -> None:
        if fixturedef.scope != "function":
            self.state.wider_fixture_ends()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, object, object]:
        return (yield from self._phase(item, "setup"))

    # trylast: the innermost wrapper, inside pytest-timeout's, which arms its func_only limit
    # around the call (an outer wrapper would find no deadline, and the test would never be
    # interrupted: only the monitor would end it, pytest and all)
    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, object, object]:
        return (yield from self._phase(item, "call"))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(
        self, item: pytest.Item, nextitem: pytest.Item | None
    ) -> Generator[None, object, object]:
        return (yield from self._phase(item, "teardown"))

    def _phase(self, item: pytest.Item, name: str) -> Generator[None, object, object]:
        held = item.stash.get(self._key, None)
        if held is None:
            return (yield)
        if name == "setup" and item.stash.get(_PHASED, None) is held:
            held = self._rerun(item, held)
        item.stash[_PHASED] = held
        watch: DebuggerWatch | None = item.stash.get(_DEBUGGER_WATCH, None)
        if watch is not None:
            watch.saw(sys.gettrace())  # this thread's: the watchdog's own is not the test's
        held.enter_phase(name)
        try:
            return (yield)
        finally:
            held.leave_phase()

    def _rerun(self, item: pytest.Item, held: TestDeadline) -> TestDeadline:
        """The deadline of a new attempt of the test, whose setup starts now.

        pytest-rerunfailures runs a test's setup, call and teardown again inside one
        ``pytest_runtest_protocol``: each attempt gets the test's deadlines afresh (its limits
        and stall time, as they were), so that a rerun is bounded as its first run was, neither
        left to the grace of a first attempt that hung nor short of the time a slow one took.
        (pytest-timeout's ``func_only`` limit, lifted after each call, is set again by it.)
        """
        from .deadline import Source

        limits = [(limit.source, limit.seconds) for limit in held.state.limits]
        stall = held.state.stall_s
        self.state.finish(held)
        del item.stash[self._key]
        fresh = held
        for source, seconds in limits or [(Source.TIMEOUT, 0.0)]:
            fresh = self.state.arm(item, seconds, stall, source)
        _watch_debuggers(item, fresh)
        return fresh

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        held = item.stash.get(self._key, None)
        raised = call.excinfo.value if call.excinfo is not None else None
        # An interrupt may leave a traceback entry without a line number: pytest must be able
        # to render it (else: INTERNALERROR, and the session ends).
        guarded = held is not None or isinstance(raised, self._hang_error)
        if raised is not None and guarded and self._make_renderable(raised):
            call.excinfo = pytest.ExceptionInfo.from_exception(raised)
        # a wider fixture's hang that pytest re-raises from its cache: a setup error, not a hang
        reraised = self._fixtures.reraised(raised, call.excinfo)
        report = yield
        fresh = held.take_reports(self._wait_s) if held is not None and held.fired else []
        if fresh:
            self._mark_hang(item, report, fresh[0])  # the first capture is the report
        elif reraised is not None:
            report.sections.append(reraised)
        elif isinstance(raised, self._hang_error) and raised.report is not None:
            self._mark_hang(item, report, raised.report)  # from the fixture or an isolated test
        return report

    def _mark_hang(self, item: pytest.Item, report: pytest.TestReport, hang: HangReport) -> None:
        from .report import handoff

        handoff.mark_hang(item, report, hang, self.state.json_path(hang, item.nodeid))
        self._fixtures.count(hang, item.nodeid)
        self.state.hangs.append((item.nodeid, hang.headline))
        hunter = _hunter(item.config)
        if hunter is not None:
            report.user_properties.extend(hunter.found(item.nodeid, hang))
            report.sections.append(("torch-hang hunt", hunter.run_note(item.nodeid)))

    @pytest.hookimpl(tryfirst=True)
    def pytest_pyfunc_call(self, pyfuncitem: pytest.Function) -> bool | None:
        item_settings = pyfuncitem.stash.get(_ITEM_SETTINGS, None)
        if item_settings is None or not item_settings.isolate:
            return None
        from . import clock
        from .runner import api

        funcargs = _own_arguments(pyfuncitem)
        held = pyfuncitem.stash.get(self._key, None)
        due = held.deadline if held is not None else math.inf
        timeout = (
            max(due - clock.monotonic() - api.MARGIN_S, 0.1)
            if due < math.inf
            else api.DEFAULT_TIMEOUT_S
        )
        runner = self.state.get_runner()
        api.run_isolated(runner, pyfuncitem.obj, funcargs, pyfuncitem.nodeid, timeout, held)
        return True


def _own_arguments(item: pytest.Function) -> dict[str, object]:
    """The values of the test function's own arguments, as pytest would pass them.

    pytest's own ``pytest_pyfunc_call`` reads the names from the private
    ``item._fixtureinfo.argnames``; no public API gives them (pytest 9.0). The public route:
    the function's signature (a bound method's, without ``self``) less the arguments that have
    a default (pytest does not fill those), each filled from ``item.funcargs``, which also holds
    autouse fixtures the function does not take.
    """
    funcargs = item.funcargs
    return {
        name: funcargs[name]
        for name, parameter in inspect.signature(item.obj).parameters.items()
        if parameter.default is inspect.Parameter.empty
        and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
        and name in funcargs
    }

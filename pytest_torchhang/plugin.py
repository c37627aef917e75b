"""pytest hooks: the plugin module pytest loads (the ``pytest11`` entry point).

Options and markers, the session's configure and end, collection, pytest-timeout's timer, the
debugger's hooks, the report's status, the ``torch_hang`` fixture. The work is done elsewhere,
split by job as pytest splits its own: the options in ``settings.py``, the hooks that run for
every test in ``pertest.py`` (registered only in sessions that can need them), what is written
to the terminal in ``terminal.py``. The hooks translate between pytest and the guard's own
objects (``SessionState``, ``TestDeadline``, ``HangReport``). Off Linux the plugin only
registers its options and markers and says once, in the header, that the guard needs Linux:
it loads nothing but this module and ``settings.py``.
"""

from __future__ import annotations

import contextlib
import faulthandler
import math
import os
import sys
import threading
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import pytest

from . import settings
from .settings import ITEM_SETTINGS

if TYPE_CHECKING:
    from .runner.api import TorchHang
    from .session import SessionState

#: The guard relies on /proc, prctl and real-time signals.
SUPPORTED = sys.platform.startswith("linux")
#: After a session that had a hang, interpreter exit gets this long before it is forced.
EXIT_GRACE_S = 15.0

_SESSION: pytest.StashKey[SessionState] = pytest.StashKey()
#: within pytest_exception_interact of a failure (without --pdb: nobody debugs it)
_INTERACTING = pytest.StashKey[bool]()

_TORCH_HANG_HELP = (
    f"{settings.MARKER}(timeout=None, stall=None, isolate=False): bound this test by timeout "
    "seconds, and fail it after stall seconds without progress (0 = off), with pytest-torchhang; "
    "isolate=True runs it in a subprocess"
)


def pytest_addoption(parser: pytest.Parser) -> None:
    settings.add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", _TORCH_HANG_HELP)
    session_settings = settings.session_settings(config)  # raises a usage error when invalid
    if not SUPPORTED:
        config.addinivalue_line("markers", "gpu(count=1): needs count CUDA GPUs (pytest-torchhang)")
        config.addinivalue_line("markers", "cpu: must not touch a GPU (pytest-torchhang)")
        return
    from . import debuggers, devices, pertest, rerun, terminal
    from .session import SessionState

    rerun.register(config, bool(config.getoption("torch_hang_rerun", False)))
    config.pluginmanager.register(terminal.ShortSummary(), "torchhang-short-summary")
    config.stash[_SESSION] = SessionState(config, session_settings, os.dup(2))
    config.stash[pertest.NO_DEBUGGER_DETECTION] = debuggers.detection_disabled(config)
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
        config.pluginmanager.register(hunter, pertest.HUNT)


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
        item.stash[ITEM_SETTINGS] = settings.item_settings(item, session_settings)
    if state is None:
        return
    from . import pertest

    if not config.pluginmanager.has_plugin(pertest.PER_TEST) and pertest.needs_per_test_hooks(
        state, config, items
    ):
        config.pluginmanager.register(pertest.PerTestHooks(state), pertest.PER_TEST)


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
    from .pertest import watch_debuggers

    item_settings = item.stash.get(ITEM_SETTINGS, None)
    stall = item_settings.stall if item_settings else 0.0
    watch_debuggers(item, state.arm(item, float(settings.timeout), stall, Source.PYTEST_TIMEOUT))
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
    from .pertest import deadline

    held = deadline(item)
    if held is not None:
        from .deadline import ClearLimit, Source

        held.feed(ClearLimit(Source.PYTEST_TIMEOUT))
    return True


def pytest_enter_pdb(config: pytest.Config) -> None:
    """No hang is declared, and nothing killed, once a user has sat in the debugger: every clock
    of the current test stops for the rest of it (pytest-timeout's rule too, which users know:
    after ``continue`` a test is being debugged, and killing it a second later would surprise).
    pytest-timeout's ``--timeout-disable-debugger-detection`` turns it off, as there."""
    state = config.stash.get(_SESSION, None)
    if state is None:
        return
    from .pertest import NO_DEBUGGER_DETECTION

    if not config.stash.get(NO_DEBUGGER_DETECTION, False) and state.current is not None:
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
    if state is None or not isinstance(node, pytest.Item):
        return (yield)
    from .pertest import deadline

    held = deadline(node)
    if held is None:
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


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config
) -> None:
    state = config.stash.get(_SESSION, None)
    if state is None:
        return
    from . import pertest, terminal

    terminal.summary(terminalreporter, state, pertest.hunter(config))


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
    # these imports took 4 s of a test's setup, and a 2 s stall time fired on them. Later
    # tests find them loaded, and pause nothing.
    first_use = f"{__package__}.runner.api" not in sys.modules
    with state.paused_deadline() if first_use else contextlib.nullcontext():
        from . import devices, pertest
        from .runner import api

    if not request.config.pluginmanager.has_plugin(pertest.PER_TEST):  # requested dynamically
        request.config.pluginmanager.register(pertest.PerTestHooks(state), pertest.PER_TEST)
    node = request.node

    def deadline() -> float | None:
        held = pertest.deadline(node)
        due = held.deadline if held is not None else math.inf
        return due if due < math.inf else None

    return api.TorchHang(
        state.get_runner,
        node.nodeid,
        deadline,
        devices.leased_devices(node),
        native=state.settings.native,
        watch=lambda: pertest.deadline(node),
    )

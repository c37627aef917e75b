"""The hooks that run for every test (``PerTestHooks``), registered only in sessions that can need
them: a test's deadline armed and lifted, its phases, a rerun's fresh deadline, the hang marked in
its report, ``isolate=True``; and the debugger check each guarded test gets.

Loaded at configure on Linux (``plugin.py`` stays what pytest loads off it too).
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import pytest

from . import settings

if TYPE_CHECKING:
    from .debuggers import DebuggerWatch
    from .hunt import HuntPlugin
    from .report.model import HangReport
    from .session import SessionState
    from .watchdog import TestDeadline

#: The names the per-test hooks and the hunt are registered under.
PER_TEST = "torchhang-per-test"
HUNT = "torchhang-hunt"
#: pytest-timeout's --timeout-disable-debugger-detection (or its ini key) is set
NO_DEBUGGER_DETECTION = pytest.StashKey[bool]()
DEBUGGER_WATCH = pytest.StashKey["DebuggerWatch"]()
#: the deadline a phase of the item ran under: a setup under it is a rerun (rerunfailures)
PHASED = pytest.StashKey["TestDeadline"]()


def hunter(config: pytest.Config) -> HuntPlugin | None:
    """The session's hunt, when it hunts."""
    return config.pluginmanager.get_plugin(HUNT)


def deadline(item: pytest.Item) -> TestDeadline | None:
    """The test's deadline while it is armed."""
    from .session import DEADLINE

    return item.stash.get(DEADLINE, None)


def watch_debuggers(item: pytest.Item, held: TestDeadline) -> None:
    """Give the test's deadline its debugger check (pytest-timeout's rule, ``debuggers.py``),
    unless pytest-timeout's switch turns detection off; on the test's thread."""
    if item.config.stash.get(NO_DEBUGGER_DETECTION, False):
        return
    watch = item.stash.get(DEBUGGER_WATCH, None)
    if watch is None or held.debugger is not watch:
        from .debuggers import DebuggerWatch

        ask = held.ask_trace
        watch = item.stash[DEBUGGER_WATCH] = DebuggerWatch(item.nodeid, held.thread_id, ask=ask)
        held.debugger = watch
    watch.saw(sys.gettrace())


def needs_per_test_hooks(
    state: SessionState, config: pytest.Config, items: list[pytest.Item]
) -> bool:
    """Whether any test of this session can be guarded, or use the fixture or ``isolate``.

    Without one, the per-test hooks are never registered: the plugin then costs a passing test
    nothing but pytest's own call of the few hooks in ``plugin.py``.
    """
    if state.settings.timeout > 0 or state.settings.stall > 0:
        return True
    if settings.pytest_timeout_seconds(config) > 0:  # pytest-timeout's: taken over here
        return True
    for item in items:
        item_settings = item.stash.get(settings.ITEM_SETTINGS, None)
        if item_settings is not None and (
            item_settings.timeout > 0 or item_settings.stall > 0 or item_settings.isolate
        ):
            return True
        if "torch_hang" in getattr(item, "fixturenames", ()):
            return True
        if item.get_closest_marker("timeout") is not None:
            return True
    return False


class PerTestHooks:
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
        self._hunter = hunter(state.config)  # registered at configure, before these hooks

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_protocol(
        self, item: pytest.Item, nextitem: pytest.Item | None
    ) -> Generator[None, object, object]:
        state = self.state
        item_settings = item.stash.get(settings.ITEM_SETTINGS, None) or settings.item_settings(
            item, state.settings
        )
        if item_settings.timeout > 0 or item_settings.stall > 0:
            watch_debuggers(item, state.arm(item, item_settings.timeout, item_settings.stall))
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
            if PHASED in item.stash:  # the next run of the item starts afresh
                del item.stash[PHASED]
            if DEBUGGER_WATCH in item.stash:
                del item.stash[DEBUGGER_WATCH]

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
        if name == "setup" and item.stash.get(PHASED, None) is held:
            held = self._rerun(item, held)
        item.stash[PHASED] = held
        watch: DebuggerWatch | None = item.stash.get(DEBUGGER_WATCH, None)
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
        watch_debuggers(item, fresh)
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
        hunt = hunter(item.config)
        if hunt is not None:
            report.user_properties.extend(hunt.found(item.nodeid, hang))
            report.sections.append(("torch-hang hunt", hunt.run_note(item.nodeid)))

    @pytest.hookimpl(tryfirst=True)
    def pytest_pyfunc_call(self, pyfuncitem: pytest.Function) -> bool | None:
        item_settings = pyfuncitem.stash.get(settings.ITEM_SETTINGS, None)
        if item_settings is None or not item_settings.isolate:
            return None
        from . import clock
        from .runner import api

        funcargs = own_arguments(pyfuncitem)
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


def own_arguments(item: pytest.Function) -> dict[str, object]:
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

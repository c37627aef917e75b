"""Debugger detection: pytest-timeout's ``is_debugging`` rule, read for the test's own thread."""

from __future__ import annotations

import bdb
import pdb
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import pytest

from pytest_torchhang import debuggers
from pytest_torchhang.debuggers import DebuggerWatch, debugger_in

#: A trace function as a debugger installs one: it traces every frame it is called for.
TRACER = """
def trace_dispatch(frame, event, arg):
    return trace_dispatch


class SafeCallWrapper:  # pydevd's Cython tracer is an object, not a function
    def __call__(self, frame, event, arg):
        return self
"""


def _module(name: str, source: str = TRACER) -> types.ModuleType:
    """A module of that name, as a debugger's is: its functions carry the name."""
    module = types.ModuleType(name)
    exec(compile(source, f"<{name}>", "exec"), module.__dict__)
    return module


@pytest.mark.parametrize(
    "name",
    [
        "pydevd",  # PyCharm's and VS Code's debugger, as debugpy imports its vendored copy
        "_pydevd_bundle.pydevd_trace_dispatch_regular",
        "_pydevd_bundle.pydevd_cython",
        "_pydevd_frame_eval.pydevd_frame_evaluator",
        "debugpy._vendored.pydevd._pydevd_bundle.pydevd_cython",
        "bdb",
    ],
)
def test_a_trace_function_from_a_debuggers_module_is_a_debugger(name: str) -> None:
    module = _module(name)
    assert debugger_in([module.trace_dispatch]) == f"a trace function from {name}"
    assert debugger_in([module.SafeCallWrapper()]) == f"a trace function from {name}"


def test_pdbs_trace_function_is_bdbs_and_a_debugger() -> None:
    assert debugger_in([pdb.Pdb().trace_dispatch]) == "a trace function from bdb"
    assert debugger_in([bdb.Bdb().trace_dispatch]) == "a trace function from bdb"


def test_a_module_part_that_only_starts_with_a_debuggers_name_counts_as_pytest_timeout_says() -> (
    None
):
    assert debuggers.is_debugger_module("tools.bdb_extras")
    assert debuggers.is_debugger_module("pydevd_tracing")
    assert not debuggers.is_debugger_module("mybdb.trace")
    assert not debuggers.is_debugger_module("debugpy.server.api")  # not in pytest-timeout's list


def test_coverages_tracers_are_not_debuggers() -> None:
    pytracer = pytest.importorskip("coverage.pytracer")
    traces: list[object] = [pytracer.PyTracer()._trace]
    with_c = pytest.importorskip("coverage.tracer", reason="coverage without its C tracer")
    traces.append(with_c.CTracer())
    assert debugger_in(traces) is None


def test_no_trace_or_a_plain_one_is_no_debugger() -> None:
    def trace(frame: types.FrameType, event: str, arg: Any) -> object:
        return trace

    assert debugger_in([None]) is None
    assert debugger_in([trace]) is None
    assert debugger_in([]) is None


def test_the_known_modules_are_pytest_timeouts() -> None:
    pytest_timeout = pytest.importorskip("pytest_timeout")
    assert set(pytest_timeout.KNOWN_DEBUGGING_MODULES) == debuggers.KNOWN_DEBUGGING_MODULES


def test_a_sys_monitoring_debugger_tool_is_a_debugger() -> None:
    assert debugger_in([], "pydevd") == "the sys.monitoring debugger tool 'pydevd'"
    assert debugger_in([None], None) is None


@pytest.mark.skipif(not hasattr(sys, "monitoring"), reason="sys.monitoring is Python 3.12+")
def test_only_the_debugger_tool_id_of_sys_monitoring_counts() -> None:
    monitoring: Any = getattr(sys, "monitoring")  # noqa: B009  (3.12+ only)
    for tool_id, name, expected in [
        (monitoring.COVERAGE_ID, "coverage", None),
        (monitoring.DEBUGGER_ID, "pydevd", "pydevd"),
    ]:
        if monitoring.get_tool(tool_id) is not None:
            pytest.skip(f"tool id {tool_id} is in use ({monitoring.get_tool(tool_id)})")
        monitoring.use_tool_id(tool_id, name)
        try:
            assert debuggers.monitoring_debugger() == expected
        finally:
            monitoring.free_tool_id(tool_id)


def _waiting_in(tracer: object, stopped: threading.Event, release: threading.Event) -> None:
    """A thread under ``tracer`` that waits in a traced frame, as at a breakpoint."""

    def at_breakpoint() -> None:
        stopped.set()
        release.wait(10)

    sys.settrace(tracer)  # type: ignore[arg-type]
    try:
        at_breakpoint()
    finally:
        sys.settrace(None)


@pytest.fixture
def thread_at_a_breakpoint() -> Iterator[threading.Thread]:
    """A thread stopped in a frame traced by pydevd's trace function."""
    stopped, release = threading.Event(), threading.Event()
    thread = threading.Thread(
        target=_waiting_in, args=(_module("pydevd").trace_dispatch, stopped, release)
    )
    thread.start()
    assert stopped.wait(10)
    yield thread
    release.set()
    thread.join(10)


def test_the_watch_reads_the_tests_thread_not_the_one_that_asks(
    thread_at_a_breakpoint: threading.Thread,
) -> None:
    assert thread_at_a_breakpoint.ident is not None
    held = DebuggerWatch("test_x.py::test_x", thread_at_a_breakpoint.ident, tool=lambda: None)
    assert held.debugger() == "a trace function from pydevd"
    note = held()
    assert note is not None and note.startswith("test_x.py::test_x: its deadline came while")
    assert "--timeout-disable-debugger-detection" in note
    # the thread that asks (the watchdog's, here this one) has no debugger's trace
    ours = DebuggerWatch("test_x.py::test_x", threading.get_ident(), tool=lambda: None)
    assert ours.debugger() is None and ours() is None


def test_the_trace_the_test_had_at_its_phases_start_counts() -> None:
    watch = DebuggerWatch("t", threading.get_ident(), tool=lambda: None)
    watch.saw(_module("pydevd").trace_dispatch)  # an IDE ran pytest under its debugger
    assert watch.debugger() == "a trace function from pydevd"
    watch.saw(None)
    assert watch.debugger() is None


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ((True, "pydevd"), "a trace function from pydevd"),  # set in the test's body
        ((True, "coverage.pytracer"), None),  # coverage is no debugger
        ((True, None), None),
        ((False, None), None),  # no answer in time (a call no signal interrupts): no debugger
    ],
)
def test_the_tests_thread_is_asked_itself_when_its_frames_show_nothing(
    answer: tuple[bool, str | None], expected: str | None
) -> None:
    answered, module = answer
    trace = _module(module).trace_dispatch if module is not None else None
    asked: list[int] = []

    def ask() -> tuple[bool, object]:
        asked.append(1)
        return answered, trace

    watch = DebuggerWatch("t", threading.get_ident(), tool=lambda: None, ask=ask)
    assert watch.debugger() == expected
    assert asked == [1]


def test_the_tests_thread_is_not_asked_when_its_frames_already_show_a_debugger() -> None:
    def ask() -> tuple[bool, object]:
        raise AssertionError("asked, though the trace at the phase's start was a debugger's")

    watch = DebuggerWatch("t", threading.get_ident(), tool=lambda: None, ask=ask)
    watch.saw(_module("pydevd").trace_dispatch)
    assert watch.debugger() == "a trace function from pydevd"


def test_a_failing_check_is_no_debugger() -> None:
    def broken() -> dict[int, types.FrameType]:
        raise RuntimeError("no frames")

    watch = DebuggerWatch("t", threading.get_ident(), frames=broken, tool=lambda: None)
    assert watch() is None  # the hang is reported as it would be without the check


def test_the_stack_walk_is_bounded() -> None:
    frame = sys._getframe()
    assert len(debuggers.stack_traces(frame, limit=1)) <= 1


@pytest.mark.parametrize(
    ("args", "ini", "expected"),
    [
        ((), None, False),
        (("--timeout-disable-debugger-detection",), None, True),
        ((), "true", True),
        ((), "false", False),
    ],
)
def test_pytest_timeouts_switch_turns_detection_off(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    args: tuple[str, ...],
    ini: str | None,
    expected: bool,
) -> None:
    pytest.importorskip("pytest_timeout")
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    if ini is not None:
        pytester.makeini(f"[pytest]\n{debuggers.DISABLE_INI} = {ini}\n")
    config = pytester.parseconfig("-p", "pytest_timeout", *args)
    assert debuggers.detection_disabled(config) is expected


def test_a_bad_value_of_pytest_timeouts_ini_key_is_a_usage_error_naming_it(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("pytest_timeout")
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makeini(f"[pytest]\n{debuggers.DISABLE_INI} = maybe\n")
    config = pytester.parseconfig("-p", "pytest_timeout")
    with pytest.raises(pytest.UsageError, match=f"ini option {debuggers.DISABLE_INI} .*maybe"):
        debuggers.detection_disabled(config)


def test_without_pytest_timeout_detection_is_on(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    config = pytester.parseconfig()
    assert debuggers.detection_disabled(config) is False

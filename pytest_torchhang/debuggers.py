"""Whether a debugger holds the test: pytest-timeout's ``is_debugging``, read for the test's thread.

pytest-timeout lets a test be while a debugger is attached (users count on it: a breakpoint in
PyCharm or VS Code is not a hang). Its rule, followed here exactly:

- the trace function comes from a module whose dotted name has a part starting with one of
  ``KNOWN_DEBUGGING_MODULES`` (``bdb`` covers pdb and ipdb; ``pydevd`` covers PyCharm's debugger
  and VS Code's debugpy, which runs a vendored pydevd);
- on Python 3.12+, a tool holds ``sys.monitoring.DEBUGGER_ID`` (pydevd and debugpy register
  there);
- pytest's own pdb was entered (``pytest_enter_pdb``), or a post-mortem debugger is about to be
  (``pytest_exception_interact`` under ``--pdb``): the plugin's hooks pause the test for that;
- ``--timeout-disable-debugger-detection`` / ini ``timeout_disable_debugger_detection``
  (pytest-timeout's own switch) turns all of it off.

pytest-timeout asks ``sys.gettrace()`` in its SIGALRM handler, that is on the test's thread. The
watchdog decides on its own thread, whose trace function is not the test's; so the test's thread
is read from outside: the trace function it had when its phase began (an IDE that started pytest
under its debugger), and the local trace function of every frame of its stack now (a debugger
set in the test itself: ``pdb.Pdb().set_trace()`` and pydevd both trace the frame they stop in).
When neither shows a debugger and the test runs in the main thread, that thread is asked itself,
as pytest-timeout's handler does (``ask``: our interrupt signal's handler reads its
``sys.gettrace()``): a ``sys.settrace(pydevd.trace)`` in the test's body sets no frame's trace
until a Python function is called, and a test blocked in C calls none. A test in another thread
(pytest run in a thread of a host program) cannot be asked: there only its frames are read.
Coverage's tracer (``coverage.tracer.CTracer``, ``coverage.pytracer``) is not a debugger, and a
hang under ``pytest --cov`` fires as any other.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest

#: pytest-timeout's list (``pytest_timeout.KNOWN_DEBUGGING_MODULES``): a module name part that
#: starts with one of these makes its trace function a debugger's.
KNOWN_DEBUGGING_MODULES = frozenset({"pydevd", "bdb", "pydevd_frame_evaluator"})
#: pytest-timeout's switch that turns debugger detection off (its option, and its ini key).
DISABLE_OPTION = "--timeout-disable-debugger-detection"
DISABLE_INI = "timeout_disable_debugger_detection"
#: ``sys.monitoring.DEBUGGER_ID`` (Python 3.12+), the tool id debuggers register under.
DEBUGGER_ID = 0
#: A stack is read this deep at most (a recursion of the test must not make the check long).
MAX_FRAMES = 1000


def trace_module(trace: object) -> str:
    """The name of the module a trace function (or a tracer object) comes from ('' when none).

    pytest-timeout asks ``inspect.getmodule(trace) or inspect.getmodule(trace.__class__)``: the
    same names, read without ``sys.modules``, since pytester's inline sessions take modules out.
    """
    module = getattr(trace, "__module__", None)
    if not isinstance(module, str):
        module = getattr(type(trace), "__module__", None)
    return module if isinstance(module, str) else ""


def is_debugger_module(name: str) -> bool:
    """Whether a trace function from module ``name`` is a debugger's (pytest-timeout's test:
    some part of the dotted name starts with a known debugging module's name)."""
    parts = name.split(".")
    return any(part.startswith(known) for known in KNOWN_DEBUGGING_MODULES for part in parts)


def debugger_in(traces: Iterable[object], monitoring_tool: str | None = None) -> str | None:
    """The debugger among ``traces`` (trace functions) and the ``sys.monitoring`` debugger tool,
    described for a note, or None: coverage's tracer, or no trace at all."""
    for trace in traces:
        if trace is None:
            continue
        name = trace_module(trace)
        if is_debugger_module(name):
            return f"a trace function from {name}"
    if monitoring_tool is not None:
        return f"the sys.monitoring debugger tool {monitoring_tool!r}"
    return None


def monitoring_debugger() -> str | None:
    """The tool holding ``sys.monitoring.DEBUGGER_ID`` (Python 3.12+), or None."""
    monitoring = getattr(sys, "monitoring", None)
    if monitoring is None:
        return None
    tool: str | None = monitoring.get_tool(getattr(monitoring, "DEBUGGER_ID", DEBUGGER_ID))
    return tool


def stack_traces(frame: FrameType | None, limit: int = MAX_FRAMES) -> list[object]:
    """The local trace functions set on ``frame`` and its callers (a debugger traces the frames
    it may stop in: ``pdb.set_trace`` sets every caller's; pydevd the frame of a breakpoint)."""
    traces: list[object] = []
    while frame is not None and limit > 0:
        if frame.f_trace is not None:
            traces.append(frame.f_trace)
        frame = frame.f_back
        limit -= 1
    return traces


def detection_disabled(config: pytest.Config) -> bool:
    """pytest-timeout's ``--timeout-disable-debugger-detection`` or its ini key (both False
    when pytest-timeout is not installed or disabled: they do not exist then)."""
    import pytest

    if config.getoption("timeout_disable_debugger_detection", None):
        return True
    try:
        value: object = config.getini(DISABLE_INI)
    except pytest.UsageError as exc:  # pytest's own message names the value, not the key
        raise pytest.UsageError(
            f"ini option {DISABLE_INI} (pytest-timeout's) must be true or false: {exc}"
        ) from exc
    except ValueError:  # pytest-timeout is not installed (or disabled): no such key
        return False
    if isinstance(value, str):  # a pytest older than 9 hands a bool key's text over as it is
        value = value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


class DebuggerWatch:
    """One test's debugger check: its thread, and the trace function it had when its phase
    began (``saw``, called on that thread). Called, it gives the session's note when a debugger
    holds the test now, else None."""

    def __init__(
        self,
        test_id: str,
        thread_id: int,
        frames: Callable[[], dict[int, FrameType]] = sys._current_frames,
        tool: Callable[[], str | None] = monitoring_debugger,
        ask: Callable[[], tuple[bool, object]] | None = None,
    ) -> None:
        self.test_id = test_id
        self.thread_id = thread_id
        self.trace: object = None  # the test thread's sys.gettrace() when its phase began
        self._frames = frames
        self._tool = tool
        #: asks the test's own thread for its ``sys.gettrace()`` now: (answered, trace)
        self._ask = ask

    def saw(self, trace: object) -> None:
        """The test's thread, at a phase's start: its own ``sys.gettrace()``."""
        self.trace = trace

    def debugger(self) -> str | None:
        """The debugger holding the test now, described, or None (any thread may ask)."""
        frame = self._frames().get(self.thread_id)
        try:
            found = debugger_in([self.trace, *stack_traces(frame)], self._tool())
        finally:
            del frame  # a frame kept alive keeps the test's locals alive
        if found is None and self._ask is not None:
            answered, trace = self._ask()
            if answered:
                found = debugger_in([trace])
        return found

    def __call__(self) -> str | None:
        try:
            found = self.debugger()
        except Exception:  # the check must never stand between a hang and its report
            return None
        return held_note(self.test_id, found) if found is not None else None


def held_note(test_id: str, debugger: str) -> str:
    """The session's note for a deadline held for a debugger."""
    return (
        f"{test_id}: its deadline came while a debugger held the test ({debugger}); as "
        "pytest-timeout does, the test was left to run with no deadline: no hang was declared "
        f"and nothing was killed ({DISABLE_OPTION} or ini {DISABLE_INI} turns this off)"
    )

"""The user's world: tests that patch the clock (monkeypatch, freezegun, time-machine) under a timeout.

A test may replace ``time.monotonic``, freeze it or move wall time: the plugin's deadlines must
not move with it. A passing test that sleeps 1.5 s under such a patch passes (no false hang, and
no capture to wait for), and a test that really hangs is reported as a plain HANG by the
in-process watchdog at its timeout, never by the monitor's last resort (which would end the whole
session with a GIL hint). Each session runs every tool twice, a pass and a hang, under our
timeout or pytest-timeout's ``--timeout``. No torch: these sessions start in a second, and the
two timeouts' sessions run at the same time (``world``): they mostly sleep and wait.
"""

from __future__ import annotations

import re

import pytest

from conftest import GuardedRunner, Session, assert_hang, batch_runner
from matrix_scenarios import LATE_S
from outcomes import assert_outcomes

pytest.importorskip("freezegun")
pytest.importorskip("time_machine")


TIMEOUT_S = 3.0
SLEEP_S = 1.5

#: Each tool as a test uses it: a fixture that patches the clock for setup, call and teardown.
TESTS = f"""
import threading
import time

import freezegun
import pytest
import time_machine

REAL_MONOTONIC = time.monotonic
TOOLS = [
    "monotonic-plus-1000",
    "monotonic-frozen-at-0",
    "freezegun-ticking",
    "freezegun-frozen",
    "time-machine",
]


@pytest.fixture
def patched_clock(request, monkeypatch):
    tool = request.param
    if tool == "monotonic-plus-1000":
        monkeypatch.setattr(time, "monotonic", lambda: REAL_MONOTONIC() + 1000.0)
        yield
    elif tool == "monotonic-frozen-at-0":
        monkeypatch.setattr(time, "monotonic", lambda: 0.0)
        yield
    elif tool == "freezegun-ticking":
        with freezegun.freeze_time("2001-01-01", tick=True):
            yield
    elif tool == "freezegun-frozen":
        with freezegun.freeze_time("2001-01-01"):
            assert time.monotonic() == time.monotonic()
            yield
    else:
        with time_machine.travel(0.0, tick=False):
            assert time.time() < 1.0
            yield


@pytest.mark.parametrize("patched_clock", TOOLS, indirect=True)
def test_passes(patched_clock):
    time.sleep({SLEEP_S})  # no tool patches sleep: 1.5 s of real time


@pytest.mark.parametrize("patched_clock", TOOLS, indirect=True)
def test_hangs(patched_clock):
    threading.Event().wait()  # a C-level wait on the real clock, for ever
"""

TOOLS = [
    "monotonic-plus-1000",
    "monotonic-frozen-at-0",
    "freezegun-ticking",
    "freezegun-frozen",
    "time-machine",
]
_ELAPSED = re.compile(r"^HANG after (\d+(?:\.\d+)?)s in ")


#: The deadline's sources, by test id.
TIMEOUT_ARGS = {
    "torch-hang-timeout": (f"--torch-hang-timeout={TIMEOUT_S:g}",),
    "pytest-timeout": (f"--timeout={TIMEOUT_S:g}",),
}


@pytest.fixture(scope="module")
def world(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Session]:
    """One session per deadline source, both at once."""
    with batch_runner(request, tmp_path_factory) as guarded:
        guarded.pytester.makepyfile(test_world=TESTS)
        args = {key: (*a, "-v", "-p", "no:randomly") for key, a in TIMEOUT_ARGS.items()}
        return guarded.run_many(args, at_once=2, timeout=None, wait_s=240)


@pytest.mark.parametrize("source", list(TIMEOUT_ARGS))
def test_a_patched_clock_neither_fails_a_passing_test_nor_hides_a_hang(
    world: dict[str, Session], source: str
) -> None:
    session = world[source]
    text = session.text
    assert "session stopped" not in text, text[-6000:]
    assert "holding the GIL" not in text and "INTERNALERROR" not in text, text[-6000:]
    assert_outcomes(session.result, passed=len(TOOLS), hang=len(TOOLS))
    for tool in TOOLS:
        assert f"test_world.py::test_passes[{tool}] PASSED" in text, tool
        report = assert_hang(session, f"test_hangs[{tool}]", "*threading.Event().wait()*")
        headline = next(line for line in report.splitlines() if line.startswith("HANG after"))
        match = _ELAPSED.match(headline)
        assert match, headline
        assert TIMEOUT_S - 0.05 <= float(match.group(1)) <= TIMEOUT_S + LATE_S, headline
    # Five passes of 1.5 s and five hangs of 3 s, each captured at once: nobody waited for a
    # capture that nobody ran (30 s each), nor for a watchdog that never woke.
    assert session.wall_s < len(TOOLS) * (SLEEP_S + TIMEOUT_S + LATE_S) + 15, session.wall_s
    session.assert_clean()


LONG_THEN_HANG = f"""
import threading
import time

import pytest


def test_passes():
    time.sleep(0.5)  # under pytest-timeout's 1e10 s alone, long enough for the watchdog to wait


@pytest.mark.torch_hang(timeout={TIMEOUT_S})
def test_hangs():
    threading.Event().wait()
"""


def test_pytest_timeout_s_value_too_long_for_a_timed_wait_leaves_the_guard_working(
    guarded: GuardedRunner,
) -> None:
    """pytest-timeout takes ``--timeout=1e10`` (its own value, not ours to refuse): the watchdog
    thread waits it out in bounded steps (a timed wait that long overflowed and killed it), and
    the next test's own timeout fires as usual."""
    guarded.pytester.makepyfile(test_long=LONG_THEN_HANG)
    # In file order (pytester drops PYTEST_ADDOPTS, so pytest-randomly may be on in here).
    session = guarded.run("--timeout=1e10", "-p", "no:randomly", timeout=None, wait_s=120)
    text = session.text
    assert "session stopped" not in text and "holding the GIL" not in text, text[-6000:]
    assert_outcomes(session.result, passed=1, hang=1)
    assert_hang(session, "test_hangs", "*threading.Event().wait()*")
    assert "the watchdog failed" not in text, text[-6000:]
    session.assert_clean()


CALLS = """
import threading
import time

import freezegun
import pytest

REAL_MONOTONIC = time.monotonic
TOOLS = ["monotonic-plus-1000", "monotonic-frozen-at-0", "freezegun-frozen"]


def block():
    threading.Event().wait()


@pytest.fixture
def patched_clock(request, monkeypatch):
    if request.param == "monotonic-plus-1000":
        monkeypatch.setattr(time, "monotonic", lambda: REAL_MONOTONIC() + 1000.0)
        yield
    elif request.param == "monotonic-frozen-at-0":
        monkeypatch.setattr(time, "monotonic", lambda: 0.0)
        yield
    else:
        with freezegun.freeze_time("2001-01-01"):
            yield


@pytest.mark.parametrize("patched_clock", TOOLS, indirect=True)
def test_call_passes(patched_clock, torch_hang):
    assert torch_hang.run(time.sleep, 0.5, timeout=3) is None


@pytest.mark.parametrize("patched_clock", TOOLS, indirect=True)
def test_call_hangs(patched_clock, torch_hang):
    torch_hang.run(block, timeout=2)
"""


def test_a_fixture_call_under_a_patched_clock_keeps_its_own_timeout(
    guarded: GuardedRunner,
) -> None:
    """The runner's waits (for the child, its outcome, its reaping) count on the plugin's clock."""
    guarded.monkeypatch.setenv("PYTEST_TORCH_HANG_ZYGOTE_PRELOAD", "")  # no torch: a fast start
    guarded.pytester.makepyfile(test_calls=CALLS)
    session = guarded.run("-v", "-p", "no:randomly", timeout=30, wait_s=180)
    text = session.text
    assert "session stopped" not in text and "holding the GIL" not in text, text[-6000:]
    assert_outcomes(session.result, passed=3, hang=3)
    for tool in ("monotonic-plus-1000", "monotonic-frozen-at-0", "freezegun-frozen"):
        assert f"test_calls.py::test_call_passes[{tool}] PASSED" in text, tool
        report = assert_hang(session, f"test_call_hangs[{tool}]", "*threading.Event().wait()*")
        headline = next(line for line in report.splitlines() if line.startswith("HANG after"))
        match = _ELAPSED.match(headline)
        assert match and 2.0 - 0.05 <= float(match.group(1)) <= 2.0 + LATE_S, headline
    assert session.wall_s < 3 * (0.5 + 2.0 + LATE_S) + 20, session.wall_s
    session.assert_clean()

"""Where the timeout comes from (ini < env < CLI < marker), its validation, and what it covers."""

from __future__ import annotations

import pytest

from conftest import GuardedRunner, assert_hang
from outcomes import assert_outcomes

ONE_TEST = "def test_one():\n    pass\n"


#: One value through a real session: the fast tier checks every bad value's message
#: (tests/unit/test_settings.py, test_a_bad_command_line_value_is_a_usage_error_naming_the_option).
@pytest.mark.parametrize("value", ["abc"])
def test_an_invalid_command_line_value_is_a_usage_error(
    pytester: pytest.Pytester, value: str
) -> None:
    pytester.makepyfile(ONE_TEST)
    result = pytester.runpytest_subprocess(f"--torch-hang-timeout={value}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            f"*--torch-hang-timeout must be a finite number of seconds >= 0 (0 turns the guard off), got '{value}'"
        ]
    )


def test_an_invalid_ini_value_names_the_ini_key(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(ONE_TEST)
    pytester.makeini("[pytest]\ntorch_hang_timeout = soon\n")
    result = pytester.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*ini option torch_hang_timeout must be a finite number*got 'soon'"]
    )


def test_an_invalid_environment_value_names_the_variable(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(ONE_TEST)
    monkeypatch.setenv("PYTEST_TORCH_HANG_TIMEOUT", "-5")
    result = pytester.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*environment variable PYTEST_TORCH_HANG_TIMEOUT must be*got '-5'"]
    )


@pytest.mark.parametrize(
    ("marker", "message"),
    [
        (
            'timeout="soon"',
            "*torch_hang on test_bad.py::test_one: timeout must be a finite number*got 'soon'",
        ),
        (
            "timeout=-1",
            "*torch_hang on test_bad.py::test_one: timeout must be a finite number*got -1",
        ),
        (
            "bogus=1",
            "*torch_hang on test_bad.py::test_one: takes (timeout=None, stall=None, isolate=False)*",
        ),
        ('isolate="yes"', "*isolate must be True or False, got 'yes'"),
    ],
)
def test_an_invalid_marker_is_a_usage_error_naming_the_test(
    pytester: pytest.Pytester, marker: str, message: str
) -> None:
    pytester.makepyfile(
        test_bad=f"import pytest\n\n@pytest.mark.torch_hang({marker})\ndef test_one():\n    pass\n"
    )
    result = pytester.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


@pytest.mark.parametrize(
    ("ini", "env", "cli", "expected"),
    [
        ("7", None, None, "timeout 7s (from ini)"),
        ("7", "8", None, "timeout 8s (from env)"),
        ("7", "8", "9", "timeout 9s (from command line)"),
        (None, "8", "9", "timeout 9s (from command line)"),
    ],
)
def test_ini_env_and_command_line_apply_in_that_order(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    ini: str | None,
    env: str | None,
    cli: str | None,
    expected: str,
) -> None:
    pytester.makepyfile(ONE_TEST)
    if ini is not None:
        pytester.makeini(f"[pytest]\ntorch_hang_timeout = {ini}\n")
    if env is not None:
        monkeypatch.setenv("PYTEST_TORCH_HANG_TIMEOUT", env)
    args = [f"--torch-hang-timeout={cli}"] if cli is not None else []
    result = pytester.runpytest_subprocess("--co", *args)
    result.stdout.fnmatch_lines([f"*{expected}*"])


MARKERS = """
import time

import pytest


@pytest.mark.torch_hang(timeout=1)
def test_marker_is_stricter_than_the_command_line():
    time.sleep(30)


@pytest.mark.torch_hang(timeout=0)
def test_marker_zero_turns_the_guard_off():
    time.sleep(2.5)


@pytest.mark.torch_hang(8)  # looser than the command line's 2s, with room for a busy machine
def test_marker_positional_timeout_is_looser():
    time.sleep(2.5)


@pytest.fixture
def slow_setup():
    time.sleep(30)


@pytest.fixture
def slow_teardown():
    yield
    time.sleep(30)


def test_hang_in_setup(slow_setup):
    pass


def test_hang_in_teardown(slow_teardown):
    pass


def test_next_test_runs():
    pass
"""


def test_the_marker_wins_and_the_deadline_covers_setup_and_teardown(guarded: GuardedRunner) -> None:
    guarded.pytester.makepyfile(test_markers=MARKERS)
    session = guarded.run(timeout=2, grace_s=5)
    # hangs in setup and teardown count as hangs too (their sections say the phase)
    assert_outcomes(session.result, hang=3, passed=4)
    assert_hang(session, "test_marker_is_stricter_than_the_command_line", "HANG after 1.*")
    assert_hang(
        session,
        "test_hang_in_setup",
        "HANG after 2.* in test_markers.py::test_hang_in_setup (during setup)*",
        "*time.sleep(30)",
    )
    teardown = session.result.stdout.str()
    assert "test_hang_in_teardown (during teardown)" in teardown
    session.assert_clean()


INERT = """
import os
import threading

import psutil


def _of_the_plugin(thread):
    # other plugins start threads of their own (pytest-rerunfailures' status server)
    owner = getattr(thread, "_target", None) or thread
    return getattr(owner, "__module__", "").startswith("pytest_torchhang")


def test_the_plugin_left_nothing_behind():
    assert [t.name for t in threading.enumerate() if _of_the_plugin(t)] == []
    assert "PYTEST_TORCH_HANG_DUMP_DIR" not in os.environ
    assert os.path.join("pytest_torchhang", "inject") not in os.environ.get("PYTHONPATH", "")
    assert psutil.Process().children() == []
"""


def test_without_a_timeout_the_plugin_is_inert(guarded: GuardedRunner) -> None:
    guarded.pytester.makepyfile(test_inert=INERT)
    session = guarded.run(timeout=None)
    assert_outcomes(session.result, passed=1)
    assert "torch-hang summary" not in session.result.stdout.str()


def test_a_passing_suite_under_a_timeout_just_passes(guarded: GuardedRunner) -> None:
    guarded.pytester.makepyfile(
        test_pass="def test_a():\n    pass\n\ndef test_b():\n    assert 1\n"
    )
    session = guarded.run(timeout=30)
    assert_outcomes(session.result, passed=2)
    assert "HANG" not in session.result.stdout.str()
    session.assert_clean()


def test_under_xdist_an_invalid_marker_fails_collection_with_its_message(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        test_bad="import pytest\n\n@pytest.mark.torch_hang(timeout=-1)\ndef test_one():\n    pass\n"
    )
    result = pytester.runpytest_subprocess("-n", "2")
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    result.stdout.fnmatch_lines(["*torch_hang on test_bad.py::test_one: timeout must be a finite*"])
    assert result.ret != 0


def test_it_works_with_pytest_timeout_disabled(guarded: GuardedRunner) -> None:
    guarded.pytester.makepyfile(
        test_one="import time\n\ndef test_hangs():\n    time.sleep(30)\n\ndef test_passes():\n    pass\n"
    )
    session = guarded.run("-p", "no:timeout", timeout=1)
    assert_outcomes(session.result, hang=1, passed=1)
    assert_hang(session, "test_hangs", "*time.sleep(30)")

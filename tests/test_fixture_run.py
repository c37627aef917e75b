"""``torch_hang.run`` and ``isolate=True``: results, remote exceptions, crashes, hangs, bad input."""

from __future__ import annotations

from conftest import GuardedRunner, assert_hang
from outcomes import assert_outcomes

RUN = """
import os
import signal
import time

import pytest

from pytest_torchhang import ChildCrashed, HangError
from pytest_torchhang.report.text import to_text


def add(a, b=0):
    return a + b


def fail_deep():
    def inner():
        raise KeyError("no such key in the child")
    inner()


def segfault():
    import ctypes
    ctypes.string_at(0)


def kill_self():
    os.kill(os.getpid(), signal.SIGKILL)


def exit_three():
    os._exit(3)


def wait_forever():
    import threading
    threading.Event().wait()


def echo_env():
    return os.environ.get("MY_FLAG")


@pytest.mark.parametrize("method", ["zygote", "spawn", "forkserver"])
def test_result(torch_hang, method):
    assert torch_hang.run(add, 2, b=3, start_method=method) == 5
    assert torch_hang.run(echo_env, env={"MY_FLAG": "on"}, start_method=method) == "on"


def test_exception_keeps_type_message_and_remote_traceback(torch_hang):
    with pytest.raises(KeyError, match="no such key in the child") as info:
        torch_hang.run(fail_deep)
    remote = str(info.value.__cause__)
    assert "in inner" in remote and 'raise KeyError("no such key in the child")' in remote
    assert any("raised in torch_hang.run(fail_deep) child (pid" in n for n in info.value.__notes__)


def test_segfault_is_a_crash_with_its_trace(torch_hang):
    with pytest.raises(ChildCrashed, match="was killed by SIGSEGV") as info:
        torch_hang.run(segfault)
    assert info.value.signal == "SIGSEGV"
    assert "Segmentation fault" in info.value.crash_trace
    assert "in segfault" in info.value.crash_trace


def test_sigkill_names_the_oom_killer(torch_hang):
    with pytest.raises(ChildCrashed, match=r"SIGKILL \\(possibly the OOM killer\\)"):
        torch_hang.run(kill_self)


def test_exit_code_without_result(torch_hang):
    with pytest.raises(ChildCrashed, match="exited with code 3 without returning a result"):
        torch_hang.run(exit_three)


def test_a_hang_is_a_hang_error_with_the_stuck_frame(torch_hang):
    started = time.monotonic()
    with pytest.raises(HangError) as info:
        torch_hang.run(wait_forever, timeout=1)
    assert time.monotonic() - started < 20  # wide: well below the test's own 60s deadline
    text = to_text(info.value.report)
    assert "HANG after 1." in text and "torch_hang.run(wait_forever)" in text
    assert "in wait_forever" in text and "threading.Event().wait()" in text
    assert "cleanup: killed 1 process" in text


def test_an_uncaught_hang_fails_the_test_as_a_hang(torch_hang):
    torch_hang.run(wait_forever, timeout=1)


def test_bad_input_is_refused_before_any_process_starts(torch_hang):
    with pytest.raises(TypeError, match="must be picklable.*Define it at module level"):
        torch_hang.run(lambda: 1)
    with pytest.raises(ValueError, match="start_method must be one of zygote, spawn, forkserver"):
        torch_hang.run(add, 1, start_method="thread")
    with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
        torch_hang.run(add, 1, timeout=-1)


def test_a_dead_zygote_is_replaced(torch_hang):
    assert torch_hang.run(add, 1) == 1
    runner = torch_hang._get_runner()
    zygote = runner.zygote()
    os.kill(zygote.pid, signal.SIGKILL)
    zygote.proc.wait()
    assert torch_hang.run(add, 2) == 2
    assert runner.zygote().pid != zygote.pid
"""


ISOLATED = """
import ctypes
import os

import pytest


@pytest.fixture
def numbers():
    return [1, 2, 3]


@pytest.mark.torch_hang(isolate=True)
def test_body_runs_in_a_child(numbers):
    assert sum(numbers) == 6
    assert os.getpid() != int(os.environ["PYTEST_PID"])


@pytest.mark.torch_hang(isolate=True)
def test_assertion_in_the_child_fails_the_test(numbers):
    assert sum(numbers) == 7


@pytest.mark.torch_hang(isolate=True)
def test_segfault_in_the_child():
    ctypes.string_at(0)


@pytest.mark.torch_hang(timeout=2, isolate=True)
def test_gil_held_in_c_in_the_child():
    libc = ctypes.PyDLL(None)
    mutex = ctypes.create_string_buffer(64)
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)


@pytest.fixture
def unpicklable():
    return lambda: 1


@pytest.mark.torch_hang(isolate=True)
def test_unpicklable_fixture(unpicklable):
    pass


def test_next_test_runs_in_pytest():
    assert os.getpid() == int(os.environ["PYTEST_PID"])
"""

ISOLATED_CONFTEST = """
import os


def pytest_configure(config):
    os.environ["PYTEST_PID"] = str(os.getpid())
"""


def test_run_returns_raises_crashes_and_hangs_and_isolated_tests_run_in_a_child(
    guarded: GuardedRunner,
) -> None:
    # one inner session for both: pytest and the zygote start once
    guarded.pytester.makeconftest(ISOLATED_CONFTEST)
    guarded.pytester.makepyfile(test_run=RUN, test_isolated=ISOLATED)
    session = guarded.run(timeout=60)  # spawn and forkserver children import torch
    assert_outcomes(session.result, passed=10 + 2, failed=0 + 3, hang=1 + 1)
    assert_hang(
        session,
        "test_an_uncaught_hang_fails_the_test_as_a_hang",
        "HANG after 1.* in torch_hang.run(wait_forever) in test_run.py::test_an_uncaught_hang*",
        "*[[]torch_hang.run(wait_forever) child[]]*",
        "*threading.Event().wait()",
    )
    # isolate=True: the test body runs in a child, and a GIL hang there spares the session
    # the child imports the test module without pytest's assertion rewriting: the remote
    # traceback shows the failing line
    failed = session.report_of("test_assertion_in_the_child_fails_the_test")
    assert "assert sum(numbers) == 7" in failed and "AssertionError" in failed
    assert "was killed by SIGSEGV" in session.report_of("test_segfault_in_the_child")
    assert_hang(
        session,
        "test_gil_held_in_c_in_the_child",
        "*[[]isolated test test_isolated.py::test_gil_held_in_c_in_the_child child[]]*",
        "*libc.pthread_mutex_lock(mutex)",
    )
    unpicklable = session.report_of("test_unpicklable_fixture")
    assert "fixture values must be picklable; 'unpicklable' is not" in unpicklable
    session.assert_clean()

"""The plugin never breaks the session: no INTERNALERROR, no dead watchdog, no killed host."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from conftest import GuardedRunner, assert_hang
from matrix_scenarios import LATE_S
from outcomes import assert_outcomes
from pytest_torchhang.exceptions import HangError, make_renderable

# --- tracebacks pytest can always render -----------------------------------------------------


def _cleanup_code_frame() -> types.FrameType:
    import contextlib
    import sys as _sys

    with contextlib.nullcontext():
        try:
            return _sys._getframe()
        finally:
            pass


def _lineless_index(code: types.CodeType) -> int:
    """An instruction of ``code`` with no line of its own (exception cleanup, for one): an
    interrupt that lands there gives a traceback entry whose ``tb_lineno`` is None."""
    return next(start for start, _end, line in code.co_lines() if line is None)


#: Instructions without a line of their own (and so tracebacks pytest cannot render) come with
#: Python 3.11's line tables. On 3.10 a tight loop such as ``while True: try/finally`` does not
#: look for signals at all: it keeps the GIL, and the monitor ends the session (the documented
#: "GIL held" case), so the busy-code test below is for 3.11+ too.
LINE_TABLES = pytest.mark.skipif(
    sys.version_info < (3, 11), reason="line-less instructions exist from Python 3.11 on"
)


@LINE_TABLES
def test_a_traceback_entry_without_a_line_number_gets_the_nearest_line() -> None:
    frame = _cleanup_code_frame()
    entry = types.TracebackType(None, frame, _lineless_index(frame.f_code), -1)
    assert entry.tb_lineno is None
    error = HangError("HANG after 1.0s in test_x")
    error.__traceback__ = entry
    outer = RuntimeError("raised while the hang propagated")
    outer.__context__ = error
    assert make_renderable(outer)
    assert error.__traceback__ is not None
    assert isinstance(error.__traceback__.tb_lineno, int)
    assert not make_renderable(outer)  # nothing left to change


UNRENDERABLE = """
import contextlib
import sys
import types

from pytest_torchhang import HangError


def _frame():
    with contextlib.nullcontext():
        try:
            return sys._getframe()
        finally:
            pass


def test_interrupted_on_an_instruction_without_a_line():
    # what an interrupt landing on an instruction without a line of its own leaves behind
    frame = _frame()
    index = next(start for start, _end, line in frame.f_code.co_lines() if line is None)
    error = HangError("HANG after 1.0s in test_interrupted_on_an_instruction_without_a_line")
    raise error.with_traceback(types.TracebackType(None, frame, index, -1))


def test_after():
    pass
"""


@LINE_TABLES
def test_a_hang_traceback_without_line_numbers_never_ends_the_session(
    guarded: GuardedRunner,
) -> None:
    guarded.pytester.makepyfile(test_unrenderable=UNRENDERABLE)
    session = guarded.run("-p", "no:randomly", timeout=30)
    assert "INTERNALERROR" not in session.text, session.text[-3000:]
    assert_outcomes(session.result, passed=1, failed=1)


BUSY = """
import pytest


def spin_while():
    n = 0
    while True:
        n += 1


def spin_for():
    while True:
        for i in range(1000):
            pass


def spin_comprehension():
    while True:
        [i * i for i in range(200)]


def spin_generator():
    while True:
        sum(i for i in range(200))


def spin_try_finally():
    while True:
        try:
            x = 1
        finally:
            x = 2


def spin_with():
    import contextlib
    while True:
        with contextlib.nullcontext():
            pass


def spin_fstring():
    while True:
        f"{1}{2.0:.1f}{'x'!r}"


def spin_calls():
    def f(a, b=1, *c, **d):
        return a
    while True:
        f(1, 2, 3, x=4)


def spin_except():
    while True:
        try:
            raise KeyError(1)
        except KeyError:
            pass


def spin_dict():
    d = {}
    while True:
        d[len(d) % 97] = d.get(3, 0) + 1


@pytest.mark.parametrize("spin", [spin_while, spin_for, spin_comprehension, spin_generator,
    spin_try_finally, spin_with, spin_fstring, spin_calls, spin_except, spin_dict])
def test_busy(spin):
    spin()


def test_after():
    pass
"""


@LINE_TABLES
def test_interrupting_busy_code_at_many_points_never_ends_the_session(
    guarded: GuardedRunner,
) -> None:
    guarded.pytester.makepyfile(test_busy=BUSY)
    session = guarded.run("-p", "no:randomly", timeout=1)
    assert "INTERNALERROR" not in session.text, session.text[-3000:]
    assert_outcomes(session.result, passed=1, hang=10)
    # Each busy test is interrupted at its deadline: a little late on a loaded machine, never early.
    fired = re.findall(
        r"HANG test_busy\.py::test_busy\[\w+\] - HANG after (\d+\.\d)s", session.text
    )
    assert len(fired) == 10 and all(1.0 <= float(s) <= 1.0 + LATE_S for s in fired), fired


# --- the watchdog outlives its own failures ---------------------------------------------------

HANGS = """
import subprocess
import sys
import time


def test_first_hang():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    time.sleep(60)


def test_second_hang():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    time.sleep(60)


def test_after():
    pass
"""


def test_a_failing_native_tool_never_stops_the_guard(
    guarded: GuardedRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tools = tmp_path / "tools"
    tools.mkdir()
    for name in ("pystack", "py-spy"):  # installed, but broken: its interpreter is missing
        tool = tools / name
        tool.write_text("#!/nonexistent/interpreter\n")
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    guarded.pytester.makepyfile(test_hangs=HANGS)
    session = guarded.run("-p", "no:randomly", "--torch-hang-native", timeout=2)
    assert "INTERNALERROR" not in session.text, session.text[-3000:]
    assert_outcomes(session.result, passed=1, hang=2)
    for name in ("test_first_hang", "test_second_hang"):
        assert_hang(session, name, "cleanup: killed 1 process(es)*")
    session.assert_clean()


# --- pytest in a thread of a host program -------------------------------------------------------

IN_A_THREAD = """
import sys
import threading

import pytest

codes = []
thread = threading.Thread(
    target=lambda: codes.append(int(pytest.main(["-p", "no:cacheprovider", "--torch-hang-timeout=2",
                                             "-p", "no:randomly", "test_threaded.py"])))
)
thread.start()
thread.join(120)
print("host alive, pytest returned", codes)
sys.exit(0 if codes == [1] else 3)
"""

THREADED_TESTS = """
import subprocess
import sys
import time


def test_hangs_on_a_child():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    child.wait()  # returns once the plugin kills the child


def test_spins_in_python():
    while True:
        time.sleep(0.05)


def test_after():
    pass
"""


def test_pytest_in_a_thread_fails_the_hung_test_and_never_kills_the_host(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_threaded=THREADED_TESTS)
    script = pytester.makepyfile(host=IN_A_THREAD)
    result = pytester.run(sys.executable, str(script), timeout=180)
    out = result.stdout.str()
    assert "host alive, pytest returned [1]" in out, out + result.stderr.str()
    assert "Real-time signal" not in result.stderr.str()
    result.stdout.fnmatch_lines(
        [
            "*HANG*test_hangs_on_a_child*",
            "*HANG*test_spins_in_python*",
            "*1 passed, 2 hang*",
        ]
    )
    assert "a thread other than the main one" in out


# --- a session inside a session ---------------------------------------------------------------

NESTED = """
import os
import time

import pytest

from pytest_torchhang.inject import hook
from pytest_torchhang.capture import stacks

pytest_plugins = ["pytester"]

INNER = '''
import time

def test_inner_hang():
    time.sleep(60)
'''


def test_runs_an_inner_session_then_hangs(pytester):
    pytester.makepyfile(test_inner=INNER)
    inner = pytester.runpytest("--torch-hang-timeout=1", "-p", "no:cacheprovider")
    assert inner.parseoutcomes()["hang"] == 1 and inner.ret == 1, inner.stdout.str()
    assert "left running by tests" not in inner.stdout.str()
    # the outer session's guard is intact: its dump hook still answers ...
    assert stacks.handles_signal(os.getpid(), hook.DUMP_SIGNAL)
    assert os.environ.get(hook.DUMP_DIR_ENV)
    # ... and its own deadline still fires
    time.sleep(60)


def test_after():
    pass
"""


def test_a_session_inside_a_session_leaves_the_outer_guard_working(
    guarded: GuardedRunner,
) -> None:
    guarded.pytester.makepyfile(test_nested=NESTED)
    session = guarded.run("-p", "no:randomly", "-p", "pytester", timeout=6)
    assert "INTERNALERROR" not in session.text, session.text[-3000:]
    assert_outcomes(session.result, passed=1, hang=1)
    assert_hang(session, "test_runs_an_inner_session_then_hangs", "*time.sleep(60)*")
    assert "left running by tests" not in session.result.stdout.str()
    session.assert_clean()


# --- Ctrl-C -----------------------------------------------------------------------------------

INTERRUPTED = """
import time


def double(x):
    return 2 * x


def test_waits_for_ctrl_c(torch_hang, tmp_path_factory):
    assert torch_hang.run(double, 21) == 42  # the zygote is up
    (tmp_path_factory.getbasetemp().parent / "ready").write_text("yes")
    time.sleep(120)
"""


def test_ctrl_c_gives_pytests_own_summary_and_no_helper_tracebacks(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_interrupted=INTERRUPTED)
    ready = pytester.path / "ready"
    # a terminal's Ctrl-C reaches the whole foreground process group
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "--torch-hang-timeout=300",
            f"--basetemp={pytester.path / 'base'}",
        ],
        cwd=pytester.path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 150
        while not ready.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert ready.exists(), "the test never got going"
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = out.decode(errors="replace")
    assert "KeyboardInterrupt" in text, text
    for helper in ("pytest_torchhang/monitor/", "pytest_torchhang/runner/zygote.py"):
        assert helper not in text, text


# --- paths ------------------------------------------------------------------------------------

DOUBLE = """
def double(x):
    return 2 * x


def test_run(torch_hang):
    assert torch_hang.run(double, 21) == 42
"""


def test_a_tmpdir_with_a_space_works(guarded: GuardedRunner, tmp_path: Path) -> None:
    spaced = tmp_path / "with a space"
    spaced.mkdir()
    guarded.monkeypatch.setenv("TMPDIR", str(spaced))
    guarded.pytester.makepyfile(test_double=DOUBLE)
    session = guarded.run(timeout=120)
    assert_outcomes(session.result, passed=1)


CHDIR = """
import os
import time


def test_moves_then_hangs(tmp_path):
    os.chdir(tmp_path)
    time.sleep(60)
"""


def test_a_relative_report_dir_stays_where_pytest_was_invoked(guarded: GuardedRunner) -> None:
    guarded.pytester.makepyfile(test_chdir=CHDIR)
    session = guarded.run("--torch-hang-report-dir=hang-reports", timeout=1)
    assert_outcomes(session.result, hang=1)
    reports = list((guarded.pytester.path / "hang-reports").glob("*.json"))
    assert len(reports) == 1, session.text[-2000:]
    assert json.loads(reports[0].read_text())["test_id"].endswith("test_moves_then_hangs")


HOOK_HELPERS = """
import os

from pytest_torchhang.inject import hook


def open_dump_files():
    dump_dir = os.environ[hook.DUMP_DIR_ENV]
    paths = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(dump_dir) and target.endswith(".stack"):
            paths.append(target)
    return paths
"""

HOOK_ONCE = """
from hook_helpers import open_dump_files


def test_one_hook(torch_hang):
    files = torch_hang.run(open_dump_files)
    assert len(files) == 1, files
"""


def test_a_runner_child_answers_through_one_hook_and_one_dump_file(
    guarded: GuardedRunner,
) -> None:
    guarded.pytester.makepyfile(hook_helpers=HOOK_HELPERS, test_hook_once=HOOK_ONCE)
    session = guarded.run(timeout=120)
    assert_outcomes(session.result, passed=1)

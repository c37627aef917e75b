"""The whole tree dies: setsid'd orphans, SIGTERM-ignoring, stopped, isolated and non-Python children."""

from __future__ import annotations

import re

from conftest import GuardedRunner, assert_hang
from outcomes import assert_outcomes

CHILDREN = """
import os
import subprocess
import sys
import time


def test_setsid_orphan():
    # the child double-forks: the grandchild calls setsid() and is orphaned when its parent exits
    code = "import os, time\\nif os.fork() == 0:\\n    os.setsid()\\n    time.sleep(1000)\\n"
    subprocess.run([sys.executable, "-c", code], check=True)
    time.sleep(1000)


def test_sigterm_ignoring_child():
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(1000)"
    subprocess.Popen([sys.executable, "-c", code]).wait()


def test_stopped_child():
    code = "import os, signal, time\\nos.kill(os.getpid(), signal.SIGSTOP)\\ntime.sleep(1000)\\n"
    subprocess.Popen([sys.executable, "-c", code]).wait()


def test_isolated_python_child():
    subprocess.Popen([sys.executable, "-I", "-c", "import time; time.sleep(1000)"]).wait()


def test_non_python_child():
    subprocess.Popen(["sleep", "1000"]).wait()


def test_next_test_runs():
    pass
"""


def test_every_kind_of_child_is_reported_and_killed(guarded: GuardedRunner) -> None:
    guarded.pytester.makepyfile(test_children=CHILDREN)
    session = guarded.run(timeout=3)  # every child has started (and stopped itself) by then
    assert_outcomes(session.result, hang=5, passed=1)
    orphan = assert_hang(
        session, "test_setsid_orphan", "*time.sleep(1000)", "cleanup: killed 1 process*"
    )
    # the orphan was adopted by pytest (child subreaper), so it is reported as pytest's child
    assert re.search(r"--- process \d+ \[Python child\] parent \d+", orphan)
    assert_hang(
        session, "test_sigterm_ignoring_child", "*signal.SIG_IGN*", "cleanup: killed 1 process*"
    )
    assert_hang(
        session,
        "test_stopped_child",
        "*stopped (SIGSTOP)*",
        '*File "<string>", line 2, in <module>',
        "cleanup: killed 1 process*",
    )
    assert_hang(
        session,
        "test_isolated_python_child",
        "*python -I -c*",
        "*(no stack: no dump handler (not a Python process, or started with python -I*",
        "cleanup: killed 1 process*",
    )
    assert_hang(
        session,
        "test_non_python_child",
        "*cmdline: sleep 1000",
        "*(no stack: no dump handler*",
        "cleanup: killed 1 process*",
    )
    session.assert_clean()


MAIN_THREAD = """
import threading


def test_main_thread_waits_on_a_lock_forever():
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()


def test_catches_everything():
    import time
    while True:
        try:
            time.sleep(1000)
        except Exception:
            pass


def test_next_test_runs():
    pass
"""


def test_a_blocked_main_thread_is_interrupted_and_the_session_goes_on(
    guarded: GuardedRunner,
) -> None:
    guarded.pytester.makepyfile(test_main=MAIN_THREAD)
    session = guarded.run(timeout=1)
    assert_outcomes(session.result, hang=2, passed=1)
    assert_hang(
        session,
        "test_main_thread_waits_on_a_lock_forever",
        "*lock.acquire()",
        "HANG after 1.*1 process*",
    )
    # HangError is not an Exception: a broad except in the code under test cannot swallow it
    assert_hang(session, "test_catches_everything", "*time.sleep(1000)")
    session.assert_clean()


GIL_HELD = """
import ctypes
import subprocess
import sys


def test_gil_held_in_c():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"])
    libc = ctypes.PyDLL(None)  # a PyDLL call keeps the GIL for its whole duration
    mutex = ctypes.create_string_buffer(64)
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)  # self-deadlock in C that no signal interrupts


def test_never_reached():
    pass
"""


def test_a_main_thread_holding_the_gil_in_c_still_ends_the_session(guarded: GuardedRunner) -> None:
    guarded.pytester.makepyfile(test_gil=GIL_HELD)
    session = guarded.run(timeout=2)
    text = session.text
    # the watchdog thread cannot run; the monitor process reports and kills, pytest included
    assert session.result.ret == -9
    assert session.wall_s < 2 + 60, session.wall_s  # wide: pytest's own start on a busy machine
    assert "pytest-torchhang: session stopped" in text
    flat = " ".join(text.split())
    # said because it is shown: the watchdog thread asks for the GIL every 5 ms and never runs
    assert "a thread of pytest holds the GIL in C code" in flat, flat[-6000:]
    assert "waits for the GIL (it woke" in flat and "never ran" in flat, flat[-6000:]
    assert "libc.pthread_mutex_lock(mutex)  # self-deadlock" in text
    assert "[Python child]" in text
    session.assert_clean()


LEAKY = """
import multiprocessing as mp
import subprocess
import sys
import time


def sleep_forever():
    time.sleep(1000)


def test_passes_but_leaves_a_non_daemon_child():
    mp.get_context("fork").Process(target=sleep_forever).start()  # joined at interpreter exit


def test_passes_but_leaves_a_subprocess():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"])
"""


def test_what_passing_tests_leave_running_is_killed_at_session_end(guarded: GuardedRunner) -> None:
    guarded.pytester.makepyfile(test_leaky=LEAKY)
    session = guarded.run(timeout=30)
    assert_outcomes(session.result, passed=2)
    assert session.wall_s < 60, session.wall_s  # multiprocessing's exit join did not hang
    session.result.stdout.fnmatch_lines(
        [
            "*torch-hang: processes left running by tests*",
            "killed 2 process(es) at session end*",
        ]
    )
    session.assert_clean()


REPLACED_ENV = """
import subprocess
import sys


def test_child_with_a_replaced_environment():
    # env={...} drops the variables that carry the dump hook into the child
    code = "import threading\\ndef stuck_here():\\n    threading.Event().wait()\\nstuck_here()\\n"
    subprocess.Popen([sys.executable, "-c", code], env={"MY_SETTING": "1"}).wait()
"""


def test_a_python_child_without_the_hook_is_read_from_outside_when_pystack_is_there(
    guarded: GuardedRunner,
) -> None:
    guarded.pytester.makepyfile(test_env=REPLACED_ENV)
    session = guarded.run(timeout=2)
    assert_hang(
        session,
        "test_child_with_a_replaced_environment",
        "*no dump handler*; its Python stack below was read from outside (pystack/py-spy)*",
        "*stacks read with pystack/py-spy (most recent call last):",
        "*in stuck_here*",
        "cleanup: killed 1 process*",
    )
    session.assert_clean()

"""The user's world: a session paused with Ctrl-Z, and a test's thread blocked in C without the GIL.

A pytest stopped by job control is paused, not hung: the monitor (in a session of its own, so
not stopped with pytest) holds, and the deadlines move on by the stop; a passing test passes
after ``fg``, and the next real hang is still caught. A test's main thread waiting in a C call
that releases the GIL and that no signal interrupts cannot take its interrupt: the session ends
with that said (the call, and what to do), never that a thread holds the GIL, which it does not.
No torch: these sessions start in a second.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from conftest import GuardedRunner, assert_hang
from outcomes import assert_outcomes

TIMEOUT_S = 4.0
#: The passing test's own time, under TIMEOUT_S ...
WORK_S = 2.5
#: ... and the stops: past the deadline only (the watchdog's side), and past the monitor's
#: grace after it too (3 s: the monitor's side).
PAST_THE_DEADLINE_S = 5.0
PAST_THE_GRACE_S = 8.0

PAUSED = f"""
import os
import threading
import time


def test_passes_though_stopped_for_longer_than_its_timeout():
    # a shell runs each job in a process group of its own; the suite's sessions share their
    # runner's, which the kernel may see as orphaned, and then drops a SIGTSTP
    os.setpgid(0, 0)
    with open(os.environ["PAUSE_PID_FILE"], "w") as f:
        f.write(str(os.getpid()))
    for _ in range({int(WORK_S * 10)}):  # the outer test stops this process meanwhile, for longer
        time.sleep(0.1)  # 2.5 s of its own time, whatever the stop (one sleep would end at fg)


def test_hangs_after_it():
    threading.Event().wait()
"""


def _state(pids: list[int]) -> str:
    states = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                states.append(f.read().rpartition(b")")[2].split()[0].decode())
        except FileNotFoundError:  # the session ended before the stop: said by the skip below
            states.append("gone")
    return " ".join(states)


def _stop_then_continue(
    pid_file: Path, seen: list[str], sig: signal.Signals, stop_s: float
) -> None:
    """What Ctrl-Z (or SIGSTOP) and ``fg`` do to the inner pytest (and the processes the test
    names beside it), once its first test runs."""
    deadline = time.monotonic() + 120
    while not pid_file.exists() or not pid_file.read_text():
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)
    pids = [int(pid) for pid in pid_file.read_text().split()]
    time.sleep(0.5)
    for pid in pids:
        os.kill(pid, sig)
    time.sleep(0.3)
    seen.append(_state(pids))  # stopped for real (a SIGTSTP is dropped in an orphaned group)
    time.sleep(stop_s - 0.3)
    seen.append(_state(pids))
    for pid in pids:
        os.kill(pid, signal.SIGCONT)


@pytest.mark.parametrize(
    ("option", "sig", "stop_s"),
    [
        ("--torch-hang-timeout", signal.SIGSTOP, PAST_THE_GRACE_S),
        ("--torch-hang-timeout", signal.SIGTSTP, PAST_THE_DEADLINE_S),
        ("--timeout", signal.SIGTSTP, PAST_THE_GRACE_S),
        ("--timeout", signal.SIGSTOP, PAST_THE_DEADLINE_S),
    ],
    ids=lambda value: getattr(value, "name", str(value)),
)
def test_a_stopped_session_is_paused_not_hung(
    guarded: GuardedRunner, tmp_path: Path, option: str, sig: signal.Signals, stop_s: float
) -> None:
    pid_file = tmp_path / "pid"
    guarded.monkeypatch.setenv("PAUSE_PID_FILE", str(pid_file))
    guarded.pytester.makepyfile(test_paused=PAUSED)
    seen: list[str] = []
    stopper = threading.Thread(target=_stop_then_continue, args=(pid_file, seen, sig, stop_s))
    stopper.start()
    try:
        session = guarded.run(
            f"{option}={TIMEOUT_S:g}", "-v", "-p", "no:randomly", timeout=None, wait_s=180
        )
    finally:
        stopper.join(timeout=60)
    if seen[:1] != ["T"]:
        pytest.skip(f"the inner pytest was not stopped by {sig.name} (states seen: {seen})")
    assert seen == ["T", "T"], seen
    text = session.text
    assert "session stopped" not in text and "the GIL" not in text, text[-6000:]
    assert_outcomes(session.result, passed=1, hang=1)
    assert "test_passes_though_stopped_for_longer_than_its_timeout PASSED" in text
    # the guard still works after the stop: the next test's hang is caught at its own deadline
    assert_hang(session, "test_hangs_after_it", "HANG after *", "*threading.Event().wait()*")
    session.assert_clean()


CALL_PAUSED = f"""
import os
import time


def work(pytest_pid):
    with open(os.environ["PAUSE_PID_FILE"], "w") as f:
        f.write(f"{{pytest_pid}} {{os.getpid()}}")  # pytest's, and this child's
    for _ in range({int(WORK_S * 10)}):
        time.sleep(0.1)


def test_a_fixture_call_passes_though_stopped_with_its_child(torch_hang):
    assert torch_hang.run(work, os.getpid(), timeout={TIMEOUT_S}) is None
"""


def test_a_fixture_calls_own_deadline_stands_still_while_pytest_is_stopped(
    guarded: GuardedRunner, tmp_path: Path
) -> None:
    """Ctrl-Z stops pytest and the call's child (the foreground group): after ``fg`` the call's
    wait, past its deadline by the stop only, goes on waiting for the child, which ends."""
    pid_file = tmp_path / "pid"
    guarded.monkeypatch.setenv("PAUSE_PID_FILE", str(pid_file))
    guarded.monkeypatch.setenv("PYTEST_TORCH_HANG_ZYGOTE_PRELOAD", "")  # no torch: a fast start
    guarded.pytester.makepyfile(test_call=CALL_PAUSED)
    seen: list[str] = []
    args = (pid_file, seen, signal.SIGSTOP, PAST_THE_DEADLINE_S)
    stopper = threading.Thread(target=_stop_then_continue, args=args)
    stopper.start()
    try:
        session = guarded.run("-p", "no:randomly", timeout=30, wait_s=180)
    finally:
        stopper.join(timeout=60)
    assert seen == ["T T", "T T"], seen
    text = session.text
    assert "session stopped" not in text and "the GIL" not in text, text[-6000:]
    assert_outcomes(session.result, passed=1)
    session.assert_clean()


BLOCKED_IN_C = """
import ctypes
import threading
import time


def test_waits_in_c_without_the_gil():
    beats = []

    def beat():  # another Python thread of pytest runs the whole time
        while True:
            beats.append(time.monotonic())
            time.sleep(0.05)

    threading.Thread(target=beat, daemon=True).start()
    libc = ctypes.CDLL(None)  # a CDLL call releases the GIL while it runs
    mutex = ctypes.create_string_buffer(64)
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)  # waits for ever in C; no signal interrupts it


def test_never_reached():
    pass
"""


def test_a_main_thread_blocked_in_c_without_the_gil_is_said_so_and_never_called_gil_held(
    guarded: GuardedRunner,
) -> None:
    guarded.pytester.makepyfile(test_c=BLOCKED_IN_C)
    session = guarded.run(timeout=2, wait_s=180)
    text = session.text
    # the watchdog fired and interrupted in vain: the monitor ends the session, 20 s later
    assert session.result.ret == -9, text[-6000:]
    assert "pytest-torchhang: session stopped" in text, text[-6000:]
    assert "GIL is held" not in text and "holds the GIL" not in text, text[-6000:]
    assert "holding the GIL" not in text, text[-6000:]
    flat = " ".join(text.split())
    assert "its main thread is blocked in a call that no signal interrupts" in flat, flat[-6000:]
    assert "The GIL is free (pytest's watchdog thread ran" in flat, flat[-6000:]
    assert "test_c.py:" in flat and "in test_waits_in_c_without_the_gil" in flat, flat[-6000:]
    assert "@pytest.mark.torch_hang(isolate=True)" in flat, flat[-6000:]
    assert "libc.pthread_mutex_lock(mutex)  # waits for ever in C" in text
    session.assert_clean()

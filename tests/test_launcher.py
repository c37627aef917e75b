"""The plugin starts its helpers (monitor, zygote) from a thread while the test forks: a fork
must not copy the pipe through which a start learns that its child exec'd."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from pytest_torchhang import processwide


def test_a_helper_starts_while_another_thread_forks_children_that_sleep() -> None:
    # Seen in a full suite: the monitor's start, on the launcher thread, waited for a test's
    # sleeping multiprocessing child (a fork that copied Popen's exec pipe), and the watchdog
    # waited for the monitor: the session ended as a hang of the plugin's own.
    children: list[int] = []
    stop = threading.Event()

    def forks() -> None:
        while not stop.is_set():
            pid = os.fork()
            if pid == 0:
                time.sleep(30)  # a child that sleeps, as a hung test's does
                os._exit(0)
            children.append(pid)
            time.sleep(0.002)

    forker = threading.Thread(target=forks, daemon=True)
    forker.start()
    try:
        time.sleep(0.05)
        started = time.monotonic()
        for _ in range(5):
            proc = processwide.launch(
                lambda: subprocess.Popen([sys.executable, "-S", "-c", "pass"]), wait_s=20.0
            )
            proc.wait(timeout=20)
        assert time.monotonic() - started < 15, "a start waited for a forked child"
    finally:
        stop.set()
        forker.join(10)
        for pid in children:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)

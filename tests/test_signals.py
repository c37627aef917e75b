"""Every signal the plugin sends to the tree goes through one identity-checked helper: through a
pidfd where the kernel has them (no window for a recycled pid), through kill(2) elsewhere."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import psutil
import pytest

from pytest_torchhang.capture import tree
from pytest_torchhang.capture.tree import ProcessId

HAS_PIDFD = hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal")


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait(timeout=30)


def _ident(proc: subprocess.Popen[bytes], later_s: float = 0.0) -> ProcessId:
    return ProcessId(proc.pid, psutil.Process(proc.pid).create_time() + later_s)


@pytest.mark.skipif(not HAS_PIDFD, reason="no pidfd here (Linux 5.3+, Python 3.9+)")
def test_a_signal_goes_through_a_pidfd_where_the_kernel_has_one(
    sleeper: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[int] = []
    real_send = signal.pidfd_send_signal

    def send(fd: int, sig: int, *args: object) -> None:
        sent.append(sig)
        real_send(fd, sig)

    monkeypatch.setattr(signal, "pidfd_send_signal", send)
    monkeypatch.setattr(os, "kill", lambda *a: pytest.fail("signalled by pid"))
    assert not tree.signal_process(_ident(sleeper, later_s=1.0), signal.SIGKILL)  # not this one
    assert tree.signal_process(_ident(sleeper), signal.SIGKILL)
    assert sent == [signal.SIGKILL]
    assert sleeper.wait(timeout=30) == -signal.SIGKILL


def test_without_pidfds_the_signal_is_still_identity_checked(
    sleeper: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_pidfd(pid: int, flags: int = 0) -> int:
        raise OSError(errno.ENOSYS, "pidfd_open is not implemented")

    monkeypatch.setattr(os, "pidfd_open", no_pidfd, raising=False)
    assert not tree.signal_process(_ident(sleeper, later_s=1.0), signal.SIGKILL)
    assert sleeper.poll() is None
    assert tree.signal_process(_ident(sleeper), signal.SIGKILL)
    assert sleeper.wait(timeout=30) == -signal.SIGKILL


def test_a_process_that_is_gone_is_not_signalled(sleeper: subprocess.Popen[bytes]) -> None:
    ident = _ident(sleeper)
    sleeper.kill()
    sleeper.wait(timeout=30)
    assert not tree.signal_process(ident, signal.SIGKILL)

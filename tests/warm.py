"""Warm starts for the suite's inner sessions: the client of tests/warm_server.py.

An inner session that imports torch pays 3 s idle, 2-3 times that under load, before its test
runs. Started warm, it pays one fork. A session starts warm only where that is faithful: the same
interpreter, no interpreter start-up setting that differs from the server's (``PYTHON*``
variables), no ``sitecustomize`` brought in through ``PYTHONPATH``, and a test that does not look
at start-up itself (it passes ``warm=False``, or is marked ``cold_start``).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

SERVER = Path(__file__).with_name("warm_server.py")
#: what the server imports before its first fork
PRELOAD = ("torch", "torchvision")
#: start-up settings the server was started with; PYTHONPATH is applied per session
_STARTUP_EXEMPT = {"PYTHONPATH"}
READY_S = 300.0


def _startup_settings(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith("PYTHON") and k not in _STARTUP_EXEMPT}


def _brings_site_hooks(pythonpath: str) -> bool:
    for entry in filter(None, pythonpath.split(os.pathsep)):
        for name in ("sitecustomize.py", "usercustomize.py"):
            if os.path.exists(os.path.join(entry, name)):
                return True
    return False


class WarmServer:
    """One server per process (each pytest-xdist worker), started at its first use."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        # the environment the outer session started with, before any test changed it
        self._env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self._startup = _startup_settings(self._env)
        self._buffer = b""
        self._lock = threading.Lock()

    def accepts(self, python: str, env: dict[str, str]) -> bool:
        """Whether a session of ``python`` with ``env`` may start warm."""
        if os.environ.get("TORCHHANG_TESTS_COLD"):
            return False
        if python != sys.executable or _brings_site_hooks(env.get("PYTHONPATH", "")):
            return False
        return _startup_settings(env) == self._startup

    def _start(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._buffer = b""
        self._proc = subprocess.Popen(
            [sys.executable, str(SERVER), *PRELOAD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=self._env,
            cwd="/",
            preexec_fn=_die_with_parent,
        )
        line = self._line(READY_S)
        if not line.startswith("READY threads=1 "):
            self.close()
            raise RuntimeError(f"the warm server is not single-threaded or did not start: {line!r}")
        return self._proc

    def _line(self, timeout_s: float) -> str:
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([fd], [], [], timeout_s)
            if not ready:
                raise TimeoutError(f"no answer from the warm server in {timeout_s}s")
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError("the warm server exited")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()

    def run(
        self,
        pytester: pytest.Pytester,
        args: list[str],
        *,
        stdin: bytes | None,
        shm: Path | None,
        timeout: float,
    ) -> pytest.RunResult:
        """``python -m pytest ARGS`` in pytester's directory, as ``pytester.run`` runs it."""
        import json

        from _pytest import timing

        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH", "")]))
        out, err = pytester.path / "stdout", pytester.path / "stderr"
        stdin_path = pytester.path / "stdin"
        stdin_path.write_bytes(stdin or b"")
        request = {
            "args": args,
            "cwd": os.getcwd(),
            "env": env,
            "stdin": str(stdin_path),
            "stdout": str(out),
            "stderr": str(err),
            "shm": None if shm is None else str(shm),
        }
        with self._lock:
            proc = self._start()
            assert proc.stdin is not None
            instant = timing.Instant()
            proc.stdin.write(json.dumps(request).encode() + b"\n")
            proc.stdin.flush()
            pid = int(self._line(30).split()[1])
            try:
                status = int(self._line(timeout).split()[1])
            except TimeoutError:
                # the server has not reaped it yet, so the pid is still this session's
                os.kill(pid, signal.SIGKILL)
                self._line(30)
                raise pytester.TimeoutExpired(
                    f"{timeout} second timeout expired running (warm): {args}"
                ) from None
            duration = instant.elapsed().seconds
        lines_out = out.read_text(encoding="utf8", errors="replace").splitlines()
        lines_err = err.read_text(encoding="utf8", errors="replace").splitlines()
        for line in lines_out:
            print(line)
        for line in lines_err:
            print(line, file=sys.stderr)
        ret: int | pytest.ExitCode = status
        with contextlib.suppress(ValueError):
            ret = pytest.ExitCode(status)
        return pytest.RunResult(ret, lines_out, lines_err, duration)

    def close(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(OSError):
                self._proc.kill()
            self._proc.wait()
            self._proc = None


def _die_with_parent() -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL


SERVER_OF_THIS_PROCESS = WarmServer()

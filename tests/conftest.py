"""Shared scenario builders: run a real pytest session with the plugin and check what it left."""

from __future__ import annotations

import contextlib
import re
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import psutil
import pytest

from pytest_torchhang.proctree import shm_entries

pytest_plugins = ["pytester"]

TAG_ENV = "TORCHHANG_TEST_TAG"
_SHM_PREFIXES = ("sem.mp-", "torch_", "psm_")


def tagged_processes(tag: str) -> list[psutil.Process]:
    """Live processes whose environment carries ``tag`` (everything a session started)."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get(TAG_ENV) == tag:
                found.append(proc)
    return found


@dataclass
class Session:
    """A finished inner pytest session and what it left behind."""

    result: pytest.RunResult
    wall_s: float
    leftovers: list[str]
    new_shm: list[str]

    @property
    def text(self) -> str:
        return self.result.stdout.str() + "\n" + self.result.stderr.str()

    def assert_clean(self) -> None:
        assert not self.leftovers, f"processes left running: {self.leftovers}"
        assert not self.new_shm, f"/dev/shm segments left: {self.new_shm}"

    def report_of(self, test_name: str) -> str:
        """The failure text of one test in the FAILURES section."""
        out = self.result.stdout.str()
        match = re.search(rf"_ (ERROR at \w+ of )?{re.escape(test_name)} _", out)
        assert match, f"no failure section for {test_name}"
        start = match.start()
        end = out.find("\n____", start + 1)
        summary = out.find("====", start + 1)
        end = min(x for x in (end, summary, len(out)) if x != -1)
        return out[start:end]


class GuardedRunner:
    """Writes test files into a pytester dir and runs them in a subprocess pytest session."""

    def __init__(self, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
        self.pytester = pytester
        self.monkeypatch = monkeypatch

    def run(
        self,
        *args: str,
        timeout: float | None = 2,
        wait_s: float = 180,
        grace_s: float = 10,
        stdin: bytes | None = None,
    ) -> Session:
        tag = uuid.uuid4().hex
        self.monkeypatch.setenv(TAG_ENV, tag)
        shm_before = shm_entries()
        extra = [f"--torch-hang-timeout={timeout}"] if timeout is not None else []
        start = time.monotonic()
        if stdin is None:
            result = self.pytester.runpytest_subprocess(
                "-p", "no:cacheprovider", *extra, *args, timeout=wait_s
            )
        else:  # runpytest_subprocess cannot feed stdin (a debugger session needs it)
            basetemp = self.pytester.path / "basetemp-stdin"
            result = self.pytester.run(
                sys.executable,
                "-mpytest",
                f"--basetemp={basetemp}",
                "-p",
                "no:cacheprovider",
                *extra,
                *args,
                timeout=wait_s,
                stdin=stdin,
            )
        wall = time.monotonic() - start
        # Session helpers (resource_tracker, forkserver) exit by themselves once pytest is gone:
        # give them a moment, then anything of this session still alive is a leak.
        deadline = time.monotonic() + grace_s
        while (left := tagged_processes(tag)) and time.monotonic() < deadline:
            time.sleep(0.1)
        while time.monotonic() < deadline:
            new_shm = sorted(n for n in shm_entries() - shm_before if n.startswith(_SHM_PREFIXES))
            if not new_shm:
                break
            time.sleep(0.1)
        new_shm = sorted(n for n in shm_entries() - shm_before if n.startswith(_SHM_PREFIXES))
        leftovers = [f"{p.pid} {' '.join(p.cmdline())}" for p in left if p.is_running()]
        for proc in left:  # never let one test's leak poison the next
            with contextlib.suppress(psutil.Error):
                proc.kill()
        return Session(result, wall, leftovers, new_shm)


@pytest.fixture
def guarded(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Iterator[GuardedRunner]:
    """Run inner pytest sessions with pytest-torchhang and collect what they left behind."""
    monkeypatch.delenv("PYTEST_TORCH_HANG_TIMEOUT", raising=False)
    yield GuardedRunner(pytester, monkeypatch)


def assert_hang(session: Session, test_name: str, *expected: str) -> str:
    """The test failed as a hang and its report holds ``expected`` lines (fnmatch patterns)."""
    report = session.report_of(test_name)
    lines = report.splitlines()
    first = lines[2] if lines[1].startswith("[gw") else lines[1]  # xdist names the worker first
    assert first.startswith("HANG after "), report[:2000]
    missing = [pattern for pattern in expected if not _matches(report, pattern)]
    assert not missing, f"missing {missing} in:\n{report[:6000]}"
    return report


def _matches(text: str, pattern: str) -> bool:
    import fnmatch

    return any(fnmatch.fnmatch(line, pattern) for line in text.splitlines())

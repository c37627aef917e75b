"""Native (C/C++) stacks through pystack or py-spy, for ``--torch-hang-native``: optional, bounded."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from .. import clock

#: Whole budget for native stacks of one hang, and the most one process may take.
BUDGET_S = 6.0
PER_PROCESS_S = 3.0
#: At most this many processes get native stacks (the busiest reports stay readable).
MAX_PROCESSES = 8
MAX_CHARS = 12_000


@dataclass
class NativeResult:
    """Native stacks by pid, and a one-line note when they could not be had."""

    stacks: dict[int, str]
    note: str = ""


def _command(tool: str, pid: int, all_threads: bool, native: bool) -> list[str]:
    if tool.endswith("pystack"):
        flag = ["--native-all" if all_threads else "--native"] if native else []
        return [tool, "remote", *flag, str(pid)]
    return [tool, "dump", *(["--native"] if native else []), "--pid", str(pid)]


def _tool() -> str | None:
    """pystack or py-spy: the one installed beside this Python first, then one on PATH.

    Beside this Python it is the real program; on PATH it may be a shim (pyenv's runs a shell and
    ``pyenv exec`` first: half a second, and seconds on a loaded machine, out of a tight budget).
    """
    here = os.path.dirname(sys.executable)
    for name in ("pystack", "py-spy"):
        found = shutil.which(name, path=here)
        if found:
            return found
    return shutil.which("pystack") or shutil.which("py-spy")


def _run_bounded(command: list[str], timeout_s: float) -> tuple[int, str, str] | None:
    """(exit code, stdout, stderr) of ``command``, or None when it did not end in ``timeout_s``
    (it is killed). Polled on the plugin's clock: ``subprocess.run(timeout=...)`` counts on one
    that a test may have frozen (freezegun replaces subprocess's monotonic), and never times out
    then. Output goes to files: a pipe that fills would stop the tool."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
        deadline = clock.monotonic() + timeout_s
        while proc.poll() is None:
            if clock.monotonic() >= deadline:
                proc.kill()
                reaped_by = clock.monotonic() + 1.0  # SIGKILLed: reaped at once, unless in D
                while proc.poll() is None and clock.monotonic() < reaped_by:
                    clock.sleep(0.01)
                return None
            clock.sleep(0.01)
        out.seek(0)
        err.seek(0)
        read = out.read().decode("utf-8", "replace"), err.read().decode("utf-8", "replace")
        return proc.returncode, *read


def tool_available() -> bool:
    return _tool() is not None


def native_stacks(pids: list[int], all_threads: set[int], native: bool = True) -> NativeResult:
    """Native stacks of ``pids`` (threads without Python frames too for ``all_threads``).

    With ``native=False``, only the Python stacks, read from outside: the fallback for Python
    processes that have no dump handler (started with a replaced environment, ``python -I``...).
    """
    tool = _tool()
    if tool is None:
        return NativeResult(
            {},
            "--torch-hang-native: neither pystack nor py-spy is installed "
            "(pip install 'pytest-torchhang[native]'); Python stacks only",
        )
    stacks: dict[int, str] = {}
    failures: list[str] = []
    deadline = clock.monotonic() + BUDGET_S
    for pid in pids[:MAX_PROCESSES]:
        left = deadline - clock.monotonic()
        if left <= 0.2:
            failures.append(f"{pid}: out of time")
            continue
        done = _run_bounded(
            _command(tool, pid, pid in all_threads, native), min(PER_PROCESS_S, left)
        )
        if done is None:
            failures.append(f"{pid}: no answer in {min(PER_PROCESS_S, left):.1f}s")
            continue
        code, text, errors = done
        text = text.strip()
        if code != 0 or not text:
            reason = (errors.strip().splitlines() or ["failed"])[-1]
            failures.append(f"{pid}: {reason[:160]}")
            continue
        stacks[pid] = text if len(text) <= MAX_CHARS else text[-MAX_CHARS:]
    note = ""
    if failures:
        hint = (
            " (ptrace may be forbidden here: see /proc/sys/kernel/yama/ptrace_scope)"
            if not stacks
            else ""
        )
        note = (
            f"--torch-hang-native ({tool.rsplit('/', 1)[-1]}): no native stack for "
            + "; ".join(failures)
            + hint
        )
    return NativeResult(stacks, note)

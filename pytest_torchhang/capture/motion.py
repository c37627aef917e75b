"""Two looks at each process about half a second apart, and what moved between them.

The first capture says where each process is; it cannot say whether it is still there a moment
later. A second, cheap look (the kernel's counters of every thread, then one more stack dump)
tells a process that is blocked for good from one that spins, one that polls (a sleep or a wait
with a short timeout, in a loop: it wakes, looks and sleeps again) and one that is slow but
moving. ``look`` reads; ``classify`` is a pure function of two looks.
"""

from __future__ import annotations

import dataclasses
import os
import sysconfig
from dataclasses import dataclass, field

from ..inject.protocol import THREAD_PREFIX
from ..report.model import Frame, Motion, ThreadStack
from . import procfs

__all__ = ["INTERVAL_S", "Look", "ThreadLook", "classify", "look", "moved"]

#: How far apart the two looks are: a polling loop with a timeout up to about this wakes at
#: least once in between.
INTERVAL_S = 0.5
#: CPU between the looks at or above which a thread that did not sleep spins (two clock ticks:
#: on a loaded machine a spinner may get little CPU, but it gets some).
SPIN_CPU_S = 0.02
#: Wake-ups between the looks at or above which a thread that used little CPU polls. A thread
#: blocked for good never wakes: nothing signals it between the two looks.
POLL_WAKES = 2
#: Share of the interval a thread ran at or above which it spins, however often it slept.
SPIN_SHARE = 0.25


@dataclass(frozen=True)
class ThreadLook:
    """One kernel thread's counters at one look."""

    tid: int
    cpu_ticks: int
    voluntary: int  # /proc/PID/task/TID/status voluntary_ctxt_switches
    involuntary: int  # nonvoluntary_ctxt_switches
    state: str  # the /proc state letter


@dataclass(frozen=True)
class Look:
    """One process at one look: its threads' counters (the plugin's own left out), what it had
    written, and its Python stacks by thread ident (most recent call first)."""

    at: float  # clock.monotonic() of the look
    start_ticks: int  # the process's start: a different one is another process with that pid
    threads: dict[int, ThreadLook] = field(default_factory=dict)
    written: int = -1  # /proc/PID/io wchar; -1: unread
    stacks: dict[str, tuple[Frame, ...]] = field(default_factory=dict)


def look(pid: int, at: float, skip_tids: set[int] | None = None) -> Look | None:
    """Read ``pid``'s counters now (no signal: nothing of it moves for being read); None when
    it is gone. ``skip_tids``: the capture's own threads (of this process)."""
    start = procfs.stat(pid)
    if start is None or start.state in ("Z", "X"):
        return None
    threads: dict[int, ThreadLook] = {}
    try:
        tids = [int(name) for name in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return None
    for tid in tids:
        if skip_tids and tid in skip_tids:
            continue
        stat = procfs.stat(pid, tid)
        if stat is None or stat.comm.startswith(THREAD_PREFIX):
            continue  # gone, or the plugin's own (its listener, the watchdog)
        status = procfs.text(f"/proc/{pid}/task/{tid}/status", 8192)
        threads[tid] = ThreadLook(
            tid,
            stat.cpu_ticks,
            _field(status, "voluntary_ctxt_switches"),
            _field(status, "nonvoluntary_ctxt_switches"),
            stat.state,
        )
    io = procfs.text(f"/proc/{pid}/io", 4096)
    written = _field(io, "wchar") if io else -1
    return Look(at, start.start_ticks, threads, written)


def with_stacks(seen: Look, stacks: list[ThreadStack]) -> Look:
    """``seen`` with the Python stacks of a dump taken after it."""
    return Look(
        seen.at,
        seen.start_ticks,
        seen.threads,
        seen.written,
        {t.ident: tuple(t.frames) for t in stacks},
    )


def less_written(seen: Look, plugin_bytes: int) -> Look:
    """``seen`` without the bytes the plugin's own code wrote in the process (its answers)."""
    if plugin_bytes <= 0 or seen.written < 0:
        return seen
    return dataclasses.replace(seen, written=seen.written - plugin_bytes)


def _field(text: str, name: str) -> int:
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            try:
                return int(value.split()[0])
            except (IndexError, ValueError):
                return 0
    return 0


def classify(
    first: Look | None, second: Look | None, python_tids: set[int] | None = None
) -> Motion | None:
    """What moved between two looks at one process (``first`` with the first capture's stacks,
    ``second`` with the second's). None when there was no first look.

    ``python_tids``: its kernel threads known to run Python code (when known): only their
    wake-ups make a process "polling", so that a library's timer thread (a pool's, a
    watchdog's) does not hide a main thread blocked for good.
    """
    if first is None:
        return None
    if second is None or second.start_ticks != first.start_ticks:
        return Motion("gone", 0.0, 0.0, 0, 0, False, -1)
    interval = max(second.at - first.at, 0.0)
    cpu: dict[int, float] = {}
    wakes: dict[int, int] = {}
    preempted = 0
    for tid, now in second.threads.items():
        before = first.threads.get(tid)
        if before is None:
            continue  # started between the looks: a stack change says it, below
        cpu[tid] = max(now.cpu_ticks - before.cpu_ticks, 0) / procfs.TICKS
        wakes[tid] = max(now.voluntary - before.voluntary, 0)
        preempted += max(now.involuntary - before.involuntary, 0)
    written = (
        max(second.written - first.written, 0) if min(first.written, second.written) >= 0 else -1
    )
    changed = moved(first.stacks, second.stacks)
    kind, where, tids = _kind(changed, written, cpu, wakes, python_tids, first, second)
    return Motion(
        kind,
        round(interval, 3),
        round(sum(cpu.values()), 3),
        sum(wakes.values()),
        preempted,
        bool(changed),
        written,
        where,
        tids,
    )


def _kind(
    changed: str,
    written: int,
    cpu: dict[int, float],
    wakes: dict[int, int],
    python_tids: set[int] | None,
    first: Look,
    second: Look,
) -> tuple[str, str, list[int]]:
    """(the kind, what moved or who spins or polls in words, the threads that spin or poll)."""
    if changed:
        return "moving", changed, []
    if written > 0:
        return "moving", "", []
    # A thread that used CPU and hardly slept spins; so does one that ran most of the time,
    # whatever its wake-ups (a spinner that shares the GIL sleeps each switch interval).
    interval = max(second.at - first.at, 1e-3)
    for tid, used in sorted(cpu.items(), key=lambda item: -item[1]):
        running = first.threads[tid].state == "R" and second.threads[tid].state == "R"
        if (used >= SPIN_CPU_S or running) and (
            wakes[tid] < POLL_WAKES or used >= SPIN_SHARE * interval
        ):
            spinners = [
                t for t, u in cpu.items() if u >= SPIN_CPU_S or second.threads[t].state == "R"
            ]
            return "spinning", f"thread {tid} used {used:.2f}s CPU and hardly slept", spinners
    counted = {tid: n for tid, n in wakes.items() if not python_tids or tid in python_tids} or wakes
    tid, most = max(counted.items(), key=lambda item: item[1], default=(0, 0))
    if most >= POLL_WAKES:
        pollers = sorted(t for t, n in counted.items() if n >= POLL_WAKES)
        return "polling", f"thread {tid} slept and woke {most} times", pollers
    return "blocked", "", []


def moved(before: dict[str, tuple[Frame, ...]], after: dict[str, tuple[Frame, ...]]) -> str:
    """How a Python stack changed between two dumps, in words; "" when every thread is where
    it was, or in a loop of the same few frames.

    Only threads in both dumps count (a thread that started or ended does not say where the
    others are). Stacks are compared from the outermost call: a change of line in the same
    function, or a call in or out below it, is the same loop; two different functions of the
    user's code at the same depth are a move. Two dumps cannot tell a long computation in one
    function from a spin: that reads as "the same frames".
    """
    for ident, frames in after.items():
        old = before.get(ident)
        if old is None:
            continue
        a, b = old[::-1], frames[::-1]  # outermost first
        depth = 0
        while depth < min(len(a), len(b)) and a[depth] == b[depth]:
            depth += 1
        if depth == min(len(a), len(b)):
            continue  # the same, or one calls further from the same line
        x, y = a[depth], b[depth]
        if (x.filename, x.name) == (y.filename, y.name):
            continue  # the same function at another line: a loop
        if _library(x) or _library(y):
            continue  # a loop in the user's code that calls into a library at varying points
        return f"{x.name} ({_short(x)}) -> {y.name} ({_short(y)})"
    return ""


_LIBRARY_DIRS = tuple(
    {p for key in ("stdlib", "platstdlib", "purelib", "platlib") if (p := sysconfig.get_path(key))}
)


def _library(frame: Frame) -> bool:
    """The standard library's or an installed package's code, or this plugin's."""
    path = frame.filename
    return (
        path.startswith(_LIBRARY_DIRS)
        or "site-packages" in path
        or path.startswith("<")
        or f"{os.sep}pytest_torchhang{os.sep}" in path
    )


def _short(frame: Frame) -> str:
    return f"{os.path.basename(frame.filename)}:{frame.lineno}"

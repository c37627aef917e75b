"""The plugin's one clock: ``time``'s functions bound at import, out of reach of a test's patches.

A test may replace ``time.monotonic`` (``monkeypatch.setattr``), freeze or tick it (freezegun), or
move wall time (time-machine); the plugin's deadlines and waits must not move with it. pytest's
own ``_pytest/timing.py`` binds its functions at import for the same reason. Every deadline and
wait of the package reads this module, never ``time.monotonic`` through the ``time`` module.

Binding the real functions by name (``from time import monotonic``) is not enough: freezegun walks
every loaded module at ``start()`` and replaces each attribute that *is* the real function. Each
name here is a ``functools.partial`` of the real function, which that walk does not recognise; a
call goes from C to C, with no Python frame. time-machine rewrites the C functions behind wall
time (``time.time``, ``clock_gettime(CLOCK_REALTIME)``) in place, which no binding escapes: wall
time is therefore checked against its last trusted reading carried forward on the boot clock,
which neither tool touches (and which, unlike the monotonic clock, counts a suspend).
"""

from __future__ import annotations

import functools
import os
import time as _time
from collections.abc import Callable

#: Seconds on the monotonic clock: every deadline of the package.
monotonic: Callable[[], float] = functools.partial(_time.monotonic)
monotonic_ns: Callable[[], int] = functools.partial(_time.monotonic_ns)
#: For measured durations (rates, timings in a report).
perf_counter: Callable[[], float] = functools.partial(_time.perf_counter)
sleep: Callable[[float], None] = functools.partial(_time.sleep)

#: Seconds on the boot clock (the monotonic clock plus the time the machine was suspended).
boottime: Callable[[], float] = functools.partial(_time.clock_gettime, _time.CLOCK_BOOTTIME)
#: Clock ticks a second: the unit of a process's start time (``/proc/PID/stat`` field 22).
TICKS_PER_S: int = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def boot_ticks() -> int:
    """Now on the boot clock, in clock ticks: the time base and unit (truncated, as the kernel
    truncates) of a process's start time, so that the two compare."""
    return int(boottime() * TICKS_PER_S)


_realtime: Callable[[], float] = functools.partial(_time.time)  # time-machine reaches this one
#: (wall time, boot clock) read together: the last moment the host's wall clock was trusted.
_anchor = (_time.time(), boottime())
#: A wall clock further than this from the anchor carried forward was moved by a test.
_MOVED_S = 1.0


def wall() -> float:
    """Seconds since the epoch, out of reach of a test that moves wall time.

    The host's wall clock while it agrees (within a second) with the last trusted reading
    carried forward on the boot clock, which then moves on with it (NTP's slow corrections);
    else (time-machine moved it, or a frozen test patched it) that reading carried forward.
    """
    global _anchor
    wall_then, boot_then = _anchor
    now = boottime()
    carried = wall_then + (now - boot_then)
    host = _realtime()
    if abs(host - carried) < _MOVED_S:
        _anchor = (host, now)  # one tuple: whole to every thread
        return host
    return carried


def wall_ns() -> int:
    """:func:`wall` in nanoseconds."""
    return int(wall() * 1e9)

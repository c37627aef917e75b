"""``--torch-hang-hunt-stress``'s schedule: the seeded waits of each thread at its meeting
points (``point``, ``call``), and the process's stress state that ``stress.py``'s patches and
its life share. The stress itself, what it patches and why, is described in ``stress.py``.

Standard library only, like all of ``inject/``: the start-up hook loads it by path before
``stress.py``, which imports it.
"""

from __future__ import annotations

import functools
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar

from .protocol import PLUGIN_THREAD_NAMES

# Bound at import, out of reach of a test's patches of ``time`` (as inject/hook.py does).
_sleep = functools.partial(time.sleep)

#: The longest single wait at a meeting point.
MAX_DELAY_S = 0.03
#: The longest wait after a read of shared state: the other side must arrive in that gap, and a
#: sibling process forked from a parent that imported torch arrives tens of ms after the first.
MAX_READ_DELAY_S = 0.1
#: A process waits at most this long in all; past it, meeting points only yield.
BUDGET_S = 2.0
#: Start-up (and each fork) waits up to this long first: start-up and shutdown races need it.
START_JITTER_S = 0.005
#: How many times a thread's priority drops, at points drawn among its first ``HORIZON`` ones.
CHANGES = 2
HORIZON = 64
#: After these operations a thread waits longer (weight HEAVY, others LIGHT): right after it
#: signals (set, notify, release, put, send, a thread's start), so the thread it woke may run
#: first (a process's start is light: a race between two children needs them close); right
#: after it reads shared state (empty, qsize, is_set, poll, a Value), so the answer may age
#: before it acts on it (check-then-act, the lost update).
HEAVY_AFTER = tuple(
    f"{op}/after"
    for op in (
        ".set",
        ".notify",
        ".notify_all",
        ".release",
        ".put",
        ".send",
        ".send_bytes",
        ".__exit__",
        "Thread.start",
        "Store.set",
        "Store.add",
    )
)
#: Reads of shared state wait longest: the other side must arrive within the gap.
READ_AFTER = tuple(
    f"{op}/after"
    for op in (
        ".empty",
        ".qsize",
        ".is_set",
        ".poll",
        ".get_obj",
        ".__getitem__",
        "Value.get",
        "Store.get",
    )
)
#: The lost wake-up: a thread reads a flag outside the lock that guards it, then takes the lock
#: and waits for the notify that comes with the flag; the other thread set it and notified in
#: between. Stress opens that window from both sides. A thread that takes a condition's lock in
#: code that waits on it (a waiter) waits longest just before, after its own read: the notifier
#: may come and go meanwhile. Any other thread waits longest just after, holding the lock before
#: it changes the state: a waiter that reads meanwhile reads the old value, then queues on the
#: lock. The other sides stay light: a notifier slowed before the lock, or a waiter holding it,
#: would only close the window. (A wait at ``wait()``'s entry would not do: the lock is held
#: there, so no notifier can run in between.)
WAITER_ENTER = "threading.Condition.__enter__ to wait"
HELD_AFTER = ("threading.Condition.__enter__/after",)
READ, HEAVY, LIGHT = 3.0, 2.0, 0.5
_WEIGHTS: dict[str, float] = {}
#: Threads of the plugin itself (watchdog, launcher, listeners, proc readers) are never delayed,
#: and do not count in a process's thread numbering (a seed replays the same one).
OWN_THREADS = PLUGIN_THREAD_NAMES

Callback = Callable[..., Any]


class _State:
    """This process's stress: its seed, its place in the tree, what it patched."""

    active = False
    seed = 0
    identity = "0"
    budget_s = BUDGET_S
    forks = 0  # fork children started so far (the next one is ``identity.<forks+1>``)
    spawns = 0  # Process.start calls so far: a spawned child is ``identity.s<n>``
    threads = 0  # threads started so far (the next one is ``t<threads+1>``)
    local: Any = None  # threading.local: this thread's schedule
    record_fd = -1
    record_dir = ""
    patched: ClassVar[list[tuple[Any, str, Any]]] = []  # (owner, name, original) for uninstall
    fork_hook = False
    switch = 0.0
    #: code object -> whether it waits on a condition (``_waits``), kept across runs: it only reads
    waiters: ClassVar[dict[Any, bool]] = {}


class _Schedule:
    """One thread's decisions: a priority that drops at a few points (PCT), and a stream of
    waits drawn from its own seeded generator."""

    __slots__ = ("changes", "depth", "key", "ops", "priority", "rng")

    def __init__(self, key: str) -> None:
        self.key = key
        self.depth = 0  # inside a stressed operation: its own inner operations are not points
        self.rng = random.Random(f"{_State.seed}/{_State.identity}/{key}")
        self.priority = self.rng.random()
        self.changes = {self.rng.randint(1, HORIZON) for _ in range(CHANGES)}
        self.ops = 0

    def decide(self, weight: float) -> float:
        """Seconds to wait at a point of this ``weight``: 0 yields, -1 goes on at once."""
        self.ops += 1
        if self.ops in self.changes:
            self.priority = self.rng.random() * 0.25  # PCT: below the others, from here on
        draw, length = self.rng.random(), self.rng.expovariate(1.0)  # always two draws
        low = 1.0 - self.priority
        if draw < min(0.95, (0.1 + 0.6 * low) * weight):
            if weight >= READ:  # a read's answer ages as long as a sibling takes to arrive
                return min(MAX_READ_DELAY_S, length * (0.0003 + 0.03 * low) * weight)
            return min(MAX_DELAY_S, length * (0.0003 + 0.012 * low) * weight)
        return 0.0 if draw < 0.9 else -1.0


def _thread_key(thread: threading.Thread) -> str:
    if thread is threading.main_thread():
        return "main"
    index = getattr(thread, "_torch_hang_stress_index", None)
    return f"t{index}" if index is not None else f"n:{thread.name}"


def _schedule() -> _Schedule | None:
    local = _State.local
    schedule: _Schedule | None = getattr(local, "schedule", None)
    if schedule is None:
        # Not threading.current_thread(): for a thread that threading did not start, it makes
        # a _DummyThread, whose __init__ sets an Event, which is a point, which asks again.
        thread = threading._active.get(threading.get_ident())  # type: ignore[attr-defined]
        if thread is None or thread.name.startswith(OWN_THREADS):
            return None  # a foreign thread (started from C), or the plugin's own
        schedule = local.schedule = _Schedule(_thread_key(thread))
    return schedule


def point(site: str) -> None:
    """A meeting point: wait as this thread's schedule says (nothing when stress is off)."""
    if not _State.active:
        return
    try:
        schedule = _schedule()
    except Exception:  # interpreter shutdown, a thread without a Python object
        return
    if schedule is None or schedule.depth:
        return
    weight = _WEIGHTS.get(site)
    if weight is None:
        weight = HEAVY if site.endswith(HEAVY_AFTER) else LIGHT
        weight = READ if site.endswith(READ_AFTER + HELD_AFTER) or site == WAITER_ENTER else weight
        _WEIGHTS[site] = weight
    wait = schedule.decide(weight)
    if wait > 0:
        if _State.budget_s <= 0:
            wait = 0.0
        else:
            _State.budget_s -= wait
    if _State.record_fd >= 0:
        line = f"{schedule.key} {schedule.ops} {site} {round(wait * 1e6)}\n"
        try:  # noqa: SIM105 - no contextlib: cheap to import
            os.write(_State.record_fd, line.encode())
        except OSError:
            pass
    if wait >= 0:
        _sleep(wait)  # 0: let another thread run


def call(site: str, op: Callback, *args: Any, before: bool = True, after: bool = True) -> Any:
    """``op(*args)`` as one operation between two meeting points: what ``op`` does inside (a
    queue's lock, a condition's semaphores) is its own business, not more points."""
    if before:
        point(site)
    schedule = _schedule() if _State.active else None
    if schedule is not None:
        schedule.depth += 1
    try:
        result = op(*args)
    finally:
        if schedule is not None:
            schedule.depth -= 1
    if after:
        point(site + "/after")
    return result

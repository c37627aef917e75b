"""Rules for semaphore slots: a semaphore (or lock) at count 0 whose slots were acquired and
never released, named in the user's words (the kind of object, and the release that is missing)."""

from __future__ import annotations

import linecache
import os
import re

from ...report.model import Frame, Hint, ProcessReport, TaskWait
from ...report.waits import (
    MAPS,
    Semaphore,
)
from ..frames import (
    enclosing_class,
    in_file,
    is_library,
    located,
)
from ..graph import (
    acquire_held,
    blocked_line,
    code,
    doing,
    holds_an_acquire,
    ignored,
    joins,
    task_thread,
    wait_kind,
    who,
)

# --- causes named in the user's words: the kind of object, and the action that is missing ---


def _acquire_line(proc: ProcessReport, task: TaskWait) -> tuple[str, Frame] | None:
    """(the semaphore's expression, the user's frame) of a thread blocked in ``X.acquire()`` or
    ``with X:`` called straight from the user's code (not through a Condition or an Event)."""
    thread = task_thread(proc, task)
    if thread is None or not thread.frames:
        return None
    frames = thread.frames
    top = 0
    # threading.Semaphore.acquire waits in its Condition, and `with` on a multiprocessing
    # SemLock enters through synchronize.py: the user's call is below them
    while top < len(frames) and (
        in_file(frames[top], "threading.py", "wait", "acquire")
        or in_file(frames[top], "multiprocessing/synchronize.py", "__enter__")
    ):
        top += 1
    if top and not any(
        in_file(f, "threading.py", "acquire") or in_file(f, "multiprocessing/synchronize.py")
        for f in frames[:top]
    ):
        return None
    if top >= len(frames) or is_library(frames[top]):
        return None
    match = re.match(r"^\s*(?:with\s+([\w.\[\]]+)\s*:|([\w.\[\]]+)\.acquire\()", frames[top].line)
    if not match:
        return None
    return (match.group(1) or match.group(2)), frames[top]


def _threading_semaphore(proc: ProcessReport, task: TaskWait) -> bool:
    thread = task_thread(proc, task)
    return thread is not None and any(
        in_file(f, "threading.py", "acquire")
        and enclosing_class(f.filename, f.lineno) == "Semaphore"
        for f in thread.frames[:3]
    )


#: The library's helper threads, which run none of the user's code: a Queue's feeder thread
#: (pickles and writes), multiprocessing's resource sharer (serves descriptors it was given).
_HELPER_THREADS = (
    ("multiprocessing/queues.py", "_feed"),
    ("multiprocessing/resource_sharer.py", "_serve"),
)


def _cannot_release(
    proc: ProcessReport, task: TaskWait, waiting: set[tuple[int, int]], among: set[int]
) -> bool:
    """A thread that will not release the semaphore: it waits in acquire itself, or waits for
    a child's or a thread's end, or for what only the processes ``among`` send (a DataLoader
    waiting for its workers' batches, an idle worker waiting for its next index), without
    holding an acquire in its frames. Asked of every thread of ``among`` (the processes that
    map the semaphore): when each of them waits only on the others, none can ever release."""
    if (proc.pid, task.tid) in waiting:
        return True
    thread = task_thread(proc, task)
    frames = thread.frames if thread is not None else []
    if (
        frames
        and all(is_library(f) for f in frames)
        and any(in_file(f, path, name) for f in frames for path, name in _HELPER_THREADS)
    ):
        return True  # a library's helper thread: it releases nothing of the user's
    if proc.busy or wait_kind(proc, task) in ("running", "sleeping", "stopped", "unknown"):
        return False
    joining = joins(proc, task) or (
        thread is not None
        and bool(thread.frames)
        and in_file(thread.frames[min(1, len(thread.frames) - 1)], "threading.py", "join")
    )
    senders = {e.pid for e in task.waits_for} - {proc.pid}
    on_sharers = bool(senders) and senders <= among
    return (joining or on_sharers) and not holds_an_acquire(thread)


def hint_leaked_slots(procs: list[ProcessReport]) -> list[Hint]:
    """A semaphore (or lock) at count 0 that every live process that could release waits on,
    or waits for a child without holding: its slots were acquired and never released."""
    by_pid = {p.pid: p for p in procs}
    hints = []
    # multiprocessing: a SemLock in /dev/shm, waited on from the user's own acquire()
    groups: dict[str, list[tuple[ProcessReport, TaskWait, str, Frame]]] = {}
    for proc in procs:
        for task in proc.tasks:
            if isinstance(task.wait, Semaphore) and not ignored(proc, task):
                found = _acquire_line(proc, task)
                if found:
                    groups.setdefault(task.wait.path, []).append((proc, task, *found))
    for waiters in groups.values():
        sem = waiters[0][1].wait
        assert isinstance(sem, Semaphore)
        if sem.value not in (0, None):
            continue  # a slot is free: the waiters are about to run
        if sem.value is None and any(t.args[2:3] != [0] for _, t, _, _ in waiters):
            continue  # unread, and the waits were not entered on a count of 0 either
        waiting = {(p.pid, t.tid) for p, t, _, _ in waiters}
        sharers = {e.pid for _, t, _, _ in waiters for e in t.waits_for if e.kind == MAPS}
        if any(pid not in by_pid for pid in sharers):
            continue
        others = [by_pid[pid] for pid in sorted(sharers) if pid not in {p for p, _ in waiting}]
        mappers = others + list({p.pid: p for p, *_ in waiters}.values())
        among = {o.pid for o in mappers}
        if not all(
            _cannot_release(o, t, waiting, among)
            for o in mappers
            for t in o.tasks
            if not ignored(o, t)
        ):
            continue  # a thread that runs, sleeps or may hold a slot could still release it
        hints.append(_leaked_hint(procs, waiters, others, sem))
    # threading: every thread of a process waits in Semaphore.acquire, or joins without holding
    for proc in procs:
        tasks = [t for t in proc.tasks if not ignored(proc, t)]
        stuck = [
            (proc, t, *found)
            for t in tasks
            if _threading_semaphore(proc, t) and (found := _acquire_line(proc, t))
        ]
        if not stuck or proc.busy:
            continue
        waiting = {(proc.pid, t.tid) for _, t, _, _ in stuck}
        if all(_cannot_release(proc, t, waiting, {proc.pid}) for t in tasks):
            hints.append(_leaked_hint(procs, stuck, [], None))
    return hints


_SEMAPHORES = ("BoundedSemaphore", "Semaphore", "RLock", "Lock")


def _created_as(name: str, procs: list[ProcessReport]) -> tuple[Frame, str] | None:
    """(the line, the class) where a function still on a stack of the tree made a semaphore or
    lock called ``name`` (``slots = ctx.BoundedSemaphore(2)``, above the line that function
    is at); None unless exactly one line does (a name alone is no proof: two are none)."""
    made = re.compile(
        rf"^\s*(?:self\.)?{re.escape(name)}\s*(?::[^=]+)?=\s*[\w.]*?\b({'|'.join(_SEMAPHORES)})\("
    )
    found: dict[tuple[str, int], tuple[Frame, str]] = {}
    for frame in (f for p in procs for t in p.threads for f in t.frames if not is_library(f)):
        lines = linecache.getlines(frame.filename)[: frame.lineno]
        for number in range(len(lines), 0, -1):
            line = lines[number - 1]
            if match := made.match(line):
                made_at = Frame(frame.filename, number, frame.name, code(line.strip()))
                found[(frame.filename, number)] = (made_at, match.group(1))
            if line.lstrip().startswith(("def ", "async def ")):
                break  # the function's own lines only
    return next(iter(found.values())) if len(found) == 1 else None


def _held_below(waiters: list[tuple[ProcessReport, TaskWait, str, Frame]]) -> str:
    """`` DataLoader worker 0/2 (pid 7) holds a slot itself, lower in its own stack: line 23,
    `self.slots.acquire()` ...``: a waiter whose outer frame took the same semaphore and has not
    released it (a retry or a recursion that acquires again), in words; empty when none."""
    said = []
    for proc, task, name, _ in waiters:
        held = acquire_held(task_thread(proc, task))
        if held is None or name not in held.line:
            continue
        said.append(
            f"{who(proc)} holds a slot itself, lower in its own stack: line {held.lineno}, "
            f"`{code(held.line)}`, in {held.name}, which called this acquire again before "
            "releasing it"
        )
    return (" " + "; ".join(said) + ".") if said else ""


def _leaked_hint(
    procs: list[ProcessReport],
    waiters: list[tuple[ProcessReport, TaskWait, str, Frame]],
    others: list[ProcessReport],
    sem: Semaphore | None,
) -> Hint:
    """The hint of a leaked semaphore: ``sem`` for a multiprocessing one, None for threading."""
    name, frame = waiters[0][2], waiters[0][3]
    pids = sorted({p.pid for p, *_ in waiters})
    where = ", ".join(
        sorted(
            {f"{who(p)}" + (f" thread {t.tid}" if t.tid != p.pid else "") for p, t, _, _ in waiters}
        )
    )
    if sem is not None:
        what = (
            f"`{name}`, a multiprocessing semaphore (a Semaphore, BoundedSemaphore or Lock: the "
            f"SemLock at {sem.path})"
        )
        count = (
            f"its count is {sem.value} (read from the semaphore)"
            if sem.value is not None
            else f"its count could not be read ({sem.unread}), and its waiters went to sleep "
            "on a count of 0 (the value their futex wait expects)"
        )
    else:
        what = f"`{name}`, a threading Semaphore or BoundedSemaphore"
        count = "its count is 0 (Semaphore.acquire waits only while it is)"
    created = _created_as(name.rsplit(".", 1)[-1], [*procs])
    if created is not None:
        what += (
            f", created (by its name) as a {created[1]} at "
            f"{os.path.basename(created[0].filename)}:{created[0].lineno}: `{created[0].line}`"
        )
    holders = "; ".join(
        f"{who(o)} {doing(o)}, and holds no acquire of it in its frames" for o in others
    ) or (
        "no other live process maps it, and every other thread of the waiting processes waits "
        "too, without an acquire of it in its frames"
        if sem is not None
        else "every other thread of the process waits in the same acquire, or joins threads "
        "without holding an acquire in its frames"
    )
    exited = [p for p in procs if p.exit_status and p.ppid in {o.pid for o in others} | set(pids)]
    gone = (
        "; gone meanwhile: " + ", ".join(f"{who(p)}, which {p.exit_status}" for p in exited)
        if exited
        else ""
    )
    text = (
        f"{where} wait{'s' if len(waiters) == 1 else ''} in {name}.acquire(){located(frame)} on "
        f"{what}: {count}, and no live process holds a slot in a way that will release it: "
        f"{holders}{gone}.{_held_below(waiters)} Its slots leaked: they were acquired on a path that returned or raised "
        f"without release(). Take it with `with {name}:` (or release it in a finally block), "
        "so that every path gives the slot back."
    )
    based = [f"{who(p)} blocked in {t.summary()}" for p, t, _, _ in waiters]
    based += [blocked_line(o) for o in others]
    return Hint(text, based, rule="leaked_slots", pids=sorted(set(pids) | {o.pid for o in others}))

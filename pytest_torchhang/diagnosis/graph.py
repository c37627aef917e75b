"""The wait-for graph as the rules read it: each thread's wait, whose it is, and who waits."""

from __future__ import annotations

import linecache
import os
import re
from collections import Counter

from ..inject.protocol import PLUGIN_THREAD_NAMES, THREAD_PREFIX
from ..report.model import Frame, ProcessReport, TaskWait, ThreadStack, WaitEdge
from ..report.waits import ChildExit
from .frames import is_library, located, main_thread, primitive
from .roles import is_pytest

# Every process report carries its kernel threads (``tasks``), each with the system call it was
# blocked in and its edges: "this thread waits for process P (through object O)". The rules
# read those edges, and name the primitive from the Python frames of the same thread.

#: System calls of a thread that sleeps (it wakes up by itself, or on a signal).
SLEEP_CALLS = ("nanosleep", "clock_nanosleep", "pause", "rt_sigsuspend", "rt_sigtimedwait")


_PLUGIN = "pytest_torchhang/"


def task_thread(proc: ProcessReport, task: TaskWait) -> ThreadStack | None:
    """The Python stack of a kernel thread, when it has one."""
    return next((t for t in proc.threads if t.ident == task.python_thread), None)


def main_task(proc: ProcessReport) -> TaskWait | None:
    """The kernel thread of the process's main Python thread (else its first thread)."""
    main = main_thread(proc)
    if main is not None:
        task = next((t for t in proc.tasks if t.python_thread == main.ident), None)
        if task is not None:
            return task
    return next((t for t in proc.tasks if t.tid == proc.pid), None)


def ignored(proc: ProcessReport, task: TaskWait) -> bool:
    """Threads that release nothing of the test's: the plugin's own (watchdog, monitor), native
    threads that were there before the test began, and, in the pytest process, Python threads
    from before the test that are not running (an earlier test's leftovers: they cannot know the
    pipes and locks this test created)."""
    thread = task_thread(proc, task)
    if task.name.startswith(THREAD_PREFIX) or (
        thread is not None and thread.name.startswith(PLUGIN_THREAD_NAMES)
    ):
        return True  # named by the plugin (its capture's helpers run psutil or stdlib code)
    if thread is not None and any(_PLUGIN in f.filename for f in thread.frames[:3]):
        return True
    if not task.before_test:
        return False
    if thread is None:  # a library's native thread (gloo, OpenMP) of an earlier test
        return bool(proc.threads)
    return is_pytest(proc) and task.call != "running" and task.state != "R"


#: Libraries that wait with a timeout of their own choosing, only to check for errors, and
#: then wait again (DataLoader's ``_try_get_data``, a Pool's handler threads, a rank's store).
_RETRY_LOOPS = (
    "torch/utils/data/",
    "torch/distributed/",
    "multiprocessing/pool.py",
    "multiprocessing/managers.py",
    "multiprocessing/queues.py",
    "multiprocessing/resource_sharer.py",
)


def _user_timeout(proc: ProcessReport, task: TaskWait) -> bool:
    """A timed wait whose timeout the user chose (``event.wait(1)`` in a loop of theirs): the
    thread wakes up and may do what others wait for. Not a library's error-checking loop."""
    thread = task_thread(proc, task)
    if thread is None:
        return False  # native threads (gloo, OpenMP) poll with timeouts to check for shutdown
    paths = [f.filename.replace(os.sep, "/") for f in thread.frames]
    return not any(loop in path for path in paths for loop in _RETRY_LOOPS)


def wait_kind(proc: ProcessReport, task: TaskWait) -> str:
    """stopped, dead, running, sleeping, blocked (edges in the tree), outside or unknown."""
    if proc.exit_status:
        return "dead"
    if proc.state.startswith("stopped") or task.state in ("T", "t"):
        return "stopped"
    if task.call == "running" or task.state == "R":
        return "running"
    if proc.motion is not None and proc.motion.kind == "polling" and task.tid in proc.motion.tids:
        return "sleeping"  # two looks saw it wake again and again: a loop, never a block
    if task.call in SLEEP_CALLS:
        return "sleeping"
    if task.timed and _user_timeout(proc, task):
        return "sleeping"  # it wakes up by itself, and may then do what others wait for
    if not task.waits_for:
        return "unknown"
    if any(e.pid < 0 for e in task.waits_for):
        return "outside"
    return "blocked"


def who(proc: ProcessReport) -> str:
    """``DataLoader worker 0/2 (pid 123)``."""
    return f"{proc.role} (pid {proc.pid})"


def doing(proc: ProcessReport) -> str:
    """``waits in Event.wait() at ds.py:12``, ``is stopped``: what a process does, in a phrase."""
    if proc.exit_status:
        return f"{proc.exit_status} (not reaped yet)"
    if proc.state.startswith("stopped"):
        return "is stopped"
    if proc.busy:
        return f"is running (+{proc.cpu_delta_s:.2f}s CPU during the capture) in {proc.stuck_at}"
    task = main_task(proc)
    thread = task_thread(proc, task) if task else main_thread(proc)
    name, frame = primitive(thread or main_thread(proc))
    if task is not None and task.call in SLEEP_CALLS:
        return f"sleeps{located(frame)}" + (f" in {name}" if name and "sleep" not in name else "")
    if name:
        return f"waits in {name}{located(frame)}"
    call = _call_phrase(task)
    if call:
        return f"{call}{located(frame)}"
    return f"waits in {proc.stuck_at}" if proc.stuck_at else "waits"


#: System calls that write, and that read, a pipe or a socket.
WRITES = ("write", "writev", "sendto", "sendmsg")
READS = ("read", "readv", "recvfrom", "recvmsg")


def _call_phrase(task: TaskWait | None) -> str:
    """The blocked system call in words, when the Python frames name no primitive."""
    if task is None or not task.obj:
        return ""
    if task.call in WRITES:
        return f"is blocked writing to {task.obj} (the pipe or socket is full)"
    if task.call in READS:
        return f"is blocked reading {task.obj}"
    if task.call in ("flock", "fcntl"):
        return f"waits for a {task.obj}"
    if task.call in ("wait4", "waitid"):
        return task.obj
    return ""


def blocked_line(proc: ProcessReport) -> str:
    """The graph's fact about a process's main thread, as evidence: its blocking call and what
    it waits for."""
    task = main_task(proc)
    edges = [e for e in (task.waits_for if task else []) if e.pid != proc.pid][:4]
    return f"{who(proc)} blocked in {task.summary() if task else '?'}" + "".join(
        f"; waits for pid {e.pid}: {e.via}" if e.pid else f"; {e.via}" for e in edges
    )


def edges_to(procs: list[ProcessReport], target: int) -> list[tuple[ProcessReport, WaitEdge]]:
    """(waiter, edge) for every process with a Python-visible thread that waits for ``target``."""
    out = []
    for proc in procs:
        if proc.pid == target:
            continue
        for task in proc.tasks:
            if ignored(proc, task):
                continue
            edge = next((e for e in task.waits_for if e.pid == target), None)
            if edge is not None and (task.python_thread or not proc.threads):
                out.append((proc, edge))
                break
    return out


def waiters_text(waiters: list[tuple[ProcessReport, WaitEdge]]) -> str:
    """What each waiter does, and through what it waits."""
    return "; ".join(f"{who(p)} {doing(p)}, through {e.via}" for p, e in waiters)


def edge_lines(waiters: list[tuple[ProcessReport, WaitEdge]], target: ProcessReport) -> list[str]:
    """One line of evidence per waiter: who waits for ``target``, through what."""
    return [f"{who(p)} waits for pid {target.pid}: {e.via}" for p, e in waiters]


def find_knot(procs: list[ProcessReport]) -> dict[int, set[int]]:
    """Processes whose threads wait only for each other: pid -> the pids they wait for.

    A thread stays in the set while every process it waits for has all its (non-plugin) threads
    in the set; a process with a running, sleeping, stopped or unreadable thread, or one that
    waits for something outside the tree, can still move, or is another story.
    """
    by_pid = {p.pid: p for p in procs}
    threads: dict[int, list[TaskWait]] = {
        p.pid: [t for t in p.tasks if not ignored(p, t)] for p in procs if p.tasks
    }
    members: dict[tuple[int, int], set[int]] = {}
    for pid, tasks in threads.items():
        for task in tasks:
            if wait_kind(by_pid[pid], task) == "blocked":
                members[(pid, task.tid)] = {e.pid for e in task.waits_for if e.pid > 0}
    changed = True
    while changed:
        changed = False
        stuck = Counter(pid for pid, _ in members)
        for key, targets in list(members.items()):
            if any(stuck[t] != len(threads.get(t, [])) or t not in threads for t in targets):
                del members[key]
                changed = True
    out: dict[int, set[int]] = {}
    stuck = Counter(pid for pid, _ in members)
    for (pid, _), targets in members.items():
        if stuck[pid] == len(threads[pid]):
            out.setdefault(pid, set()).update(targets)
    return out


def components(knots: dict[int, set[int]]) -> list[list[int]]:
    """The knot's groups of processes that wait for each other, each sorted by pid."""
    seen: set[int] = set()
    out = []
    for start in sorted(knots):
        if start in seen:
            continue
        group, todo = [], [start]
        while todo:
            pid = todo.pop()
            if pid in seen or pid not in knots:
                continue
            seen.add(pid)
            group.append(pid)
            todo.extend(knots[pid] | {q for q, t in knots.items() if pid in t})
        out.append(sorted(group))
    return out


def chain(procs: list[ProcessReport], start: ProcessReport) -> tuple[list[ProcessReport], str]:
    """Follow what ``start`` waits for, one releaser after the other, to the chain's end:
    (the processes in order, and how it ends: ``cycle`` when it comes back to one of them,
    else the last one's wait kind: stopped, dead, running, sleeping, outside, unknown, or
    ``split`` where a wait has several releasers)."""
    by_pid = {p.pid: p for p in procs}
    path = [start]
    while True:
        proc = path[-1]
        task = main_task(proc)
        kind = "dead" if proc.exit_status else (wait_kind(proc, task) if task else "unknown")
        if kind != "blocked" or task is None:
            return path, "running" if proc.busy else kind
        targets = {e.pid for e in task.waits_for if e.pid > 0 and e.pid != proc.pid}
        if len(targets) != 1 or next(iter(targets)) not in by_pid:
            return path, "split" if targets else "unknown"
        nxt = by_pid[next(iter(targets))]
        if nxt in path:
            return path[path.index(nxt) :], "cycle"
        path.append(nxt)


def cycle_text(cycle: list[ProcessReport]) -> str:
    """``pytest (pid 1) -> A (pid 2) -> B (pid 3) -> pytest (pid 1)``, from the pytest process
    when it is in the cycle (where the user's code starts)."""
    first = next((k for k, p in enumerate(cycle) if is_pytest(p)), 0)
    ordered = cycle[first:] + cycle[:first]
    return " -> ".join(who(p) for p in [*ordered, ordered[0]])


def user_frame(proc: ProcessReport, task: TaskWait | None = None) -> Frame | None:
    """The innermost frame of the user's code in the thread of ``task`` (else the main one)."""
    thread = task_thread(proc, task) if task else None
    thread = thread or main_thread(proc)
    return next((f for f in (thread.frames if thread else []) if not is_library(f)), None)


def following_lines(frame: Frame, limit: int = 12) -> list[tuple[int, str]]:
    """(line number, text) of up to ``limit`` lines after ``frame``'s in its function (the
    lines indented deeper than the function's ``def``)."""
    lines = linecache.getlines(frame.filename)
    if not 0 < frame.lineno <= len(lines):
        return []
    body = len(lines[frame.lineno - 1]) - len(lines[frame.lineno - 1].lstrip())
    top = 0  # the def's indent (a module's code: 0, and every line after it is "in" it)
    for text in reversed(lines[: frame.lineno - 1]):
        depth = len(text) - len(text.lstrip())
        if text.lstrip().startswith(("def ", "async def ")) and depth < body:
            top = depth + 1
            break
    out = []
    for number in range(frame.lineno + 1, min(len(lines), frame.lineno + limit) + 1):
        text = lines[number - 1]
        if not text.strip() or text.strip().startswith("#"):
            continue
        if len(text) - len(text.lstrip()) < top:
            break
        out.append((number, text.strip()))
    return out


_HOLDS = re.compile(r"^\s*with\s+(.+?)\s*(?:as\s+\w+\s*)?:|^\s*([\w.\[\]]+)\.acquire\(")


def code(line: str) -> str:
    """A source line without its trailing comment, to quote in a hint."""
    return re.sub(r"\s+#[^'\"]*$", "", line)


def holds_an_acquire(thread: ThreadStack | None) -> bool:
    """Whether a frame of the user's code in ``thread`` is inside a ``with X:`` block, or after
    an ``X.acquire()`` of its function with no release between: it may hold a lock or a
    semaphore slot, and release it when its wait ends. True when a source cannot be read."""
    return acquire_held(thread) is not None


def acquire_held(thread: ThreadStack | None) -> Frame | None:
    """The line (as a frame: file, number, text) of the ``with X:`` or ``X.acquire()`` that a
    frame of the user's code in ``thread`` may still hold (see :func:`holds_an_acquire`); the
    frame itself when its source cannot be read."""
    for frame in thread.frames if thread else []:
        if is_library(frame):
            continue
        lines = linecache.getlines(frame.filename)[: frame.lineno]
        if not lines:
            return frame
        indent = len(lines[-1]) - len(lines[-1].lstrip())
        released: set[str] = set()
        for number in range(len(lines) - 1, 0, -1):
            line = lines[number - 1]
            stripped = line.strip()
            depth = len(line) - len(line.lstrip())
            if stripped.startswith(("def ", "async def ")) and depth < indent:
                break
            if match := re.match(r"([\w.\[\]]+)\.release\(", stripped):
                released.add(match.group(1))
            found = _HOLDS.match(line)
            if found and (
                (found.group(1) and depth < indent)
                or (found.group(2) and found.group(2) not in released)
            ):
                return Frame(frame.filename, number, frame.name, stripped)
    return None


def joins(proc: ProcessReport, task: TaskWait | None = None) -> bool:
    """The thread waits for a child's exit (``Process.join()``, ``Popen.wait()``)."""
    task = task or main_task(proc)
    return task is not None and isinstance(task.wait, ChildExit)

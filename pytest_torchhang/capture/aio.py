"""The asyncio tasks of the tree's running event loops: read here, or from each process's answer.

A thread that runs an event loop shows only the loop's ``select`` in its stack. The tasks it
runs are read by ``inject.snapshot.asyncio_snapshot``: directly for this very process, and, for a
child, by the Python half of its dump handler (``PID.tasks.json``), written once its main
thread runs Python code again after the dump signal.
"""

from __future__ import annotations

import json
import linecache
import os
from typing import Any

from .. import clock
from ..inject.protocol import tasks_path
from ..inject.snapshot import asyncio_snapshot
from ..report.model import AsyncTask, EventLoop, Frame, ProcessReport, ThreadStack

#: How long the capture waits, at most, for the tasks of processes that run a loop.
TASKS_WAIT_S = 0.5


def runs_a_loop(thread: ThreadStack) -> bool:
    """Whether this thread's stack runs an asyncio event loop (``run_forever``)."""
    return any(
        f.name in ("run_forever", "_run_once", "BaseEventLoop.run_forever")
        and f.filename.replace(os.sep, "/").endswith("asyncio/base_events.py")
        for f in thread.frames
    )


def loops_of(snapshot: list[dict[str, Any]]) -> list[EventLoop]:
    """The model's loops from a snapshot (``asyncio_snapshot``'s data), source lines added."""
    loops = []
    for doc in snapshot:
        tasks = []
        for row in doc.get("tasks", []):
            awaits = row.get("awaits", {})
            frames = [
                Frame(str(f), int(n), str(name), linecache.getline(str(f), int(n)).strip())
                for f, n, name in row.get("frames", [])
            ]
            tasks.append(
                AsyncTask(
                    name=str(row.get("name", "")),
                    coro=str(row.get("coro", "")),
                    state=str(row.get("state", "pending")),
                    frames=frames,
                    awaits=str(awaits.get("kind", "")),
                    call=str(awaits.get("call", "")),
                    detail=str(awaits.get("detail", "")),
                    awaits_tasks=[str(t) for t in awaits.get("tasks", [])],
                    obj=int(awaits.get("obj", 0) or 0),
                    refs=[int(r) for r in row.get("refs", [])],
                    timed=bool(row.get("timed", False)),
                )
            )
        loops.append(
            EventLoop(
                thread=str(doc.get("thread", "")),
                thread_name=str(doc.get("thread_name", "")),
                loop=str(doc.get("loop", "")),
                ready=int(doc.get("ready", -1)),
                timers=int(doc.get("timers", -1)),
                fds=int(doc.get("fds", -1)),
                signal_handlers=int(doc.get("signal_handlers", -1)),
                tasks=tree_order(tasks),
                tasks_left_out=int(doc.get("tasks_left_out", 0)),
            )
        )
    return loops


def tree_order(tasks: list[AsyncTask]) -> list[AsyncTask]:
    """Tasks as ``pstree`` lists them: each task that no other awaits, then, below it, the
    tasks it awaits (a task awaited twice, or in a cycle, is listed once)."""
    by_name = {t.name: t for t in tasks}
    awaited = {name for t in tasks for name in t.awaits_tasks}
    out: list[AsyncTask] = []
    seen: set[int] = set()

    def visit(task: AsyncTask) -> None:
        if id(task) in seen:
            return
        seen.add(id(task))
        out.append(task)
        for name in task.awaits_tasks:
            if name in by_name:
                visit(by_name[name])

    for task in [t for t in tasks if t.name not in awaited] + tasks:  # cycles: the rest
        visit(task)
    return out


def add_tasks(
    reports: list[ProcessReport], dump_dir: str | None, since: float, budget_s: float
) -> list[str]:
    """Each process's running loops and their tasks into its report; returns notes.

    This process's loops are read here; a child's come from its ``PID.tasks.json``, written
    since ``since`` (wall time), awaited for at most ``budget_s`` and only from processes whose
    stacks show a loop (the others have nothing to say).
    """
    me = os.getpid()
    notes: list[str] = []
    waiting: dict[int, ProcessReport] = {}
    for report in reports:
        if not any(runs_a_loop(t) for t in report.threads):
            continue
        if report.pid == me:
            try:
                report.event_loops = loops_of(asyncio_snapshot())
            except Exception as exc:  # the stacks stay: say why the tasks are missing
                notes.append(
                    f"pid {me}: its asyncio tasks could not be read: {type(exc).__name__}: {exc}"
                )
        elif dump_dir is not None:
            waiting[report.pid] = report
    deadline = clock.monotonic() + budget_s
    while waiting:
        for pid, report in list(waiting.items()):
            doc = read_answer(tasks_path(dump_dir, pid), since) if dump_dir else None
            if doc is not None:
                report.event_loops = loops_of(doc.get("loops", []))
                if doc.get("error"):
                    notes.append(f"pid {pid}: its asyncio tasks could not be read: {doc['error']}")
                del waiting[pid]
        if not waiting or clock.monotonic() >= deadline:
            break
        clock.sleep(0.01)
    notes += [
        f"pid {pid}: it runs an asyncio event loop, but its tasks did not come within "
        f"{budget_s:.1f}s (its main thread ran no Python code to write them: a C call, or a "
        "blocked signal)"
        for pid in waiting
    ]
    return notes


def read_answer(path: str, since: float, limit: int = 4 << 20) -> dict[str, Any] | None:
    """A child's JSON answer at ``path`` (at most ``limit`` bytes) when it was written since
    ``since`` (wall time, by the file's mtime: the child's own clock may be a test's frozen
    one); None otherwise. Shared by every capture step that reads a child's answer file."""
    try:
        with open(path, "rb") as answer:
            if os.fstat(answer.fileno()).st_mtime < since - 0.01:
                return None  # an earlier capture's answer
            doc = json.loads(answer.read(limit))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None

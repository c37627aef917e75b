"""The kernel's evidence and the ranks' collectives, merged into the capture's process reports."""

from __future__ import annotations

import contextlib

from ..report.model import Collective, ProcessReport, TaskWait, ThreadStack
from . import procfs
from .collectives import MAX_COLLECTIVES
from .waitgraph import Evidence, describe_exit

#: A thread's stack lies below its pthread descriptor; glibc's default stack is 8 MiB.
_MAX_STACK = 64 << 20


def match_threads(pid: int, threads: list[ThreadStack], tasks: list[TaskWait]) -> None:
    """Tell each kernel thread which Python thread it runs (sets ``TaskWait.python_thread``).

    A Python thread's ident is its ``pthread_t``, the address of the descriptor glibc puts at the
    top of the thread's stack: the blocked thread's stack pointer lies just below it. The main
    thread is the task whose id is the pid.
    """
    by_tid = {t.tid: t for t in tasks}
    idents: dict[int, ThreadStack] = {}
    for thread in threads:
        if thread.tid and thread.tid in by_tid:
            by_tid[thread.tid].python_thread = thread.ident
            continue
        with contextlib.suppress(ValueError):
            idents[int(thread.ident, 16)] = thread
    taken: set[int] = set()
    for task in tasks:
        if task.python_thread or task.tid == pid or not task.sp:
            continue
        above = [
            (i - task.sp, i) for i in idents if 0 < i - task.sp < _MAX_STACK and i not in taken
        ]
        if above:
            _, ident = min(above)
            taken.add(ident)
            task.python_thread = idents[ident].ident
    main_task = by_tid.get(pid)
    left = [t for i, t in idents.items() if i not in taken]
    if main_task is not None and not main_task.python_thread:
        main = [t for t in left if t.current] if len(left) > 1 else left
        if len(main) == 1:
            main_task.python_thread = main[0].ident


def attach(
    reports: list[ProcessReport],
    evidence: Evidence,
    collectives: dict[int, list[Collective] | str] | None = None,
) -> list[str]:
    """Put the evidence into the process reports (and a report per zombie child); returns notes."""
    notes = list(evidence.notes)
    known = {r.pid for r in reports}
    for report in reports:
        member = evidence.members.get(report.pid)
        if member is None:
            continue
        report.tasks = member.tasks
        match_threads(report.pid, report.threads, report.tasks)
        tids = {t.python_thread: t.tid for t in report.tasks if t.python_thread}
        for thread in report.threads:
            thread.tid = thread.tid or tids.get(thread.ident, 0)
        report.threads.sort(key=lambda t: t.tid != report.pid)  # the main thread first
        if member.stopped and not report.state.startswith("stopped"):
            report.state = "stopped (SIGSTOP)"
    for member in evidence.members.values():
        if member.pid in known or not member.gone:
            continue
        reports.append(
            ProcessReport(
                pid=member.pid,
                ppid=member.ppid,
                role="",
                cmdline="",
                state="zombie",
                cpu_s=member.cpu_ticks / procfs.TICKS,
                cpu_delta_s=0.0,
                rss_bytes=0,
                num_threads=0,
                age_s=0.0,
                dump_status="gone: exited before the deadline",
                exit_status=describe_exit(member.wait_status),
            )
        )
    for report in reports:
        got = (collectives or {}).get(report.pid)
        if isinstance(got, str):
            notes.append(f"pid {report.pid}: {got}")
        elif got:
            report.collectives = got[-MAX_COLLECTIVES:]
    return notes

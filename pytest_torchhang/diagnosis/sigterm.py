"""What a SIGTERM would do to a child a process waits for: a child that ignores SIGTERM, or
blocks it in its signal mask, is not ended by ``terminate()`` (issue 28, item 2: what the other
end of a wait would do).

Both dispositions are inherited at fork (``SIG_IGN`` survives exec too; a thread's mask is the
child's), so the parent's own masks say where the child got it.
"""

from __future__ import annotations

import linecache
import re

from ..report.model import ProcessReport, TaskWait
from ..report.waits import CHILD, ChildExit
from .frames import is_library, main_thread
from .graph import task_thread, who

#: A call that sends the child SIGTERM: multiprocessing's and subprocess's ``terminate()``.
_TERMINATE = re.compile(r"\.terminate\(\)")
#: How many lines above the wait a terminate() call is looked for.
_LOOK_BACK = 12


def sigterm_facts(
    proc: ProcessReport, task: TaskWait | None, procs: list[ProcessReport]
) -> list[str]:
    """Facts about the SIGTERM dispositions of the live children ``proc`` waits to exit."""
    if task is None or not isinstance(task.wait, ChildExit):
        return []
    by_pid = {p.pid: p for p in procs}
    sent = _terminated_at(proc, task)
    known = []
    for edge in task.waits_for:
        child = by_pid.get(edge.pid)
        if edge.kind != CHILD or child is None or child.exit_status or child.signals is None:
            continue
        how = child.signals.disposition("SIGTERM")
        mine = proc.signals.disposition("SIGTERM") if proc.signals is not None else ""
        if how == "ignored":
            known.append(
                f"{who(child)} ignores SIGTERM (SIG_IGN"
                + (", as its parent does: a disposition inherited at fork" if mine == how else "")
                + "), so the SIGTERM that terminate() sends does not end it"
                + (f"{sent}" if sent else "")
            )
        elif how == "blocked":
            known.append(
                f"{who(child)} blocks SIGTERM in its signal mask (a mask is inherited from the "
                "thread that forked it), so the SIGTERM that terminate() sends stays pending "
                "and does not end it" + (f"{sent}" if sent else "")
            )
    return known


def _terminated_at(proc: ProcessReport, task: TaskWait) -> str:
    """``: the test called terminate() at line 30, before this wait`` when the user's frame
    that waits has a terminate() call just above its line."""
    thread = task_thread(proc, task) or main_thread(proc)
    frame = next((f for f in thread.frames if not is_library(f)), None) if thread else None
    if frame is None:
        return ""
    lines = linecache.getlines(frame.filename)
    start = max(0, frame.lineno - 1 - _LOOK_BACK)
    for number in range(frame.lineno - 1, start, -1):
        if _TERMINATE.search(lines[number - 1] if number - 1 < len(lines) else ""):
            return f" (terminate() was called at line {number}, before this wait)"
    return ""

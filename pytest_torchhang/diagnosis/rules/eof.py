"""Rules for reads to the end of a child's output: the end comes only when every process that
holds the pipe's write end has closed it, and a process left behind by an exited child (a
background grandchild) can hold it open forever."""

from __future__ import annotations

from ...report.model import Hint, ProcessReport
from ...report.waits import HOLDS_WRITE_END, Pipe
from ..frames import has_frame, located, primitive
from ..graph import blocked_line, doing, main_task, task_thread, wait_kind, who


def hint_output_held(procs: list[ProcessReport]) -> list[Hint]:
    """A process reads a subprocess's output to its end (``communicate()``) while a child of
    it has exited and the pipe's only holders are later processes of its own that do not
    exit (a background process the exited child started, adopted when it was orphaned)."""
    by_pid = {p.pid: p for p in procs}
    hints = []
    for proc in procs:
        task = main_task(proc)
        if task is None or not isinstance(task.wait, Pipe) or wait_kind(proc, task) != "blocked":
            continue
        if not has_frame(proc, "subprocess.py", "communicate", "_communicate"):
            continue
        holders = {e.pid for e in task.waits_for if e.kind == HOLDS_WRITE_END} - {proc.pid}
        if not holders or any(h not in by_pid for h in holders):
            continue
        live = [by_pid[h] for h in sorted(holders)]
        exited = [p for p in procs if p.ppid == proc.pid and p.exit_status]
        if any(w.exit_status or w.busy for w in live) or not exited:
            continue
        # each holder is a process of the waiter's started after a child that exited: what
        # that child left behind (orphans are adopted by the test's process, a subreaper)
        if not all(w.ppid == proc.pid and any(w.pid > x.pid for x in exited) for w in live):
            continue
        name, frame = primitive(task_thread(proc, task))
        gone = ", ".join(f"{who(x)} {x.exit_status}" for x in exited)
        hints.append(
            Hint(
                f"{who(proc)} waits in {name or 'Popen.communicate()'}{located(frame)} for the end "
                "of a child's output (the pipe's EOF), which comes only when every process that "
                "holds the pipe's write end has closed it. Its only holder"
                + ("s are " if len(live) > 1 else " is ")
                + "; ".join(f"{who(w)}, which {doing(w)}" for w in live)
                + f", while {gone} before the deadline. A process that a child starts in the "
                "background (a grandchild: `cmd &`, a daemon) inherits the child's output pipe "
                "and keeps it open after the child exits, and its parent's read never sees the "
                "end. Redirect the background process's output (`> /dev/null 2>&1 &`, "
                "stdout=subprocess.DEVNULL), or do not read the output to its end.",
                [blocked_line(proc), *(blocked_line(w) for w in live)]
                + [f"{who(x)} {x.exit_status}" for x in exited],
                rule="output_held",
                pids=[proc.pid, *(w.pid for w in live)],
            )
        )
    return hints

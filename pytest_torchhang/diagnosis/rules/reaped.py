"""Rules for a child's exit that its waiter cannot see: a loop that asks whether a child still
runs (``is_alive()``, ``poll()``) while a SIGCHLD handler of the same process collects the exit
statuses (``os.waitpid(-1)``) that the question needs."""

from __future__ import annotations

import re

from ...report.model import Hint, ProcessReport
from ..frames import is_library, located, main_thread
from ..graph import code, who
from ..roles import is_helper
from .waits import _loop_head

#: A loop condition that asks a child's state: multiprocessing's and subprocess's questions.
_ASKS_CHILD = re.compile(r"\b(is_alive\(\)|\.poll\(\)|exitcode|returncode)")


def hint_status_reaped(procs: list[ProcessReport]) -> list[Hint]:
    """A process loops on a child's state while none of its children is alive or left
    unreaped, and it has a Python SIGCHLD handler of its own."""
    hints = []
    for proc in procs:
        handlers = proc.signals.handlers if proc.signals is not None else None
        handler = (handlers or {}).get("SIGCHLD")
        if handler is None or proc.exit_status or proc.busy:
            continue
        children = [p for p in procs if p.ppid == proc.pid and not is_helper(p)]
        if children:
            continue  # a child still runs, or is a zombie nobody reaped: not this story
        thread = main_thread(proc)
        frame = next((f for f in thread.frames if not is_library(f)), None) if thread else None
        head = None
        if frame is not None:
            head = frame if frame.line.startswith("while ") else _loop_head(frame)
        if head is None or not _ASKS_CHILD.search(head.line):
            continue
        hints.append(
            Hint(
                f"{who(proc)} loops on a child's state{located(head)} (`{code(head.line)}`), "
                "and no child of it is alive or left unreaped: the child ended, yet the loop "
                f"goes on. {who(proc)} has a Python SIGCHLD handler of its own ({handler}): a "
                "handler that reaps children (os.waitpid(-1, ...), os.wait()) takes the exit "
                "status that is_alive(), poll() and exitcode need, so they never learn that "
                "the child exited. Reap only the pids the handler started itself, or do not "
                "install one while multiprocessing or subprocess children run.",
                [f"{who(proc)}: SIGCHLD handler {handler}; no live or zombie child"],
                rule="status_reaped",
                pids=[proc.pid],
            )
        )
    return hints

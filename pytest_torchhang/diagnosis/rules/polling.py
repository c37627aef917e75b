"""A process that polls: between two looks half a second apart it slept and woke again and
again, with little CPU, in the same frames (a ``while not cond: sleep(0.01)`` loop, a wait
with a short timeout in a loop). It is not blocked (it looks, and would see the condition),
and it is not computing: it waits for a condition that has not come."""

from __future__ import annotations

import re

from ...report.model import Frame, Hint, ProcessReport
from ..frames import is_library, located, main_thread
from ..graph import code, who
from ..roles import is_helper
from .waits import _loop_head, _polls


def polls(proc: ProcessReport) -> bool:
    """The second look saw it poll (and it is neither gone nor a helper of the plugin's)."""
    return (
        proc.motion is not None
        and proc.motion.kind == "polling"
        and not proc.exit_status
        and not is_helper(proc)
    )


#: A loop whose condition reads these waits for children to finish: it supervises them, and
#: what they do (stuck, computing) is the story, which other rules tell.
_SUPERVISES = re.compile(r"\b(exitcode|returncode|is_alive|join)\b")


#: A loop with no condition: it looks at nothing between its sleeps (a server's idle loop).
_FOREVER = re.compile(r"^while\s*\(?\s*(True|1)\s*\)?\s*:")


def _loop(proc: ProcessReport) -> tuple[str, Frame] | None:
    """(what the loop reads, in words, or ""; the ``while`` line of the user's loop) of a
    polling process; None when the poll is not a loop of the user's code (a library's own
    retry inside one call, a store's client: the rules about that call tell it) or when the
    loop supervises children."""
    found = _polls(proc)
    if found is None:
        thread = main_thread(proc)
        frame = next((f for f in thread.frames if not is_library(f)), None) if thread else None
        if frame is None:
            return None
        head = frame if frame.line.startswith("while ") else _loop_head(frame)
        if head is None:
            return None
        found = ("", head)
    if _SUPERVISES.search(found[1].line):
        return None
    if not found[0] and _FOREVER.match(found[1].line):
        return None  # `while True:` with a sleep: a service's loop, it polls no condition
    return found


def hint_polling(procs: list[ProcessReport]) -> list[Hint]:
    """Each polling process: what it polls, where, and the two looks' evidence."""
    hints = []
    for proc in procs:
        if not polls(proc) or proc.motion is None:
            continue
        loop_found = _loop(proc)
        if loop_found is None:
            continue
        what, frame = loop_found
        seen = proc.motion
        loop = f" a loop that polls {what}" if what else " a loop"
        line = f": `{code(frame.line)}`" if frame.line else ""
        hints.append(
            Hint(
                f"{who(proc)} polls for a condition that has not come: in{loop}"
                f"{located(frame)}{line}, it slept and woke "
                f"{seen.voluntary_switches} times in {seen.interval_s:.1f} s with little CPU "
                f"(+{seen.cpu_delta_s:.2f}s) and its frames did not move. It is not blocked: "
                "it looks again and again, and what it looks for is not there. Find what "
                "should make it true and whether anything still can, and give the loop a "
                "deadline.",
                [f"{who(proc)} {seen.summary()}"],
                rule="polling",
                pids=[proc.pid],
            )
        )
    return hints

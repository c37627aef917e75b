"""The rule for processes still starting up (importing) when the deadline came."""

from __future__ import annotations

from ...report.model import Hint, ProcessReport
from ..frames import importing
from ..roles import is_pytest


def hint_still_starting(procs: list[ProcessReport]) -> list[Hint]:
    """Processes still importing at the deadline: it may be shorter than their start-up."""
    starting = [p for p in procs if not is_pytest(p) and importing(p)]
    if not starting:
        return []
    oldest = max(p.age_s for p in starting)
    return [
        Hint(
            f"{len(starting)} process(es) are still starting up, importing modules {oldest:.1f}s after "
            "they were started: the deadline may be shorter than their start-up (spawn and forkserver "
            "children import the test module, and torch, anew). Raise the timeout, start them with "
            "fork, or preload heavy modules in the forkserver (set_forkserver_preload).",
            [
                f"{p.role} (pid {p.pid}), age {p.age_s:.1f}s, importing in {p.stuck_at}"
                for p in starting
            ],
            rule="still_starting",
            pids=sorted({p.pid for p in starting}),
        )
    ]

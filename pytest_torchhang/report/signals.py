"""What a signal would do to a process: its masks from /proc, its own handlers and pending alarm.

A wait that no thread or process of the tree can end may still end on a signal: a worker that
installed a SIGTERM handler (or keeps SIGTERM's default action) ends when its parent calls
``terminate()``; a test under its own ``signal.alarm`` guard raises when the alarm fires. The
kernel shows which signals a process catches, blocks and ignores (``SigCgt``, ``SigBlk`` and
``SigIgn`` of ``/proc/PID/status``, readable from outside); which of them run a *Python*
handler, and the ``ITIMER_REAL`` alarm still pending, only the process itself can tell (the
pytest process reads its own; a child's dump handler writes them beside its stack).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any

#: The signals whose arrival ends a wait in a way worth telling: a polite stop (what
#: ``terminate()``, a supervisor or Ctrl-C sends), a timer, and the user's own two. Real-time
#: signals are left out (the plugin's dump signal is one).
TOLD = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGALRM", "SIGUSR1", "SIGUSR2")
#: Signals whose default action ends the process (the wait with it).
_DEFAULT_ENDS = frozenset(TOLD)


def names(mask: int) -> list[str]:
    """The standard signals (1-31) of a ``/proc`` mask, by name: ``0x4002`` -> SIGINT, SIGTERM."""
    out = []
    for number in range(1, 32):
        if mask >> (number - 1) & 1:
            try:
                out.append(signal.Signals(number).name)
            except ValueError:  # a number with no name on this platform
                out.append(f"signal {number}")
    return out


@dataclass
class SignalFacts:
    """One process's signal dispositions at the capture.

    ``handlers`` and ``alarm_s`` come from the process itself: None when it did not answer
    (not Python, no dump handler, its main thread in C), and then only the masks are known.
    """

    caught: list[str] = field(default_factory=list)  # SigCgt: a handler is installed
    blocked: list[str] = field(default_factory=list)  # SigBlk of its main thread
    ignored: list[str] = field(default_factory=list)  # SigIgn
    #: signal name -> its Python handler's qualified name (the user's: Ctrl-C's default and the
    #: plugin's own left out)
    handlers: dict[str, str] | None = None
    #: seconds until its ITIMER_REAL alarm (``signal.alarm``, ``setitimer``) fires; 0: none
    alarm_s: float | None = None

    def disposition(self, name: str) -> str:
        """``handler on_term`` (a Python handler), ``handler`` (one installed, not known as
        Python's), ``default``, ``ignored`` or ``blocked``: what ``name`` would do now."""
        if name in self.blocked:
            return "blocked"
        if name in self.ignored:
            return "ignored"
        if self.handlers is not None and name in self.handlers:
            return f"handler {self.handlers[name]}"
        if name in self.caught:
            # caught, but not by a handler of the user's: Python's own Ctrl-C, or C code's
            return "handler" if self.handlers is None or name != "SIGINT" else "default"
        return "default"

    def ends_on(self, name: str) -> bool:
        """Whether ``name`` arriving now would run a handler or end the process."""
        kind = self.disposition(name)
        return kind.startswith("handler") or (kind == "default" and name in _DEFAULT_ENDS)


def to_json(facts: SignalFacts | None) -> dict[str, Any] | None:
    """The JSON form (None stays None: a report written before signals were read)."""
    if facts is None:
        return None
    return {
        "caught": facts.caught,
        "blocked": facts.blocked,
        "ignored": facts.ignored,
        "handlers": facts.handlers,
        "alarm_s": facts.alarm_s,
    }


def from_json(doc: dict[str, Any] | None) -> SignalFacts | None:
    """The facts back from :func:`to_json`'s form."""
    if not doc:
        return None
    handlers = doc.get("handlers")
    alarm = doc.get("alarm_s")
    return SignalFacts(
        caught=[str(s) for s in doc.get("caught", [])],
        blocked=[str(s) for s in doc.get("blocked", [])],
        ignored=[str(s) for s in doc.get("ignored", [])],
        handlers={str(k): str(v) for k, v in handlers.items()} if handlers is not None else None,
        alarm_s=float(alarm) if alarm is not None else None,
    )

"""What a signal would still do to a wait that no thread or process of the test ends.

Rules say what in the tree could end a wait; a signal comes from outside it. Three facts say a
signal still would: the process's own alarm pending (``signal.alarm``, ``setitimer``), a handler
it installed (a worker that exits on SIGTERM), and SIGTERM's default action for a child whose
parent waits for its exit (``Process.join()`` without ``terminate()``). Each is told with what
is missing (nobody sends the signal; the alarm fires after the deadline) and its evidence
(``/proc/PID/status``'s masks, the process's own answer). Where nothing was read, nothing is
claimed either way.
"""

from __future__ import annotations

from ...report.model import Hint, ProcessReport
from ...report.signals import SignalFacts
from ...report.waits import CHILD
from ..frames import located, main_thread, primitive
from ..graph import edges_to, who

#: Rules whose words were "nothing can end that wait": a SIGTERM's default action is worth
#: telling there (elsewhere their cause is another, and terminate() no fix).
_NOBODY_RULES = ("nobody", "deadlock")
#: Signals a user's own Python handler for is told (SIGALRM has its own sentence, with the alarm).
_USER_SIGNALS = ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGINT")


def _handler_words(disposition: str) -> str:
    """``its handler on_term``, ``a handler (installed, not one of Python's)``."""
    name = disposition.removeprefix("handler").strip()
    if not name:
        return "the handler it installed (SigCgt)"
    if name.endswith("<lambda>"):
        owner = name.removesuffix("<lambda>").removesuffix(".<locals>.")
        return f"its Python handler (a lambda{' in ' + owner if owner else ''})"
    return f"its Python handler {name}()"


def _joiner(proc: ProcessReport, procs: list[ProcessReport]) -> str:
    """``pytest (pid 7) waits for its exit in Process.join() at test_x.py:23``, or ""."""
    for parent, edge in edges_to(procs, proc.pid):
        if edge.kind == CHILD:
            name, frame = primitive(main_thread(parent))
            return f"{who(parent)} waits for its exit in {name or 'wait()'}{located(frame)}"
    return ""


def _alarm(facts: SignalFacts) -> str:
    if not facts.alarm_s:
        return ""
    when = f"its own alarm (signal.alarm or setitimer) is due in {facts.alarm_s:.1f}s"
    kind = facts.disposition("SIGALRM")
    if kind.startswith("handler"):
        return (
            f"{when} and will run {_handler_words(kind)} in the main thread, which ends the wait "
            "if it raises or exits"
        )
    if kind == "default":
        return f"{when}, and SIGALRM's default action will end the process"
    return f"{when}, but SIGALRM is {kind} there: it will not end the wait"


def _sigterm(
    proc: ProcessReport, procs: list[ProcessReport], facts: SignalFacts, nobody: bool
) -> str:
    kind = facts.disposition("SIGTERM")
    joiner = _joiner(proc, procs)
    # a Python handler of the user's says the process is meant to be stopped by a signal; a C
    # library's (torch's DataLoader workers exit on their parent's SIGTERM) is told only where
    # the rule's words were "nothing can end" and a parent joins it
    python = kind.startswith("handler ")
    if not (python or (nobody and joiner)):
        return ""
    if kind.startswith("handler"):
        said = f"a SIGTERM would run {_handler_words(kind)}"
    elif kind == "default":
        said = "a SIGTERM (what terminate() sends) would end it by its default action"
    else:
        return f"SIGTERM is {kind} there: terminate() would not end it (kill() would)"
    if joiner:
        return f"{said}, but nobody sends one: {joiner}, with no terminate() before it"
    return f"{said}, and no process of the test sends one"


def _others(facts: SignalFacts) -> list[str]:
    out = []
    for name in _USER_SIGNALS:
        kind = facts.disposition(name)
        if name != "SIGTERM" and facts.handlers and name in facts.handlers:
            out.append(f"a {name} would run {_handler_words(kind)}")
    return out


def clauses(proc: ProcessReport, procs: list[ProcessReport], nobody: bool) -> list[str]:
    """What a signal would still do to ``proc``'s wait, one clause each; [] when nothing is
    known to (or nothing was read)."""
    facts = proc.signals
    if facts is None or proc.exit_status:
        return []
    found = [_alarm(facts), _sigterm(proc, procs, facts, nobody), *_others(facts)]
    return [c for c in found if c]


def evidence(proc: ProcessReport) -> str:
    """The facts the clauses read, as a ``based on`` line."""
    facts = proc.signals
    if facts is None:
        return ""
    masks = "; ".join(
        f"{label} {', '.join(value) or 'none'}"
        for label, value in (
            ("SigCgt", facts.caught),
            ("SigBlk", facts.blocked),
            ("SigIgn", facts.ignored),
        )
    )
    line = f"{who(proc)}: {masks} (/proc/{proc.pid}/status)"
    if facts.handlers is not None:
        handlers = ", ".join(f"{k}: {v}" for k, v in sorted(facts.handlers.items())) or "none"
        alarm = f"{facts.alarm_s:.1f}s" if facts.alarm_s else "none"
        line += f"; Python handlers {handlers}; alarm pending {alarm} (read by the process itself)"
    return line


def add_signal_enders(found: list[Hint], procs: list[ProcessReport]) -> None:
    """Each hint told what a signal would still do to the waits of the processes it names."""
    by_pid = {p.pid: p for p in procs}
    for hint in found:
        nobody = hint.rule in _NOBODY_RULES
        for pid in dict.fromkeys(hint.pids):
            proc = by_pid.get(pid)
            said = clauses(proc, procs, nobody) if proc is not None else []
            if proc is None or not said:
                continue
            hint.text += (
                f" What a signal would still do to the wait of {who(proc)}: "
                + "; ".join(said)
                + "."
            )
            hint.based_on.append(evidence(proc))

"""The rule engine: roles, the headline, and every rule run in order; a hint is a hint, never a
guess."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from ..report import groups
from ..report.model import Hint, ProcessReport
from ..report.waits import WaitFacts
from .ends import render, wait_facts
from .frames import waits_in_user_code
from .graph import main_task
from .roles import HELPER_ROLES, is_helper, is_pytest, label_roles, role_of
from .rules.aio import hint_asyncio
from .rules.beside import hint_beside_idle_services
from .rules.distributed import hint_collectives, hint_rank_gone
from .rules.enders import add_signal_enders
from .rules.eof import hint_output_held
from .rules.loading import (
    hint_cuda_before_fork,
    hint_openmp_after_fork,
    hint_unpicklable_batch,
    hint_worker_lock,
)
from .rules.pipes import hint_fifo, hint_full_pipe, hint_pipe
from .rules.polling import hint_polling
from .rules.reaped import hint_status_reaped
from .rules.sharing import (
    hint_end_marker,
    hint_join_cycle,
    hint_manager,
    hint_pool_lost,
    hint_queue_join,
)
from .rules.slots import hint_leaked_slots
from .rules.starting import hint_import_lock_at_fork, hint_still_starting
from .rules.stores import hint_store_keys
from .rules.waits import (
    hint_busy,
    hint_dead,
    hint_deadlock,
    hint_no_answer,
    hint_outside,
    hint_poll_dead,
    hint_sleeper,
    hint_stopped,
)

__all__ = ["HELPER_ROLES", "cause", "culprits", "headline", "hints", "label_roles", "odd_one_out"]

Rule = Callable[[list[ProcessReport]], list[Hint]]


def headline(
    test_id: str,
    elapsed: float,
    processes: list[ProcessReport],
    root_pid: int,
    found: list[Hint] | None = None,
) -> str:
    """``HANG after 8.0s in test_x: 3 processes, 2 stuck in DataLoader worker __getitem__``.

    When the processes of one role mostly agree and some differ, the headline names the odd one
    out: ``5 processes, DataLoader worker 1/4 (pid 7) stuck in __getitem__ (3 other DataLoader
    workers wait in _worker_loop -> queues.get -> select)``. Given the hints (``found``), it
    names what the first one names when the stacks alone would name others (one story: the
    headline, the culprits and the cause agree).
    """
    live = len([p for p in processes if not p.exit_status])
    head = f"HANG after {elapsed:.1f}s in {test_id}: {live} process{'es' if live != 1 else ''}"
    told = _told(found, processes, root_pid)
    if told is not None:
        return head + _told_words(told, processes, root_pid)
    others = _stuck_children(processes, root_pid)
    if not others:
        root = next((p for p in processes if p.pid == root_pid), None)
        return head + (f", stuck {_in(root.stuck_at)}" if root and root.stuck_at else "")
    odd = odd_one_out(processes, root_pid)
    if odd is not None:
        outlier, crowd = odd
        where = outlier.processes[0].stuck_at
        pending = groups.pending(outlier.processes[0])
        if pending is not None:
            where += f", in {groups.collective_text(pending)}"
        many = len(crowd.processes)
        return (
            f"{head}, {outlier.who()} stuck {_in(where)} ({many} other "
            f"{groups.plural(crowd.role) if many > 1 else crowd.role} "
            f"wait{'s' if many == 1 else ''} in {crowd.where})"
        )
    counted = Counter((role_of(p).general(), p.stuck_at) for p in others)
    (kind, where), count = counted.most_common(1)[0]
    return f"{head}, {count} stuck in {kind} {where}"


def _in(where: str) -> str:
    """``in __getitem__``, but ``while spawn re-imports test_x`` as it is (issue 32)."""
    return where if where.startswith("while ") else f"in {where}"


#: Hints that state what a process did (exited, used CPU) rather than name a cause: the
#: headline follows the first hint that names one.
_FACTS = ("none", "dead", "busy")


def _told(
    found: list[Hint] | None, processes: list[ProcessReport], root_pid: int
) -> list[ProcessReport] | None:
    """The processes the first hint names, when the stacks alone would name none of them
    (None: they agree, or there is no hint)."""
    first = next((h for h in found or [] if h.rule not in _FACTS and h.pids), None)
    if first is None or set(_by_stacks(processes, root_pid)) & set(first.pids):
        return None
    by_pid = {p.pid: p for p in processes}
    told = [by_pid[pid] for pid in dict.fromkeys(first.pids) if pid in by_pid]
    return told or None


def _told_words(told: list[ProcessReport], processes: list[ProcessReport], root_pid: int) -> str:
    """``, pytest (pid 7) stuck in test_x``; the root alone keeps the root's form."""
    if [p.pid for p in told] == [root_pid]:
        return f", stuck {_in(told[0].stuck_at)}" if told[0].stuck_at else ""
    shown = [p for p in told if p.pid != root_pid] or told
    where = shown[0].stuck_at or groups.where(shown[0])
    names = ", ".join(f"{p.role} (pid {p.pid})" for p in shown)
    return f", {names} stuck {_in(where)}" if where else f", {names} stuck"


def _stuck_children(processes: list[ProcessReport], root_pid: int) -> list[ProcessReport]:
    """The test's processes but pytest that are stuck somewhere: helpers wait by design, and
    name the hang only when nothing else does."""
    return [
        p
        for p in processes
        if p.pid != root_pid
        and p.stuck_at
        and not is_helper(p)
        and not p.exit_status
        and not groups.idle_service(p)
    ]


def odd_one_out(
    processes: list[ProcessReport], root_pid: int
) -> tuple[groups.StackGroup, groups.StackGroup] | None:
    """The outlier the headline names, with the crowd of its peers it differs from: of the
    roles whose processes mostly share one stack, the one with the largest crowd; None when no
    role has a crowd and an outlier (every worker the same, or two ranks that each differ), or
    when the crowd waits in the user's code and the outlier does not."""
    stuck = {p.pid for p in _stuck_children(processes, root_pid)}
    found = groups.group_processes([p for p in processes if p.pid in stuck])
    crowds = {g.role: g for g in found if g.crowd}
    outliers = [g for g in found if g.outlier and g.role in crowds]
    if not outliers:
        return None
    outlier = max(outliers, key=lambda g: len(crowds[g.role].processes))
    crowd = crowds[outlier.role]
    # The crowd is taken to be waiting, the outlier to be the story: not when the crowd waits in
    # the user's code and the outlier only in a library (three workers deadlocked in
    # __getitem__, one idle in its loop: naming the idle one would be confidently wrong).
    if waits_in_user_code(crowd.processes[0]) and not waits_in_user_code(outlier.processes[0]):
        return None
    return outlier, crowd


def culprits(
    processes: list[ProcessReport], root_pid: int, found: list[Hint] | None = None
) -> list[int]:
    """The pids the headline names: the odd one out, else the largest group of stuck
    processes, else the pytest process; the first hint's when it names none of those."""
    told = _told(found, processes, root_pid)
    if told is not None:
        return [p.pid for p in told]
    return _by_stacks(processes, root_pid)


def _by_stacks(processes: list[ProcessReport], root_pid: int) -> list[int]:
    """The pids the stacks alone name (see :func:`culprits`)."""
    odd = odd_one_out(processes, root_pid)
    if odd is not None:
        return odd[0].pids
    others = _stuck_children(processes, root_pid)
    if not others:
        return [root_pid]
    counted = Counter((role_of(p).general(), p.stuck_at) for p in others)
    top = counted.most_common(1)[0][0]
    return [p.pid for p in others if (role_of(p).general(), p.stuck_at) == top]


def cause(found: list[Hint], processes: list[ProcessReport], root_pid: int) -> str:
    """The headline's hint: the first hint about a process the headline names, else the first
    hint; empty when no known pattern matched (a guess would be worse than nothing)."""
    named = set(culprits(processes, root_pid, found))
    known = [h for h in found if h.rule != "none"]
    about = next((h for h in known if named & set(h.pids)), None)
    chosen = about or (known[0] if known else None)
    return chosen.text if chosen is not None else ""


#: Rules in order: facts first (stopped, dead), then the specific stories, then the graph's
#: general ones; a later general rule stays silent about processes an earlier hint explained.
RULES: tuple[Rule, ...] = (
    hint_stopped,
    hint_dead,
    hint_asyncio,
    hint_store_keys,
    hint_collectives,
    hint_rank_gone,
    hint_unpicklable_batch,
    hint_worker_lock,
    hint_queue_join,
    hint_manager,
    hint_pool_lost,
    hint_import_lock_at_fork,
    hint_leaked_slots,
    hint_full_pipe,
    hint_end_marker,
    hint_join_cycle,
    hint_no_answer,
    hint_poll_dead,
    hint_polling,
    hint_fifo,
    hint_pipe,
    hint_openmp_after_fork,
    hint_cuda_before_fork,
    hint_beside_idle_services,
    hint_output_held,
    hint_status_reaped,
    hint_sleeper,
    hint_outside,
)
#: Rules that speak after the deadlock rule, whatever was explained before them.
AFTER_GRAPH: tuple[Rule, ...] = (hint_still_starting,)
#: Rules whose facts are always worth saying, even about processes already explained.
_ALWAYS = ("stopped", "dead")


def _said(pids: set[int], pytest: set[int], explained: set[int]) -> bool:
    """Whether earlier hints explained these processes (the pytest process, which waits in most
    stories, counts only for a hint about it alone)."""
    others = pids - pytest
    return others <= explained if others else pids <= explained


def hints(processes: list[ProcessReport]) -> list[Hint]:
    """Every hint whose rule matches; a single 'no known pattern' hint when none does."""
    found: list[Hint] = []
    explained: set[int] = set()
    # the pytest process waits in most stories: naming it explains nothing
    pytest = {p.pid for p in processes if is_pytest(p)}
    for rule in RULES:
        for hint in rule(processes):
            if hint.rule in _ALWAYS or not _said(set(hint.pids), pytest, explained):
                found.append(hint)
                explained.update(hint.pids)
    found += hint_deadlock(processes, explained)
    for rule in AFTER_GRAPH:
        for hint in rule(processes):
            found.append(hint)
            explained.update(hint.pids)
    found += hint_busy(processes, explained - pytest)
    add_signal_enders(found, processes)
    if not found:
        found.append(_both_ends(processes))
    return found


def _both_ends(processes: list[ProcessReport]) -> Hint:
    """No rule matched: what is known of each stuck process's wait, both ends of it (never a
    guessed cause)."""
    stuck = [
        p
        for p in processes
        if p.stuck_at and not is_helper(p) and not p.exit_status and not groups.idle_service(p)
    ]
    waits: list[WaitFacts] = []
    named: set[int] = set()
    said: list[str] = []
    for proc in stuck:
        facts = wait_facts(proc, main_task(proc), processes)
        if facts is None or proc.pid in named:
            continue  # already stated as an end of an earlier process's wait
        waits.append(facts)
        named.update(e.pid for e in facts.ends)
        said.append(f"{proc.role} (pid {proc.pid}) {render(facts)}")
    said_text = " ".join(said)
    return Hint(
        "no known hang pattern matched."
        + (f" What is known: {said_text}" if said_text else "")
        + " The stacks below show where each process waits (innermost frame first).",
        rule="none",
        pids=[f.pid for f in waits],
        waits=waits,
    )

"""The rule engine: roles, the headline, and every rule run in order; a hint is a hint, never a
guess."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from ..report.model import Hint, ProcessReport
from .roles import HELPER_ROLES, is_helper, is_pytest, label_roles, role_of
from .rules.distributed import hint_collectives, hint_rank_gone
from .rules.loading import (
    hint_cuda_before_fork,
    hint_openmp_after_fork,
    hint_unpicklable_batch,
    hint_worker_lock,
)
from .rules.sharing import (
    hint_end_marker,
    hint_fifo,
    hint_full_pipe,
    hint_join_cycle,
    hint_leaked_slots,
    hint_manager,
    hint_pipe,
    hint_pool_lost,
    hint_queue_join,
)
from .rules.starting import hint_import_lock_at_fork, hint_still_starting
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

__all__ = ["HELPER_ROLES", "headline", "hints", "label_roles"]

Rule = Callable[[list[ProcessReport]], list[Hint]]


def headline(test_id: str, elapsed: float, processes: list[ProcessReport], root_pid: int) -> str:
    """``HANG after 8.0s in test_x: 3 processes, 2 stuck in DataLoader worker __getitem__``."""
    live = len([p for p in processes if not p.exit_status])
    head = f"HANG after {elapsed:.1f}s in {test_id}: {live} process{'es' if live != 1 else ''}"
    # helpers wait by design: they name the hang only when nothing else does
    others = [
        p
        for p in processes
        if p.pid != root_pid and p.stuck_at and not is_helper(p) and not p.exit_status
    ]
    if not others:
        root = next((p for p in processes if p.pid == root_pid), None)
        return head + (f", stuck in {root.stuck_at}" if root and root.stuck_at else "")
    groups = Counter((role_of(p).general(), p.stuck_at) for p in others)
    (kind, where), count = groups.most_common(1)[0]
    return f"{head}, {count} stuck in {kind} {where}"


#: Rules in order: facts first (stopped, dead), then the specific stories, then the graph's
#: general ones; a later general rule stays silent about processes an earlier hint explained.
RULES: tuple[Rule, ...] = (
    hint_stopped,
    hint_dead,
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
    hint_fifo,
    hint_pipe,
    hint_openmp_after_fork,
    hint_cuda_before_fork,
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
    if not found:
        found.append(
            Hint(
                "no known hang pattern matched; the stacks below show where each process waits "
                "(innermost frame first).",
                rule="none",
            )
        )
    return found

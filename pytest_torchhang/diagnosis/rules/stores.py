"""Rules for the store of torch.distributed ranks: a key waited for that nobody set, with the
keys that exist and the closest name."""

from __future__ import annotations

import difflib
import re

from ...report.model import Hint, ProcessReport, StoreWait, same_thread
from ..frames import (
    main_thread,
    pending_collective,
)
from ..graph import doing
from ..roles import is_rank, rank_no, role_of

# --- store keys -------------------------------------------------------------------------------

#: Keys a process group keeps in the store it was given (gloo's connection keys under the
#: group's number, ``0//cpu//0/1``): not the user's, so neither listed nor matched.
_GROUP_KEY = re.compile(r"^\d+/")
#: Keys named per store wait, and the closest names offered.
_MAX_KEYS_NAMED = 8


def _user_keys(keys: list[str]) -> tuple[list[str], int]:
    """The store's keys a user set, and how many the process groups keep there."""
    own = sorted(k for k in keys if not _GROUP_KEY.match(k))
    return own, len(keys) - len(own)


def _quoted(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:_MAX_KEYS_NAMED])
    return shown + (
        f" and {len(keys) - _MAX_KEYS_NAMED} more" if len(keys) > _MAX_KEYS_NAMED else ""
    )


def _main_store_wait(proc: ProcessReport) -> StoreWait | None:
    """The store wait of the process's main thread, else its first."""
    main = main_thread(proc)
    ident = main.ident if main is not None else ""
    for wait in proc.store_waits:
        if same_thread(wait.thread, ident):
            return wait
    return proc.store_waits[0] if proc.store_waits else None


def _where_rank(proc: ProcessReport, keys: list[str]) -> str:
    """``rank 0/2 is at collective #2 barrier``: where another rank is, in one phrase."""
    who = f"rank {rank_no(proc)}" if is_rank(proc) else f"pid {proc.pid}"
    if proc.exit_status:
        return f"{who} {proc.exit_status}"
    wait = _main_store_wait(proc)
    if wait is not None:
        same = wait.keys == keys
        return f"{who} waits in {wait.call()}" + (" too" if same else "")
    pending = pending_collective(proc)
    if pending is not None:
        return f"{who} is at collective {pending.label()}"
    return f"{who} {doing(proc)}"


def hint_store_keys(procs: list[ProcessReport]) -> list[Hint]:
    """Ranks that wait in ``store.get``/``store.wait`` for a key: the key, whether the store
    holds it (a FileStore's file is read), the closest name it holds, and where the other ranks
    are (their store waits, flight recorders and waits)."""
    waiting = [p for p in procs if not p.exit_status and _main_store_wait(p) is not None]
    if not waiting:
        return []
    if any(p.busy and p not in waiting for p in procs if is_rank(p) and not p.exit_status):
        return []  # a rank still computes: it may yet set the key (the busy rule says so)
    by_key: dict[tuple[tuple[str, ...], str], list[ProcessReport]] = {}
    for proc in waiting:
        wait = _main_store_wait(proc)
        assert wait is not None
        by_key.setdefault((tuple(wait.keys), wait.where()), []).append(proc)
    out = []
    for (_keys, _where), group in by_key.items():
        group.sort(key=lambda p: (role_of(p).rank is None, role_of(p).rank or 0, p.pid))
        wait = _main_store_wait(group[0])
        assert wait is not None
        out.append(_store_hint(procs, group, wait))
    return out


def _store_hint(
    procs: list[ProcessReport],
    group: list[ProcessReport],
    wait: StoreWait,
) -> Hint:
    names = " and ".join(f"rank {rank_no(p)}" if is_rank(p) else f"pid {p.pid}" for p in group)
    verb = "wait" if len(group) > 1 else "waits"
    head = f"{names} {verb} in {wait.call()} on {wait.where()}"
    missing = wait.missing()
    based = [
        f"{p.role} (pid {p.pid}): {w.call()} on {w.where()}, waiting for {w.waited_s:.1f}s"
        for p in group
        if (w := _main_store_wait(p)) is not None
    ]
    if wait.keys_set is None:
        text = (
            f"{head}; whether any process set {_quoted(wait.keys)} is not known "
            f"({wait.keys_note or 'the store was not read'})."
        )
    elif missing:
        user, own = _user_keys(wait.keys_set)
        held = f"keys set: {_quoted(user)}" if user else "no key of the user's is set"
        if own:
            held += f" (and {own} of the process groups' own)"
        close = sorted(
            {c for key in missing for c in difflib.get_close_matches(key, user, n=2, cutoff=0.6)}
        )
        closest = f"; the closest names set: {_quoted(close)}" if close else ""
        text = (
            f"{head}: no process set {_quoted(missing)}; {held}{closest}. A key is found only "
            "under the exact name it was set with: check the name on both sides (an off-by-one "
            "rank, a missing prefix) and that the process that should set it gets to its set()."
        )
        based.append(f"{wait.where()} holds: {_quoted(wait.keys_set)}")
    else:
        text = (
            f"{head}, and the store holds a key of that name: the wait may be under another "
            "prefix (a PrefixStore) or another store."
        )
    others = [p for p in procs if is_rank(p) and p not in group]
    if others:
        text += " Meanwhile " + "; ".join(_where_rank(p, wait.keys) for p in others) + "."
    based += [
        f"rank {rank_no(p)} (pid {p.pid}) flight recorder: "
        + ", ".join(
            f"{c.label()} {'completed' if c.completed else 'pending'}" for c in p.collectives[-3:]
        )
        for p in others
        if p.collectives
    ]
    return Hint(text, based, rule="store_key", pids=sorted(p.pid for p in group))

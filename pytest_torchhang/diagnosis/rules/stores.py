"""Rules for the store of torch.distributed ranks: a key waited for that nobody set, with the
keys that exist and the closest name."""

from __future__ import annotations

import ast
import difflib
import linecache
import os
import re
from dataclasses import dataclass

from ...report.model import FrameArgs, Hint, ProcessReport, StoreWait, same_thread
from ..frames import (
    innermost,
    is_library,
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
    unshared = key_from_unshared_value(wait.keys, group[0], others)
    if unshared is not None:
        text += " " + unshared.words()
        based.append(unshared.evidence())
    if others:
        text += " Meanwhile " + "; ".join(_where_rank(p, wait.keys) for p in others) + "."
    based += recorder_evidence(others)
    return Hint(text, based, rule="store_key", pids=sorted(p.pid for p in group))


# --- a key named from a value the ranks do not share --------------------------------------------

#: What splits a key into the values it was built from (``runs/<run_id>/vocab``).
_KEY_PARTS = re.compile(r"[/:]")
#: Parts shorter than this say nothing (``0``, ``a``): many values are that close.
_MIN_PART = 6
#: How alike a peer's value and a key's part must be to be the same value made twice.
_ALIKE = 0.6


@dataclass
class UnsharedValue:
    """A part of the key one rank waits for, and the local of another rank's own frame that
    holds a value of the same making but not the same value: each rank made it itself."""

    key: str
    part: str
    peer: ProcessReport
    frame: FrameArgs
    name: str  # the local's name

    def value(self) -> str:
        return self.frame.args[self.name]

    def words(self) -> str:
        place = f"{os.path.basename(self.frame.file)}:{self.frame.line}"
        return (
            f"The key is named from a value the ranks do not share: its part {self.part!r} "
            f"differs from rank {rank_no(self.peer)}'s `{self.name}`, {self.value()} (a local of "
            f"{self.frame.function} at {place}, read in that rank), so a key rank "
            f"{rank_no(self.peer)} sets from its own value is another key. A value that names "
            "a shared key must be made once (in the launcher) and passed to every rank, or "
            "broadcast from one rank."
        )

    def evidence(self) -> str:
        return (
            f"rank {rank_no(self.peer)} (pid {self.peer.pid}) {self.frame.function}: "
            f"{self.name} = {self.value()}; the key waited for: {self.key!r}"
        )


def _text_value(value: str) -> str | None:
    """The string a bounded repr holds (``'abc'`` -> ``abc``); None for any other value."""
    if len(value) < 2 or value[0] != value[-1] or value[0] not in "'\"":
        return None
    try:
        text = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return None
    return text if isinstance(text, str) else None


def _names_in_waiter(waiter: ProcessReport) -> set[str]:
    """The identifiers of the waiter's own function, from its ``def`` line down to the line it
    waits at (the key was made from some of them)."""
    frame = innermost(waiter, lambda f: not is_library(f))
    if frame is None:
        return set()
    lines = linecache.getlines(frame.filename)[: frame.lineno]
    names: set[str] = set()
    for line in reversed(lines):
        names.update(re.findall(r"[A-Za-z_]\w*", line))
        if line.lstrip().startswith(("def ", "async def ")):
            break
    return names


def key_from_unshared_value(
    keys: list[str], waiter: ProcessReport, peers: list[ProcessReport]
) -> UnsharedValue | None:
    """The first part of a waited key that a peer rank holds, in a local of its own frames, as
    a different value of the same making (same length, mostly the same characters: a timestamp
    with another random suffix, another host's name), where the waiter's own function names a
    variable of the same name (the key was made from it there); None when no peer's local is
    one."""
    made_from = _names_in_waiter(waiter)
    for key in keys:
        parts = [p for p in _KEY_PARTS.split(key) if len(p) >= _MIN_PART]
        for peer in peers:
            for frame in (f for f in peer.frame_args if not f.call):
                for name, raw in frame.args.items():
                    value = _text_value(raw)
                    if (
                        name not in made_from
                        or value is None
                        or len(value) < _MIN_PART
                        or value in key
                    ):
                        continue
                    for part in parts:
                        alike = difflib.SequenceMatcher(None, part, value).ratio()
                        if len(part) == len(value) and alike >= _ALIKE:
                            return UnsharedValue(key, part, peer, frame, name)
    return None


def recorder_evidence(ranks: list[ProcessReport]) -> list[str]:
    """Each rank's last three recorded collectives, as evidence lines."""
    return [
        f"rank {rank_no(p)} (pid {p.pid}) flight recorder: "
        + ", ".join(
            f"{c.label()} {'completed' if c.completed else 'pending'}" for c in p.collectives[-3:]
        )
        for p in ranks
        if p.collectives
    ]

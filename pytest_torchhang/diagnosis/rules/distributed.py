"""Rules for ranks of torch.distributed: collectives that do not match, ranks gone."""

from __future__ import annotations

import linecache
import os
import re

from ...report.model import Frame, Hint, ProcessReport
from ..frames import (
    RENDEZVOUS,
    collective_of,
    frame_collective,
    has_frame,
    in_backward,
    in_file,
    innermost,
    is_library,
    last_completed,
    pending_collective,
)
from ..graph import doing, main_task
from ..peers import PeerDifference, default_group, differences, lone_root
from ..roles import is_rank, rank_no, role_of, world_size
from .p2p import RECVS, SENDS, p2p_pair, unmatched_p2p
from .stores import recorder_evidence


def _fr_detail(ranks: list[ProcessReport]) -> str:
    """``rank 0/2 is in #12 all_reduce([1024]) (from DDP's backward); rank 1/2 completed #11 ...``."""
    parts = []
    for proc in ranks:
        pending, done = pending_collective(proc), last_completed(proc)
        if pending is None and done is None:
            continue
        words = [f"rank {rank_no(proc)}"]
        if done is not None:
            words.append(f"completed {done.label()}")
        if pending is not None:
            words.append(("and " if done is not None else "") + f"is in {pending.label()}")
            if in_backward(proc):
                words.append("(from DDP's backward)")
            elif has_frame(proc, "torch/nn/parallel/distributed.py", "forward", "_pre_forward"):
                words.append("(from DDP's forward)")
        parts.append(" ".join(words))
    return "; ".join(parts)


def _collective_words(name: str | None) -> str:
    return "backward (DDP's gradient all_reduce)" if name == "backward" else str(name)


def _evidence(ranks: list[ProcessReport], where: dict[str, str | None]) -> list[str]:
    """Where each rank waits, and the last entries of its flight recorder."""
    based = [
        f"{p.role} (pid {p.pid}) in "
        + (_collective_words(where[rank_no(p)]) if where[rank_no(p)] else p.stuck_at)
        for p in ranks
    ]
    based += recorder_evidence(ranks)
    return based


def hint_collectives(procs: list[ProcessReport]) -> list[Hint]:
    """Ranks that wait in a rendezvous nobody else reaches, in different collectives, all in
    recv, or for a rank that is in no collective."""
    # a process in a rendezvous is a rank, whatever started it (a plain Process, a Popen)
    ranks = [
        p for p in procs if (is_rank(p) or frame_collective(p) in RENDEZVOUS) and not p.exit_status
    ]
    if not ranks:
        return []
    where = {rank_no(p): collective_of(p) for p in ranks}
    waiting = {r: c for r, c in where.items() if c and c not in RENDEZVOUS}
    rendezvous = {r: c for r, c in where.items() if c in RENDEZVOUS}
    based = _evidence(ranks, where)
    detail = _fr_detail(ranks)
    detail = f" Flight recorder: {detail}." if detail else ""
    pids = sorted({p.pid for p in ranks})
    if rendezvous and not waiting:
        text = (
            f"{len(rendezvous)} rank(s) wait in the process-group rendezvous "
            f"({', '.join(sorted({c for c in rendezvous.values() if c}))}) and {len(ranks)} rank(s) "
            "were started: the other ranks of the world never arrived (world_size larger than "
            "the ranks launched, a rank that crashed before init, or another store/MASTER_ADDR/"
            "port). Start exactly world_size ranks on one rendezvous."
        )
    elif p2p_pair(waiting):
        text = unmatched_p2p(ranks, waiting)
    elif _same_call(ranks):
        text = _same_call(ranks) + detail
    elif len(set(waiting.values())) > 1:
        pairs = ", ".join(f"rank {r} in {_collective_words(c)}" for r, c in sorted(waiting.items()))
        skipped = _skipped(ranks)
        text = (
            f"ranks wait in different collectives ({pairs}): "
            + (
                f"{skipped} Every rank must call the same collectives in the same order."
                if skipped
                else "every rank must call the same collectives in the same order; look for a "
                "rank-dependent branch before them (uneven inputs, a layer used on one rank "
                "only, an early exit)."
            )
            + detail
        )
    elif waiting and len(waiting) == len(ranks) and set(waiting.values()) <= {"recv", "irecv"}:
        text = (
            f"all {len(ranks)} ranks wait in recv and none sends: every recv needs a matching "
            "send on its source rank (look for a rank-dependent branch that swapped a send "
            "for a recv, or the wrong src/dst)." + detail
        )
    elif len(waiting) == len(ranks) and len(set(waiting.values())) == 1 and differences(ranks):
        text = (
            f"all {len(ranks)} ranks wait in {_collective_words(next(iter(waiting.values())))}, "
            "the same collective with different arguments: every rank must pass the same root "
            "(src/dst), group and tensor sizes." + detail
        )
    elif _whole_world(ranks) and all(_making_group(p) for p in ranks):
        text = _group_made_by_all(ranks) + detail
    elif waiting and len(waiting) < len(ranks):
        if all(p.busy for p in ranks if not where[rank_no(p)]):
            return []  # the others compute, on their way to it or in a loop: the busy rule says
        text = _missing_rank(procs, ranks, where, based) + detail
    else:
        return []
    return [with_peer_difference(Hint(text, based, rule="collectives", pids=pids), ranks)]


def _with_lone_root(hint: Hint, by_pid: dict[int, ProcessReport]) -> None:
    """Say so when a rank waits as the root of a reduce/gather the others already completed."""
    alone = lone_root(list(by_pid.values()))
    if alone is None:
        return
    others = ", ".join(f"rank {rank_no(by_pid[pid])}" for pid in alone.others)
    hint.text = hint.text.rstrip() + (
        f" Rank {rank_no(by_pid[alone.pid])} waits in {alone.function}(dst={alone.dst}) as its "
        f"root, for the other ranks' contributions, but {others} already completed that "
        f"#{alone.seq} {alone.function}: they sent to another root (a different dst)."
    )
    done = ", ".join(f"pid {pid}" for pid in alone.others)
    hint.based_on = [
        *hint.based_on,
        f"pid {alone.pid} in {alone.function}(dst={alone.dst}); #{alone.seq} completed on {done}",
    ]


def with_peer_difference(hint: Hint, ranks: list[ProcessReport]) -> Hint:
    """The hint with a sentence saying how the arguments of ranks stuck in the same call differ
    (``reduce(dst=0) on rank 0/2 vs reduce(dst=1) on rank 1/2``), read from the values each
    rank's own frames held at the capture, and one for a root of a reduce/gather left alone by
    ranks that completed it; the hint as it was when neither holds."""
    by_pid = {p.pid: p for p in ranks}
    _with_lone_root(hint, by_pid)
    found = differences(ranks)
    if not found:
        return hint
    parts = []
    for diff in found:
        sides = []
        for pid, value in sorted(diff.values.items(), key=lambda kv: rank_no(by_pid[kv[0]])):
            if diff.name == "input sizes":
                shown = f"{diff.function} of input sizes {value}"
            else:
                default = " (the default group)" if diff.name == "group" and value == "None" else ""
                shown = f"{diff.function}({diff.name}={value}){default}"
            sides.append(f"{shown} on rank {rank_no(by_pid[pid])}")
        parts.append(" vs ".join(sides))
    hint.text = hint.text.rstrip() + f" The arguments differ: {'; '.join(parts)}."
    hint.text += _groups_apart(found)
    hint.based_on = hint.based_on + [
        f"{d.function} {d.name}: "
        + ", ".join(f"pid {pid} {value}" for pid, value in d.values.items())
        for d in found
    ]
    return hint


def _groups_apart(found: list[PeerDifference]) -> str:
    """`` Each rank waits on a different process group ...``: the ranks are in one collective
    on different groups, none of them the default one (each group counts its collectives by
    itself, so each rank waits for the others to enter its group's call); empty otherwise."""
    groups = next((d for d in found if d.name == "group"), None)
    if groups is None or any(default_group("group", v) for v in groups.values.values()):
        return ""
    if len(set(groups.values.values())) != len(groups.values):
        return ""
    members = [re.search(r"ranks=\[([\d, ]*)\]", v) for v in groups.values.values()]
    if not all(m and len(m.group(1).split(",")) > 1 for m in members):
        return ""  # a group of one completes alone: not a wait for the others
    return (
        f" Each rank waits in {groups.function} on a different process group, and a "
        "collective completes only when every member of its group enters it on that same "
        "group: each waits for the others to reach its group's call. The ranks call "
        "collectives on their groups in a different order (or one skips a group's call): "
        "make every rank issue them on the groups in one order."
    )


def _user_frame(proc: ProcessReport) -> Frame | None:
    """The innermost frame of the user's code in the main thread: where it called torch."""
    return innermost(proc, lambda f: not is_library(f))


_BLOCK = re.compile(r"^(\s*)(if|elif|else|for|while|with|try|except|finally|def|async def)\b")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _header(lines: list[str], lineno: int) -> int:
    """The line (1-based) of the block header that holds line ``lineno``, 0 at module level.

    By indentation, never ``ast``: see ``frames.enclosing_class``."""
    indent = _indent(lines[lineno - 1])
    for k in range(lineno - 1, 0, -1):
        line = lines[k - 1]
        if line.strip() and not line.lstrip().startswith("#") and _indent(line) < indent:
            if _BLOCK.match(line):
                return k
            indent = _indent(line)
    return 0


def _block_end(lines: list[str], header: int) -> int:
    """The last line of the ``if`` chain (its ``elif``/``else`` included) that starts at
    ``header``."""
    indent = _indent(lines[header - 1])
    end = header
    for k in range(header + 1, len(lines) + 1):
        line = lines[k - 1]
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if _indent(line) > indent or (
            _indent(line) == indent and re.match(r"\s*(elif|else)\b", line)
        ):
            end = k
            continue
        break
    return end


def _skip_condition(filename: str, called: int, passed: int) -> str:
    """The ``if`` that holds line ``called`` (a collective one rank waits in) and that line
    ``passed`` (where a rank of the same function is, further on) is after, quoted; "" when
    ``passed`` is in a branch of the same ``if`` (the ranks took different branches), inside
    it, or in another block."""
    lines = linecache.getlines(filename)
    if not (0 < called < passed <= len(lines)):
        return ""
    header = _header(lines, called)
    while header and not re.match(r"\s*(if|elif|else)\b", lines[header - 1]):
        if re.match(r"\s*(async def|def)\b", lines[header - 1]):
            return ""  # the call is no branch's: nothing says it was skipped
        header = _header(lines, header)
    if not header:
        return ""
    start = header
    while re.match(r"\s*(elif|else)\b", lines[start - 1]) and start > 1:
        start = _header_before(lines, start)
    end = _block_end(lines, start)
    if passed <= end or _indent(lines[passed - 1]) > _indent(lines[start - 1]):
        return ""
    return lines[header - 1].strip()


def _header_before(lines: list[str], elif_line: int) -> int:
    """The ``if``/``elif`` line an ``elif``/``else`` at ``elif_line`` continues."""
    indent = _indent(lines[elif_line - 1])
    for k in range(elif_line - 1, 0, -1):
        line = lines[k - 1]
        if line.strip() and _indent(line) == indent and re.match(r"\s*(if|elif)\b", line):
            return k
    return 1


#: Collectives with a root: the rank that sends (src) or receives (dst) the result.
_ROOTED = {"broadcast": "src", "reduce": "dst", "gather": "dst", "scatter": "src"}


def _differ_in(name: str) -> str:
    root = _ROOTED.get(name)
    unrecorded = f"the root ({root}), the group" if root else "the group"
    return (
        f"the flight recorder records the name, the number and the sizes, not {unrecorded}: "
        "compare those arguments rank by rank"
    )


def _same_call(ranks: list[ProcessReport]) -> str:
    """The ranks are in the same collective (the same number and name in each flight recorder)
    and it completed on some ranks only, or on none while every rank waits in it: their calls
    agree on what the flight recorder shows and differ in an argument it does not record. ""
    when the evidence does not show that (issue 28: same call, different arguments, is not a
    skipped collective)."""
    pending = {p.pid: pending_collective(p) for p in ranks}
    if len(ranks) < 2 or any(c is None for c in pending.values()):
        return ""
    for waiter in ranks:
        mine = pending[waiter.pid]
        assert mine is not None
        done = [
            o
            for o in ranks
            if o is not waiter
            and any(
                c.completed and (c.seq, c.name, c.group) == (mine.seq, mine.name, mine.group)
                for c in o.collectives
            )
        ]
        if done:
            ahead = pending[done[0].pid]
            assert ahead is not None
            return (
                f"rank {rank_no(waiter)} is still in {mine.label()}, the same collective that "
                f"rank {', '.join(rank_no(o) for o in done)} completed and left (it is now in "
                f"{ahead.label()}): the ranks called the same collective with different "
                f"arguments, and it completed on one side only; {_differ_in(mine.name)}."
            )
    keys = {(c.seq, c.name, tuple(map(tuple, c.sizes))) for c in pending.values() if c}
    if len(keys) == 1 and len(ranks) == (world_size(ranks[0]) or len(ranks)):
        ((seq, name, _),) = keys
        if name in SENDS | RECVS:
            return ""
        return (
            f"every rank waits in the same collective, #{seq} {name}, with the same sizes, and it "
            f"completed on none: the ranks agree on what the flight recorder shows, so their "
            f"calls differ in an argument it does not record; {_differ_in(name)}."
        )
    return ""


def _skipped(ranks: list[ProcessReport]) -> str:
    """``rank 1/2 went past the all_reduce at test_x.py:12 (under `if rank == 0:`) that rank
    0/2 waits in as #2, and is at #2 barrier at line 14.``: ranks at the same collective number
    in one function, one further on than a collective under a condition it did not take (its
    flight recorder counts as many collectives as the other's: the call was skipped, not
    reordered). "" when the evidence does not show that."""
    pending = {p.pid: pending_collective(p) for p in ranks}
    frames = {p.pid: _user_frame(p) for p in ranks}
    said = []
    for waiter in ranks:
        for other in ranks:
            mine, theirs = pending[waiter.pid], pending[other.pid]
            here, there = frames[waiter.pid], frames[other.pid]
            if mine is None or theirs is None or here is None or there is None:
                continue
            if mine.seq != theirs.seq or mine.name == theirs.name or mine.group != theirs.group:
                continue
            if (here.filename, here.name) != (there.filename, there.name):
                continue
            condition = _skip_condition(here.filename, here.lineno, there.lineno)
            if condition:
                said.append(
                    f"rank {rank_no(other)} went past the {mine.name} at "
                    f"{os.path.basename(here.filename)}:{here.lineno} (under `{condition}`) that "
                    f"rank {rank_no(waiter)} waits in as #{mine.seq}, and is at "
                    f"#{theirs.seq} {theirs.name} at line {there.lineno}: it skipped that "
                    f"{mine.name}."
                )
    return " ".join(said)


def _missing_rank(
    procs: list[ProcessReport],
    ranks: list[ProcessReport],
    where: dict[str, str | None],
    based: list[str],
) -> str:
    """Ranks wait in a collective for a rank in none; a cycle when that rank waits for them.
    Adds the waits of the cycle to ``based``."""
    by_pid = {p.pid: p for p in procs}
    missing, cycles = [], []
    for proc in ranks:
        if where[rank_no(proc)]:
            continue
        missing.append(f"rank {rank_no(proc)} at {proc.stuck_at}{_waits_on_helper(proc, by_pid)}")
        task = main_task(proc)
        if task is None:
            continue
        for edge in task.waits_for:
            other = by_pid.get(edge.pid)
            if other is not None and other in ranks and where[rank_no(other)]:
                cycles.append(
                    f"rank {rank_no(proc)} {doing(proc)} for rank {rank_no(other)} "
                    f"({edge.via}), which waits in {_collective_words(collective_of(other))} "
                    f"for rank {rank_no(proc)}: a cycle"
                )
                based.append(f"rank {rank_no(proc)} (pid {proc.pid}) blocked in {task.summary()}")
                break
    waiting = [c for c in where.values() if c and c not in RENDEZVOUS]
    making = [p for p in ranks if not where[rank_no(p)] and _making_group(p)]
    if making and len(making) + len(waiting) == len(ranks):
        return _group_made_by_some(making, ranks, where) + (
            f" {'; '.join(cycles)}." if cycles else ""
        )
    return (
        f"{len(waiting)} rank(s) wait in {_collective_words(waiting[0])} for a rank that is not "
        f"in a collective ({', '.join(missing)}): that rank skipped the call or is stuck before it."
        + (f" {'; '.join(cycles)}." if cycles else "")
    )


#: torch.distributed calls that create a process group: every rank of the default group must
#: enter each of them, in the same order, members of the new group or not.
GROUP_MAKERS = frozenset(["new_group", "new_subgroups", "new_subgroups_by_enumeration"])


def _making_group(proc: ProcessReport) -> str | None:
    """The group-creating call of torch.distributed the rank's main thread is in."""
    frame = innermost(
        proc,
        lambda f: in_file(f, "torch/distributed/distributed_c10d.py") and f.name in GROUP_MAKERS,
    )
    return frame.name if frame else None


def _group_made_by_some(
    making: list[ProcessReport], ranks: list[ProcessReport], where: dict[str, str | None]
) -> str:
    """Some ranks create a process group while the others are already in a collective: they
    did not enter the same group creation (one created a group the others did not)."""
    in_group = ", ".join(
        f"rank {rank_no(p)} in {_making_group(p)}() at {_user_line(p)}" for p in making
    )
    elsewhere = ", ".join(
        f"rank {rank_no(p)} in {_collective_words(where[rank_no(p)])}"
        for p in ranks
        if where[rank_no(p)]
    )
    return (
        f"ranks are in different calls: {in_group} waits for the other ranks to create the "
        f"same process group, while {elsewhere} is not in it. new_group() must be called "
        "by every rank of the default group, in the same order, even by ranks that are not "
        "members of the new group: ranks match groups by how many each created before. Look "
        "for a new_group() called on some ranks only (inside a rank-dependent branch) or in a "
        "different order on each rank."
    )


def _whole_world(ranks: list[ProcessReport]) -> bool:
    """Every rank of the world is in the report (none missing that could be the one awaited)."""
    sizes = {world_size(p) for p in ranks}
    return len(ranks) > 1 and len(sizes) == 1 and sizes == {len(ranks)}


def _group_made_by_all(ranks: list[ProcessReport]) -> str:
    """Every rank waits in a group-creating call that does not complete: the ranks do not
    agree on which group it is; the groups each rank ran collectives on, as the flight
    recorders say."""
    calls = ", ".join(f"rank {rank_no(p)} at {_user_line(p)}" for p in ranks)
    used = {rank_no(p): sorted({c.group for c in p.collectives if c.group}) for p in ranks}
    differ = ""
    if len({tuple(g) for g in used.values()}) > 1:
        differ = (
            " Their flight recorders differ in the groups they ran collectives on: "
            + "; ".join(
                f"rank {r} on {len(g)} group{'s' if len(g) != 1 else ''} ({', '.join(g)})"
                for r, g in used.items()
            )
            + "."
        )
    return (
        f"every rank waits in {_making_group(ranks[0])}() ({calls}), and the group is never "
        "made: a sign that the ranks do not agree on which group it is. new_group() must be "
        "called by every rank of the default group, in the same order, even by ranks that are "
        f"not members of the new group: ranks match groups by how many each created before.{differ}"
        " Look for a new_group() called on some ranks only (inside a rank-dependent branch) or "
        "in a different order on each rank."
    )


def _user_line(proc: ProcessReport) -> str:
    """``x.py:46``: the user's frame the rank waits from."""
    frame = _user_frame(proc)
    return f"{os.path.basename(frame.filename)}:{frame.lineno}" if frame else "its frame"


def _waits_on_helper(proc: ProcessReport, by_pid: dict[int, ProcessReport]) -> str:
    """``: waits in DataLoader's _try_get_data at x.py:9, for rank 1's DataLoader worker 0/1
    (pid 7), which sleeps at x.py:3``: where a rank that is in no collective waits, when the
    wait-for graph says it waits for a child of its own (its DataLoader worker, a helper)."""
    # the kernel's main thread (its tid is the pid), whatever Python thread it was matched to
    task = next((t for t in proc.tasks if t.tid == proc.pid), None)
    if task is None:
        return ""
    children = [
        by_pid[e.pid] for e in task.waits_for if e.pid in by_pid and by_pid[e.pid].ppid == proc.pid
    ]
    if not children:
        return ""
    child = children[0]
    return f": {doing(proc)}, for {child.role} (pid {child.pid}), which {doing(child)}"


def hint_rank_gone(procs: list[ProcessReport]) -> list[Hint]:
    """Ranks wait in a collective while ranks of their world are no longer running."""
    ranks = [p for p in procs if is_rank(p)]
    sizes = {world_size(p) for p in ranks} - {None}
    if not ranks or len(sizes) != 1:
        return []
    size = sizes.pop()
    assert size is not None
    present = {role_of(p).rank for p in ranks}
    missing = sorted(set(range(size)) - present)
    waiting = [p for p in ranks if collective_of(p)]
    if not missing or not waiting:
        return []
    where = ", ".join(f"rank {rank_no(p)} waits in {collective_of(p)}" for p in waiting)
    return [
        Hint(
            f"rank(s) {', '.join(map(str, missing))} of {size} are no longer running (they "
            f"returned, exited or crashed) while {where}: a rank that leaves early, or dies, "
            "leaves its peers waiting; look at how that rank ended (its exception or exit code, "
            "or an OOM kill).",
            [f"{p.role} (pid {p.pid}) in {collective_of(p)}" for p in waiting],
            rule="rank_gone",
            pids=sorted({p.pid for p in waiting}),
        )
    ]

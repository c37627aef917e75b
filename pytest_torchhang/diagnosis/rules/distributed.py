"""Rules for ranks of torch.distributed: collectives or send/recv that do not match, ranks gone."""

from __future__ import annotations

import re

from ...report.model import Hint, ProcessReport
from ..frames import (
    RENDEZVOUS,
    collective_of,
    frame_collective,
    has_frame,
    in_backward,
    in_file,
    last_completed,
    main_thread,
    pending_collective,
)
from ..graph import doing, main_task
from ..roles import is_rank, rank_no, role_of, world_size


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
    based += [
        f"rank {rank_no(p)} (pid {p.pid}) flight recorder: "
        + ", ".join(
            f"{c.label()} {'completed' if c.completed else 'pending'}" for c in p.collectives[-3:]
        )
        for p in ranks
        if p.collectives
    ]
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
    elif _p2p_pair(waiting):
        text = _unmatched_p2p(ranks, waiting)
    elif len(set(waiting.values())) > 1:
        pairs = ", ".join(f"rank {r} in {_collective_words(c)}" for r, c in sorted(waiting.items()))
        text = (
            f"ranks wait in different collectives ({pairs}): every rank must call the same "
            "collectives in the same order; look for a rank-dependent branch before them (uneven "
            "inputs, a layer used on one rank only, an early exit)." + detail
        )
    elif waiting and len(waiting) == len(ranks) and set(waiting.values()) <= {"recv", "irecv"}:
        text = (
            f"all {len(ranks)} ranks wait in recv and none sends: every recv needs a matching "
            "send on its source rank (look for a rank-dependent branch that swapped a send "
            "for a recv, or the wrong src/dst)." + detail
        )
    elif waiting and len(waiting) < len(ranks):
        if all(p.busy for p in ranks if not where[rank_no(p)]):
            return []  # the others compute, on their way to it or in a loop: the busy rule says
        text = _missing_rank(procs, ranks, where, based) + detail
    else:
        return []
    return [Hint(text, based, rule="collectives", pids=pids)]


#: Point-to-point calls: they pair a sender with one receiver, unlike collectives.
_SENDS = frozenset(["send", "isend"])
_RECVS = frozenset(["recv", "irecv"])


def _p2p_pair(waiting: dict[str, str]) -> bool:
    """Every waiting rank is in a send or a recv, and both kinds are there."""
    calls = set(waiting.values())
    return (
        bool(calls) and calls <= _SENDS | _RECVS and bool(calls & _SENDS) and bool(calls & _RECVS)
    )


_KEYWORD = re.compile(r"\b(dst|src|tag|group_dst|group_src)\s*=\s*([^,()]+|\w+\([^()]*\))")


def p2p_arguments(proc: ProcessReport, call: str) -> str:
    """``dst=1, tag=1``: the peer and tag arguments of the user's ``send``/``recv`` call, read
    from the source line that calls it (gloo's flight recorder keeps no point-to-point entries;
    the frames' locals are not captured). Empty where the line names none."""
    main = main_thread(proc)
    frames = main.frames if main else []
    inner = next(
        (
            k
            for k, f in enumerate(frames)
            if in_file(f, "torch/distributed/distributed_c10d.py", call)
        ),
        None,
    )
    if inner is None:
        return ""
    caller = next(
        (
            f
            for f in frames[inner + 1 :]
            if "torch/distributed/" not in f.filename.replace("\\", "/")
        ),
        None,
    )
    if caller is None or f"{call}(" not in caller.line:
        return ""
    args = caller.line.split(f"{call}(", 1)[1]
    found = {key: value.strip() for key, value in _KEYWORD.findall(args)}
    if not any(key in found for key in ("dst", "src", "group_dst", "group_src")):
        positional = [a.strip() for a in args.split(")", 1)[0].split(",")]
        if len(positional) > 1 and "=" not in positional[1]:  # send(tensor, dst), recv(tensor, src)
            found = {("dst" if call in _SENDS else "src"): positional[1], **found}
    return ", ".join(f"{key}={value}" for key, value in found.items())


def _unmatched_p2p(ranks: list[ProcessReport], waiting: dict[str, str]) -> str:
    """Ranks in send and in recv that do not pair up."""
    sides = []
    for proc in ranks:
        call = waiting.get(rank_no(proc))
        if call is None:
            continue
        args = p2p_arguments(proc, call)
        sides.append(f"rank {rank_no(proc)} in {call}" + (f" ({args})" if args else ""))
    return (
        f"the point-to-point send and recv do not match ({', '.join(sides)}): a send completes "
        "only once its dst rank posts a recv from that src with the same tag (and a tensor of "
        "the same size), so each waits for a partner that never comes. These are not collectives: "
        "check each pair's dst/src ranks, tags and tensor sizes, and that a rank-dependent "
        "branch did not skip or reorder one side."
    )


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
        missing.append(f"rank {rank_no(proc)} at {proc.stuck_at}")
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
    return (
        f"{len(waiting)} rank(s) wait in {_collective_words(waiting[0])} for a rank that is not "
        f"in a collective ({', '.join(missing)}): that rank skipped the call or is stuck before it."
        + (f" {'; '.join(cycles)}." if cycles else "")
    )


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

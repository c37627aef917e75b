"""Point-to-point calls of torch.distributed (send, recv): the peer and tag arguments of each
rank's call, and the words for a send and a recv that do not pair up."""

from __future__ import annotations

import re

from ...report.model import ProcessReport
from ..frames import (
    in_file,
    main_thread,
)
from ..peers import stuck_call
from ..roles import rank_no

#: Point-to-point calls: they pair a sender with one receiver, unlike collectives.
SENDS = frozenset(["send", "isend"])
RECVS = frozenset(["recv", "irecv"])


def p2p_pair(waiting: dict[str, str]) -> bool:
    """Every waiting rank is in a send or a recv, and both kinds are there."""
    calls = set(waiting.values())
    return bool(calls) and calls <= SENDS | RECVS and bool(calls & SENDS) and bool(calls & RECVS)


_KEYWORD = re.compile(r"\b(dst|src|tag|group_dst|group_src)\s*=\s*([^,()]+|\w+\([^()]*\))")


def p2p_arguments(proc: ProcessReport, call: str) -> str:
    """``dst=1, tag=1``: the peer and tag arguments of the user's ``send``/``recv`` call, read
    from the source line that calls it (gloo's flight recorder keeps no point-to-point entries;
    the frames' locals are not captured). Empty where the line names none."""
    captured = _captured_p2p(proc, call)
    if captured:
        return captured
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
            found = {("dst" if call in SENDS else "src"): positional[1], **found}
    return ", ".join(f"{key}={value}" for key, value in found.items())


def _captured_p2p(proc: ProcessReport, call: str) -> str:
    """``dst=1, tag=3``: the peer and tag values the rank's own ``send``/``recv`` frame held at
    the capture (its listener read them); empty where they were not captured."""
    frame = stuck_call(proc)
    if frame is None or frame.function != call:
        return ""
    peer = ("dst", "group_dst") if call in SENDS else ("src", "group_src")
    names = [next((n for n in peer if frame.args.get(n, "None") != "None"), ""), "tag"]
    return ", ".join(f"{n}={frame.args[n]}" for n in names if n in frame.args)


def unmatched_p2p(ranks: list[ProcessReport], waiting: dict[str, str]) -> str:
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

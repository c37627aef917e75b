"""Peers stuck in the same call, compared argument by argument: what differs between them."""

from __future__ import annotations

from dataclasses import dataclass

from ..report.model import FrameArgs, ProcessReport
from .frames import pending_collective

#: Arguments that a rank passes only as a collective's root, that hold its own data or name
#: itself: they differ between correct peers, so a difference there says nothing.
PER_RANK_ARGUMENTS = frozenset(
    [
        "gather_list",
        "scatter_list",
        "object_gather_list",
        "scatter_object_input_list",
        "scatter_object_output_list",
        "object_list",
        "obj",  # all_gather_object, gather_object: each rank's own object
        "output_split_sizes",  # all_to_all_single: uneven splits are each rank's own
        "input_split_sizes",
        "output_tensor_list",  # all_to_all: per-rank shapes
        "input_tensor_list",
        "rank",  # init_process_group, a rendezvous: each rank names itself
        "group_rank",
        "global_rank",
        "local_rank",
    ]
)
#: Point-to-point calls pair a sender with a receiver: their peers' arguments differ by design.
POINT_TO_POINT = frozenset(["send", "recv", "isend", "irecv", "batch_isend_irecv"])


#: torch sets these from the global-rank argument inside the call (``group_dst`` from ``dst``):
#: the frame holds both, and the second says the first again.
ECHOES = {"group_dst": "dst", "group_src": "src"}


@dataclass
class PeerDifference:
    """One argument of a call several processes are stuck in, with values that differ."""

    function: str  # the call: "reduce", "all_reduce", "barrier"
    name: str  # the argument ("dst"), or "input sizes" (the flight recorder's)
    values: dict[int, str]  # pid -> the value as the process wrote it (bounded text)


def default_group(name: str, value: str) -> bool:
    """The value names the default process group: ``group=None``, or the group itself."""
    return name == "group" and (value == "None" or value.startswith("ProcessGroup(default"))


def _meaning(name: str, value: str) -> str:
    """What a value means to the call: None and the default group itself are one group."""
    return "default group" if default_group(name, value) else value


def stuck_call(proc: ProcessReport) -> FrameArgs | None:
    """The ``torch.distributed`` call the process is stuck in, with its arguments (the main
    thread's when several threads are in one: the process lists it first)."""
    return next((f for f in proc.frame_args if f.call), None)


def _same_call(procs: list[ProcessReport]) -> tuple[str, list[tuple[ProcessReport, FrameArgs]]]:
    """The largest set (two or more) of processes stuck in one function of one file."""
    groups: dict[tuple[str, str], list[tuple[ProcessReport, FrameArgs]]] = {}
    for proc in procs:
        call = stuck_call(proc)
        if call is not None:
            groups.setdefault((call.file, call.function), []).append((proc, call))
    best = max(groups.items(), key=lambda kv: len(kv[1]), default=None)
    if best is None or len(best[1]) < 2:
        return "", []
    return best[0][1], best[1]


def differences(procs: list[ProcessReport]) -> list[PeerDifference]:
    """The arguments whose values differ between processes stuck in the same call, in the call's
    order, then the flight recorder's input sizes of their pending collective when those differ
    (same name and sequence number, different shapes). Empty when nothing differs."""
    function, peers = _same_call(procs)
    out: list[PeerDifference] = []
    if function in POINT_TO_POINT:
        return out
    names = dict.fromkeys(
        name for _, call in peers for name in call.args if name not in PER_RANK_ARGUMENTS
    )
    for name in names:
        values = {proc.pid: call.args[name] for proc, call in peers if name in call.args}
        if len(values) == len(peers) and len({_meaning(name, v) for v in values.values()}) > 1:
            out.append(PeerDifference(function, name, values))
    said = {d.name for d in out}
    out = [d for d in out if ECHOES.get(d.name) not in said]
    pending = {p.pid: pending_collective(p) for p, _ in peers}
    known = {pid: c for pid, c in pending.items() if c is not None}
    if len(known) > 1 and len({(c.name, c.seq) for c in known.values()}) == 1:
        sizes = {pid: str(c.sizes) for pid, c in known.items()}
        if len(set(sizes.values())) > 1:
            (collective,) = {c.name for c in known.values()}
            out.append(PeerDifference(collective, "input sizes", sizes))
    return out


#: Collectives whose root (``dst``) receives a contribution from every other rank of the group.
GATHERING = frozenset(["reduce", "gather", "gather_object"])


@dataclass
class LoneRoot:
    """A rank that waits as the root of a gathering collective that every other rank of its
    world already completed: their contributions went elsewhere (they named another root)."""

    pid: int
    function: str  # "reduce"
    dst: str  # the root it named (its own rank)
    seq: int  # the flight recorder's sequence number of that collective
    others: list[int]  # the pids of the ranks that completed it


def lone_root(procs: list[ProcessReport]) -> LoneRoot | None:
    """The rank stuck in ``reduce``/``gather`` with ``dst`` its own rank while each other rank
    of the world completed the same flight-recorder entry (same name, number and group); None
    when any rank is missing from the report, or unknown, or the entries do not say so."""
    ranks = {p.role_data().rank: p for p in procs if p.role_data().kind == "rank"}
    for proc in ranks.values():
        role = proc.role_data()
        call, pending = stuck_call(proc), pending_collective(proc)
        if call is None or pending is None or call.function not in GATHERING:
            continue
        if call.args.get("dst") != str(role.rank) or pending.name != call.function:
            continue
        if role.world is None or set(ranks) != set(range(role.world)):
            return None  # a rank of the world is not in the report: it may be the one missing
        others = [p for r, p in ranks.items() if r != role.rank]
        key = (pending.name, pending.seq, pending.group)
        if all(
            any((c.name, c.seq, c.group) == key and c.completed for c in p.collectives)
            for p in others
        ):
            return LoneRoot(
                proc.pid, call.function, call.args["dst"], pending.seq, [p.pid for p in others]
            )
    return None

"""Pictures of one hang: its wait-for graph as Mermaid or Graphviz, and the Markdown CI section.

One model, several views: every function here reads a :class:`HangReport` (live, or rebuilt
from its JSON) and renders it; the text view is ``report/text.py``'s ``to_text``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from .groups import HELPERS
from .model import HangReport, ProcessReport, TaskWait, WaitEdge
from .text import to_text

#: Identical processes (same role but for its number, parent, stuck frame and waits) are drawn
#: as one box from this many on: `DataLoader worker 0-7/8`.
GROUP_AT = 3
#: Boxes drawn at most; the rest is one "N more processes" box.
MAX_NODES = 24
#: Pids named in a group's box.
MAX_PIDS = 4
#: The folded text report in the Markdown section (GitHub takes 1 MiB of summary per step).
MAX_SUMMARY_TEXT = 60_000
#: A summary file this large gets headlines only: GitHub refuses a step's summary over 1 MiB.
SUMMARY_FULL_BYTES = 900_000

NOBODY = "nobody"
OUTSIDE = "outside"
MORE = "more"

#: (class, Mermaid classDef style, Graphviz attributes): how the eye finds the cause.
STYLES = {
    "inCycle": (
        "fill:#ffcdd2,stroke:#b71c1c,stroke-width:3px",
        'fillcolor="#ffcdd2", color="#b71c1c", penwidth=3',
    ),
    "chainEnd": (
        "fill:#ffe0b2,stroke:#e65100,stroke-width:3px",
        'fillcolor="#ffe0b2", color="#e65100", penwidth=3',
    ),
    "busy": ("fill:#fff9c4,stroke:#f57f17", 'fillcolor="#fff9c4", color="#f57f17"'),
    "gone": (
        "fill:#eeeeee,stroke:#616161,stroke-dasharray:4 3",
        'fillcolor="#eeeeee", color="#616161", style="rounded,filled,dashed"',
    ),
    "helper": (
        "fill:#f5f5f5,stroke:#9e9e9e,color:#616161",
        'fillcolor="#f5f5f5", color="#9e9e9e", fontcolor="#616161"',
    ),
}
_HELPERS = HELPERS


@dataclass
class Node:
    """One box: a process, a group of identical processes, or a place outside the tree."""

    key: str  # the id in Mermaid and Graphviz: p<pid>, g<n>, nobody, outside, more
    role: str
    pids: list[int] = field(default_factory=list)
    where: str = ""  # "in __getitem__", "busy in spin", "exited with code 1"
    classes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        """The box's label, line by line: role, pid(s), where it is stuck."""
        if len(self.pids) == 1:
            pids = [f"pid {self.pids[0]}"]
        elif self.pids:
            shown = ", ".join(map(str, self.pids[:MAX_PIDS]))
            more = f" +{len(self.pids) - MAX_PIDS} more" if len(self.pids) > MAX_PIDS else ""
            pids = [f"{len(self.pids)} processes: pid {shown}{more}"]
        else:
            pids = []
        return [self.role, *pids, *([self.where] if self.where else [])]


@dataclass
class Edge:
    """One wait between boxes, labelled with what it waits on (pipe, socket, wait4, ...)."""

    src: str
    dst: str
    label: str
    timed: bool = False  # the wait has a timeout: it wakes up by itself
    in_cycle: bool = False


@dataclass
class WaitGraph:
    """The hang's wait-for graph between processes, grouped and bounded for drawing."""

    nodes: list[Node]
    edges: list[Edge]


def wait_object(task: TaskWait, edge: WaitEdge) -> str:
    """What a wait is on, in one or two words: ``pipe (read)``, ``socket``, ``wait4``, ..."""
    via, call = edge.via, task.call
    if via.startswith("collective "):
        return via
    if via.startswith("its exit") or call in ("wait4", "waitid"):
        return call if call in ("wait4", "waitid") else "wait4"
    if "pipe:" in via:
        kind = "pipe"
    elif "socket" in via:
        kind = "socket"
    elif "/sem." in via:
        kind = "semaphore"
    elif "lock" in via and "on " in via:
        kind = "file lock"
    elif call == "futex":
        kind = "futex"
    elif via.startswith("file "):
        kind = "file"
    else:
        kind = call or "wait"
    return f"{kind} ({call})" if call and call not in kind and kind in ("pipe", "socket") else kind


def _pid_edges(hang: HangReport) -> dict[int, dict[tuple[int, str], bool]]:
    """pid -> {(target, label): timed}; target 0: nobody, -1: outside; own threads left out."""
    known = {p.pid for p in hang.processes}
    out: dict[int, dict[tuple[int, str], bool]] = {p.pid: {} for p in hang.processes}
    for proc in hang.processes:
        for task in proc.tasks:
            if task.before_test:
                continue  # threads from before the test release nothing of it
            helper_poll = task.timed and task.tid != proc.pid  # gloo's event loop, ...
            for edge in task.waits_for:
                if edge.pid == proc.pid or (helper_poll and edge.pid <= 0):
                    # a wait on its own threads (or its own copy of a pipe's end); a helper
                    # thread's listening socket
                    continue
                target = edge.pid if edge.pid in known or edge.pid <= 0 else -1
                key = (target, wait_object(task, edge))
                out[proc.pid][key] = out[proc.pid].get(key, True) and task.timed
    for src, dst, label in _collective_waits(hang.processes):
        out[src].setdefault((dst, label), False)
    return out


def _collective_waits(procs: list[ProcessReport]) -> list[tuple[int, int, str]]:
    """A rank in collective #S waits for every rank of its group that never started #S."""
    edges = []
    for proc in procs:
        pending = next((c for c in proc.collectives if not c.completed), None)
        if pending is None:
            continue
        for other in procs:
            started = [c.seq for c in other.collectives if c.group == pending.group]
            rank = other.role_data().kind == "rank" or bool(other.collectives)
            if other.pid != proc.pid and rank and max(started, default=0) < pending.seq:
                label = f"collective {pending.name} #{pending.seq}"
                edges.append((proc.pid, other.pid, label))
    return edges


def _cycles(out: dict[int, dict[tuple[int, str], bool]]) -> set[int]:
    """The pids on a cycle of waits that never time out (strongly connected, two or more)."""
    graph = {
        pid: {t for (t, _), timed in edges.items() if t > 0 and t in out and not timed}
        for pid, edges in out.items()
    }
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    stack: list[int] = []
    on_stack: set[int] = set()
    found: set[int] = set()

    def visit(start: int) -> None:  # Tarjan, iterative: a tree of 64 must not hit recursion limits
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.update(component)

    for pid in sorted(graph):
        if pid not in index:
            visit(pid)
    return found


def _where(proc: ProcessReport) -> str:
    if proc.exit_status:
        return proc.exit_status
    if not proc.stuck_at:
        return proc.state
    return f"{'busy' if proc.busy else 'in'} {proc.stuck_at}"


def _numbered(proc: ProcessReport) -> tuple[str, int | None]:
    """``DataLoader worker 3/8 (dataset X)`` -> (``DataLoader worker {}/8 (dataset X)``, 3)."""
    return proc.role_data().numbered()


def _ranges(numbers: list[int]) -> str:
    """[0, 1, 2, 3, 5] -> ``0-3, 5``."""
    runs: list[list[int]] = []
    for n in sorted(numbers):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def build_graph(hang: HangReport) -> WaitGraph:
    """The hang's processes as boxes and their waits as edges, identical workers grouped."""
    out = _pid_edges(hang)
    cycle = _cycles(out)
    waited_on = {t for edges in out.values() for t, _ in edges}
    by_pid = {p.pid: p for p in hang.processes}

    def classes(proc: ProcessReport) -> list[str]:
        found = []
        if proc.pid in cycle:
            found.append("inCycle")
        elif proc.pid in waited_on and all(
            t == 0 or timed for (t, _), timed in out[proc.pid].items()
        ):
            found.append("chainEnd")  # waited for, and waits for no process itself for good
        if proc.exit_status:
            found.append("gone")
        elif proc.busy:
            found.append("busy")
        if not found and proc.role.startswith(_HELPERS):
            found.append("helper")
        return found

    # group: same role but for its number, same parent, place, look and waits
    groups: dict[tuple[object, ...], list[ProcessReport]] = {}
    for proc in hang.processes:
        template, number = _numbered(proc)
        if number is None or proc.pid in cycle:
            key: tuple[object, ...] = ("single", proc.pid)
        else:
            waits = tuple(sorted((t, label) for t, label in out[proc.pid]))
            key = (template, proc.ppid, _where(proc), tuple(classes(proc)), waits)
        groups.setdefault(key, []).append(proc)
    group_of: dict[int, str] = {}
    nodes: list[Node] = []
    for members in groups.values():
        if len(members) < GROUP_AT:
            for proc in members:
                node = Node(f"p{proc.pid}", proc.role, [proc.pid], _where(proc), classes(proc))
                nodes.append(node)
                group_of[proc.pid] = node.key
            continue
        template, _ = _numbered(members[0])
        numbers = [n for n in (_numbered(p)[1] for p in members) if n is not None]
        box = f"g{len(nodes)}"
        role = template.replace("{}", _ranges(numbers))
        pids = [p.pid for p in sorted(members, key=lambda p: _numbered(p)[1] or 0)]
        nodes.append(Node(box, role, pids, _where(members[0]), classes(members[0])))
        group_of.update((p.pid, box) for p in members)
    nodes = _bounded(nodes, group_of, out)
    edges = _edges(out, group_of, cycle, by_pid)
    drawn = {n.key for n in nodes}
    for special, role in ((NOBODY, "no process can end this wait"), (OUTSIDE, "outside the tree")):
        if any(e.dst == special for e in edges):
            drawn.add(special)
            nodes.append(Node(special, role, classes=["chainEnd"]))
    return WaitGraph(nodes, [e for e in edges if e.src in drawn and e.dst in drawn])


def _bounded(
    nodes: list[Node], group_of: dict[int, str], out: dict[int, dict[tuple[int, str], bool]]
) -> list[Node]:
    """At most MAX_NODES boxes: those in the cycle or a chain first, the rest as one box."""
    if len(nodes) <= MAX_NODES:
        return nodes
    linked = {group_of[p] for p, edges in out.items() if edges}
    linked |= {group_of[t] for edges in out.values() for t, _ in edges if t in group_of}
    ranked = sorted(nodes, key=lambda n: (not n.classes, n.key not in linked))
    kept, rest = ranked[: MAX_NODES - 1], ranked[MAX_NODES - 1 :]
    more = Node(MORE, f"{sum(len(n.pids) for n in rest)} more processes", classes=["helper"])
    for node in rest:
        for pid in node.pids:
            group_of[pid] = MORE
    order = {n.key: i for i, n in enumerate(nodes)}
    return [*sorted(kept, key=lambda n: order[n.key]), more]


def _edges(
    out: dict[int, dict[tuple[int, str], bool]],
    group_of: dict[int, str],
    cycle: set[int],
    by_pid: dict[int, ProcessReport],
) -> list[Edge]:
    edges: dict[tuple[str, str, str], Edge] = {}
    for pid, waits in out.items():
        for (target, label), timed in waits.items():
            src = group_of[pid]
            dst = NOBODY if target == 0 else OUTSIDE if target < 0 else group_of[target]
            if dst == src and src != MORE:
                continue
            known = edges.get((src, dst, label))
            in_cycle = pid in cycle and target in cycle
            if known is None:
                edges[(src, dst, label)] = Edge(src, dst, label, timed, in_cycle)
            else:
                known.timed = known.timed and timed
                known.in_cycle = known.in_cycle or in_cycle
    return list(edges.values())


# --- Mermaid -------------------------------------------------------------------------------------

_MERMAID_ESCAPES = {
    "#": "#35;",
    '"': "#quot;",
    "<": "#lt;",
    ">": "#gt;",
    "|": "#124;",
    "[": "#91;",
    "]": "#93;",
    "{": "#123;",
    "}": "#125;",
}


def mermaid_text(text: str) -> str:
    """``text`` safe inside a quoted Mermaid label: entity codes for what the grammar reads."""
    text = " ".join(text.split())
    return "".join(_MERMAID_ESCAPES.get(c, c) for c in text)


def to_mermaid(hang: HangReport) -> str:
    """The wait-for graph as a Mermaid flowchart (GitHub renders it in Markdown)."""
    graph = build_graph(hang)
    out = ["flowchart LR"]
    for node in graph.nodes:
        label = "<br/>".join(mermaid_text(line) for line in node.lines())
        out.append(f'    {node.key}["{label}"]')
    for edge in graph.edges:
        arrow = "==>" if edge.in_cycle else "-.->" if edge.timed else "-->"
        out.append(f'    {edge.src} {arrow}|"{mermaid_text(edge.label)}"| {edge.dst}')
    used = {c for n in graph.nodes for c in n.classes}
    for name, (style, _) in STYLES.items():
        if name in used:
            out.append(f"    classDef {name} {style}")
            members = ",".join(n.key for n in graph.nodes if name in n.classes)
            out.append(f"    class {members} {name}")
    return "\n".join(out) + "\n"


# --- Graphviz ------------------------------------------------------------------------------------


def _dot_text(text: str) -> str:
    return " ".join(text.split()).replace("\\", "\\\\").replace('"', '\\"')


def to_dot(hang: HangReport) -> str:
    """The wait-for graph in Graphviz's language: ``dot -Tsvg report.dot > hang.svg``."""
    graph = build_graph(hang)
    out = [
        "digraph hang {",
        f'    label="{_dot_text(hang.headline)}"; labelloc=t; fontname="Helvetica"; rankdir=LR;',
        '    node [shape=box, style="rounded,filled", fillcolor="#e3f2fd", color="#1565c0", fontname="Helvetica"];',
        '    edge [fontname="Helvetica", fontsize=10];',
    ]
    for node in graph.nodes:
        label = "\\n".join(_dot_text(line) for line in node.lines())
        style = ", ".join(STYLES[c][1] for c in node.classes[:1])
        out.append(f'    {node.key} [label="{label}"' + (f", {style}" if style else "") + "];")
    for edge in graph.edges:
        attrs = [f'label="{_dot_text(edge.label)}"']
        if edge.in_cycle:
            attrs.append('color="#b71c1c", penwidth=3')
        elif edge.timed:
            attrs.append("style=dashed")
        out.append(f"    {edge.src} -> {edge.dst} [{', '.join(attrs)}];")
    out.append("}")
    return "\n".join(out) + "\n"


# --- Markdown (the CI job summary) ---------------------------------------------------------------

_MD_SPECIAL = re.compile(r"([\\*_\[\]<>#|~])")


def markdown_text(text: str) -> str:
    """Prose for Markdown: its ``code spans`` kept, every other special character escaped."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(p if p.startswith("`") else _MD_SPECIAL.sub(r"\\\1", p) for p in parts)


def _code_span(text: str) -> str:
    fence = "``" if "`" in text else "`"
    return f"{fence} {text} {fence}" if fence == "``" else f"`{text}`"


def _fenced(text: str, info: str) -> str:
    longest = max((len(m) for m in re.findall(r"`{3,}", text)), default=2)
    fence = "`" * (longest + 1)
    return f"{fence}{info}\n{text.rstrip()}\n{fence}"


def to_markdown(hang: HangReport) -> str:
    """One hang as a Markdown section: headline, hints, the graph, the full report folded."""
    out = [f"### {_code_span(hang.headline)}", ""]
    for hint in hang.hints:
        out.append(f"- **hint:** {markdown_text(hint.text)}")
        out.extend(f"  - based on: {markdown_text(b)}" for b in hint.based_on)
    for note in hang.notes:
        out.append(f"- **note:** {markdown_text(note)}")
    if hang.hints or hang.notes:
        out.append("")
    out += [_fenced(to_mermaid(hang), "mermaid"), ""]
    text = to_text(hang)
    if len(text) > MAX_SUMMARY_TEXT:
        cut = text.rfind("\n", 0, MAX_SUMMARY_TEXT)
        text = text[:cut] + (
            f"\n... {len(text) - cut} more characters: the job log and the JSON report have all"
        )
    out += [
        f"<details><summary>Full report of {markdown_text(hang.test_id)} "
        f"({len(hang.processes)} processes)</summary>",
        "",
        _fenced(text, "text"),
        "",
        "</details>",
        "",
    ]
    return "\n".join(out) + "\n"


def append_job_summary(path: str, hang: HangReport) -> str | None:
    """Append the hang's section to a GitHub job summary file (``$GITHUB_STEP_SUMMARY``).

    Returns None, or why the file could not take it: a summary that cannot be written must not
    end the session. Past SUMMARY_FULL_BYTES only the headline is added (GitHub's 1 MiB limit).
    """
    try:
        size = os.path.getsize(path) if os.path.exists(path) else 0
        section = to_markdown(hang)
        if size + len(section.encode()) > SUMMARY_FULL_BYTES:
            section = f"- {_code_span(hang.headline)} (the job log has the report)\n"
        with open(path, "a", encoding="utf-8") as out:
            out.write(section)
    except OSError as exc:
        return f"the job summary could not be written to {path}: {exc}"
    return None


FORMATS = {
    "text": to_text,
    "markdown": to_markdown,
    "mermaid": to_mermaid,
    "dot": to_dot,
}


def render(hang: HangReport, fmt: str) -> str:
    """``hang`` in one of :data:`FORMATS`."""
    text = FORMATS[fmt](hang)
    return text if text.endswith("\n") else text + "\n"

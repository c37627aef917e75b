"""A parser for the subset of Mermaid's flowchart grammar the plugin writes: it rejects the rest.

Mermaid's grammar (``flow.jison``) reads a quoted label up to the next ``"`` and an edge label
up to the next ``|``, takes ``#name;`` as an entity, and keeps words such as ``end`` for itself.
This parser holds the output to that: a label must escape what would end it early, an edge
must join declared nodes, a class must be defined before it is given.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass, field

RESERVED = {
    "end",
    "graph",
    "flowchart",
    "subgraph",
    "class",
    "classDef",
    "style",
    "click",
    "linkStyle",
    "direction",
    "default",
}
_ID = r"[A-Za-z][A-Za-z0-9_]*"
_HEADER = re.compile(r"flowchart (LR|RL|TB|TD|BT)")
_NODE = re.compile(rf"\s+({_ID})\[\"([^\"]*)\"\]")
_EDGE = re.compile(rf"\s+({_ID}) (-->|==>|-\.->)\|\"([^\"|]*)\"\| ({_ID})")
_CLASSDEF = re.compile(rf"\s+classDef ({_ID}) ([a-z-]+:[^,;]+(?:,[a-z-]+:[^,;]+)*)")
_CLASS = re.compile(rf"\s+class ({_ID}(?:,{_ID})*) ({_ID})")
_ENTITY = re.compile(r"#(?:[0-9]+|[a-z]+);")
#: Characters the grammar reads inside a label: they must come as entity codes.
_RAW_FORBIDDEN = set('"|[]{}<>')


class MermaidError(ValueError):
    """The text is outside the flowchart subset; the message names the line."""


@dataclass
class Flowchart:
    """What a flowchart says: its nodes with their labels (lines, entities decoded) and edges."""

    direction: str
    nodes: dict[str, list[str]] = field(default_factory=dict)
    edges: list[tuple[str, str, str, str]] = field(default_factory=list)  # src, arrow, label, dst
    classes: dict[str, set[str]] = field(default_factory=dict)  # class -> node ids


def _html_entity(match: re.Match[str]) -> str:
    """Mermaid's ``#35;`` / ``#quot;`` as HTML's ``&#35;`` / ``&quot;``."""
    body = match.group(0)[1:]
    return f"&#{body}" if body[0].isdigit() else f"&{body}"


def _label(text: str, number: int, allow_breaks: bool) -> str:
    parts = text.split("<br/>") if allow_breaks else [text]
    for part in parts:
        bare = _ENTITY.sub("", part)
        bad = sorted(set(bare) & (_RAW_FORBIDDEN | {"#"}))
        if bad:
            raise MermaidError(f"line {number}: unescaped {bad} in label {text!r}")
    decoded = [html.unescape(_ENTITY.sub(_html_entity, p)) for p in parts]
    return "\n".join(decoded)


def _node_id(name: str, number: int) -> str:
    if name in RESERVED:
        raise MermaidError(f"line {number}: {name!r} is a Mermaid keyword, not a node id")
    return name


def parse(text: str) -> Flowchart:
    """The flowchart in ``text``, or MermaidError at its first line outside the subset."""
    lines = text.rstrip("\n").split("\n")
    header = _HEADER.fullmatch(lines[0])
    if header is None:
        raise MermaidError(f"line 1: expected 'flowchart LR|TB|...', got {lines[0]!r}")
    chart = Flowchart(header.group(1))
    defined: set[str] = set()
    for number, line in enumerate(lines[1:], 2):
        if match := _NODE.fullmatch(line):
            name = _node_id(match.group(1), number)
            if name in chart.nodes:
                raise MermaidError(f"line {number}: node {name} declared twice")
            chart.nodes[name] = _label(match.group(2), number, True).split("\n")
        elif match := _EDGE.fullmatch(line):
            src, arrow, label, dst = match.groups()
            for name in (src, dst):
                if _node_id(name, number) not in chart.nodes:
                    raise MermaidError(f"line {number}: edge to undeclared node {name}")
            chart.edges.append((src, arrow, _label(label, number, False), dst))
        elif match := _CLASSDEF.fullmatch(line):
            defined.add(match.group(1))
        elif match := _CLASS.fullmatch(line):
            names, cls = match.group(1).split(","), match.group(2)
            if cls not in defined:
                raise MermaidError(f"line {number}: class {cls} used before its classDef")
            missing = [n for n in names if n not in chart.nodes]
            if missing:
                raise MermaidError(f"line {number}: class given to undeclared {missing}")
            chart.classes.setdefault(cls, set()).update(names)
        else:
            raise MermaidError(f"line {number}: not a flowchart statement: {line!r}")
    return chart


def mermaid_blocks(markdown: str) -> list[str]:
    """The bodies of the ```mermaid fenced blocks of a Markdown text."""
    return [body for _, body in re.findall(r"^(`{3,})mermaid\n(.*?)^\1$", markdown, re.S | re.M)]

"""How a hang report is judged against a corpus case: the hint in its own words, the frames shown.

Shared by ``bench/score_corpus.py`` (scores a live run) and ``tests/unit/test_world_corpus.py``
(scores today's diagnosis replayed on recorded reports), so both judge alike. The rules follow
the project's judges: before a hint is matched against the case's regular expressions, what it
echoes from the evidence is removed (quoted source, ``file.py:N`` places, role decorations and
the names the case file defines), so only an explanation in the hint's own words can match.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

#: A hint whose text says no one can end a wait (checked against cases where something could).
NOTHING_CAN_END = "nothing can end"


def defined_names(path: Path) -> set[str]:
    """The function and class names a case file defines (its own vocabulary, not an explanation)."""
    try:
        text = path.read_text()
    except OSError:
        return set()
    return set(re.findall(r"^\s*(?:def|class)\s+(\w+)", text, re.M))


def own_words(text: str, names: Iterable[str]) -> str:
    """``text`` without what it echoes: backtick-quoted source, file places, role decorations
    (dataset and target names) and the case's own names longer than 3 characters."""
    text = re.sub(r"`[^`]*`", " ", text)
    text = re.sub(r"[\w./-]+\.py(:\d+)?", " ", text)
    text = re.sub(r"\(dataset [^)]*\)", " ", text)
    text = re.sub(r"target=[\w.]+", " ", text)
    for name in names:
        if len(name) > 3:
            text = re.sub(r"\b" + re.escape(name) + r"\b", " ", text)
    return text


def matches(text: str, regexes: Iterable[str]) -> bool:
    """Whether a (cleaned) hint names the cause: every regex of the case matches it."""
    wanted = list(regexes)
    return bool(text.strip()) and all(re.search(rx, text) for rx in wanted)


def hints_of(report: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(rule id, text) of every hint of a JSON hang report, in order."""
    return [(str(h.get("rule", "?")), str(h.get("text", ""))) for h in report.get("hints", [])]


def judge_hints(
    hints: list[tuple[str, str]], regexes: list[str], names: set[str]
) -> tuple[bool, list[tuple[str, bool]]]:
    """Whether the hints together name the cause, and for each hint's rule whether its own text
    alone does (a rule that fired is right when its text matches every regex)."""
    cleaned = [(rule, own_words(text, names)) for rule, text in hints]
    joined = "\n".join(text for _, text in cleaned)
    return matches(joined, regexes), [(rule, matches(text, regexes)) for rule, text in cleaned]


def frames_missing(frames: Iterable[str], lines: list[str]) -> list[str]:
    """The expected frames not shown as a stack entry: a plain name must stand as a word, not
    followed by "(" (a call in a quoted source line), on a line that names a .py file and a
    number; "re:..." is a regular expression over the whole text."""
    stack = [ln for ln in lines if ".py" in ln and re.search(r"\d", ln)]
    text = "\n".join(lines)
    missing = []
    for frame in frames:
        if frame.startswith("re:"):
            shown = re.search(frame[3:], text) is not None
        else:
            rx = re.compile(r"(?<![\w.])" + re.escape(frame) + r"\b(?!\()")
            shown = any(rx.search(ln) for ln in stack)
        if not shown:
            missing.append(frame)
    return missing


def report_frames(report: Mapping[str, Any]) -> set[str]:
    """Every function name in the stacks of a JSON hang report (the ground truth of a case)."""
    return {
        str(frame.get("name"))
        for proc in report.get("processes", [])
        for thread in proc.get("threads", [])
        for frame in thread.get("frames", [])
    }

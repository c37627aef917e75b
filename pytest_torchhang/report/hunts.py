"""A hunt's pure maths and words: a hang's signature, a rate's Wilson interval, the hunt line.

Shared by the hunt (``hunt.py``, in the pytest session) and ``merge-hunts`` (``report/merge.py``),
which must say a hunt's result in the same words; kept here, below both, so no import runs back
up from ``report/``.
"""

from __future__ import annotations

import math
import re

from .groups import aside_role, helper_role
from .model import HangReport

#: What differs between machines and runs of one hang: addresses, absolute paths, pids.
_UNSTABLE = [
    (re.compile(r"0x[0-9a-fA-F]+"), "0x?"),
    (re.compile(r"(?<![\w.])/(?:[^/\s:()]+/)+([^/\s:()]+)"), r"\1"),
    (re.compile(r"\bpid \d+"), "pid ?"),
]


def _stable(text: str) -> str:
    for pattern, replacement in _UNSTABLE:
        text = pattern.sub(replacement, text)
    return text


def signature(hang: HangReport) -> str:
    """The set of (role, stuck frame) pairs of the hang's processes, as one stable string.

    Equal for the same hang on any machine: no pid, address or absolute path stays in it, so
    ``merge-hunts`` can count one hang across the jobs of a CI matrix. Helpers (which wait by
    design) and processes shown for context (not the test's own) are left out.
    """
    pairs = {
        _stable(f"{p.role_data().general()} in {p.stuck_at}")
        for p in hang.processes
        if p.stuck_at
        and not (aside_role(p.role) or helper_role(p.role))
        and p.state not in ("zombie", "gone")
    }
    return "; ".join(sorted(pairs)) or "no stuck frame"


def wilson(hits: int, runs: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of ``hits / runs`` (95% by default): good at 0 and at 1 of N."""
    if runs <= 0:
        return 0.0, 1.0
    p = hits / runs
    centre = p + z * z / (2 * runs)
    spread = z * math.sqrt(p * (1 - p) / runs + z * z / (4 * runs * runs))
    scale = 1 + z * z / runs
    return max(0.0, (centre - spread) / scale), min(1.0, (centre + spread) / scale)


def rate(hangs: int, runs: int) -> str:
    """``hung 3 of 200 runs (1.5%, 95% CI 0.5%-4.3%)``."""
    low, high = wilson(hangs, runs)
    share = 100 * hangs / runs if runs else 0.0
    return f"hung {hangs} of {runs} runs ({share:.1f}%, 95% CI {100 * low:.1f}%-{100 * high:.1f}%)"


def hunt_line(test_id: str, hangs: int, runs: int, distinct: int) -> str:
    """``test_x: hung 3 of 200 runs (1.5%, 95% CI 0.5%-4.3%), 2 distinct signatures``.

    The one wording of a hunt's result: the hunt section and ``merge-hunts`` both say it so.
    """
    plural = "s" if distinct != 1 else ""
    return f"{test_id}: {rate(hangs, runs)}, {distinct} distinct signature{plural}"


def pressure_lines(
    plain: tuple[int, int, float | None], stressed: tuple[int, int, float | None]
) -> list[str]:
    """The plain and the stressed rate, each with its interval, and what stress costs a run.

    Each argument is ``(hangs, runs, seconds of a passing run or None)``; a kind that did not
    run is left out, and the cost only compares runs that passed (a hung run lasts its timeout).
    """
    lines = []
    for name, (hangs, runs, _) in (("plain", plain), ("stressed", stressed)):
        if runs:
            lines.append(f"{name}: {rate(hangs, runs)}")
    plain_s, stressed_s = plain[2], stressed[2]
    if plain[1] and stressed[1]:
        if plain_s and stressed_s:
            lines.append(
                f"a passing stressed run took {stressed_s:.3f}s, a plain one {plain_s:.3f}s: "
                f"{stressed_s / plain_s:.1f}x as long"
            )
        else:
            lines.append("no passing run of each kind to say how much slower stress is")
    return lines

"""An inner session's outcome counts, hangs and stalls included.

pytester's ``assert_outcomes`` knows pytest's own outcomes only: it reads ``1 failed, 2 hang``
as one failure and drops the hangs. Here every count is compared, 0 when not given.
"""

from __future__ import annotations

import pytest

#: Outcomes compared always (0 when not given); warnings and deselected only when given, as
#: pytester does.
COUNTED = ("passed", "skipped", "failed", "errors", "xpassed", "xfailed", "hang", "stall")
OPTIONAL = ("warnings", "deselected")


def assert_outcomes(result: pytest.RunResult, **expected: int) -> None:
    """``assert_outcomes(result, passed=1, hang=2)``: the summary line says exactly that."""
    unknown = set(expected) - set(COUNTED) - set(OPTIONAL)
    if unknown:
        raise TypeError(f"unknown outcome(s) {sorted(unknown)}: use {COUNTED + OPTIONAL}")
    outcomes = result.parseoutcomes()
    names = [*COUNTED, *(name for name in OPTIONAL if name in expected)]
    obtained = {name: outcomes.get(name, 0) for name in names}
    wanted = {name: expected.get(name, 0) for name in names}
    assert obtained == wanted, result.stdout.str()[-3000:]

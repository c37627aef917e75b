"""The suite's own wall time, by tier: the fast tier (tests/unit) and the end-to-end tier, with
inner sessions started warm (tests/warm.py, the default) and cold (``TORCHHANG_TESTS_COLD=1``),
side by side in one run.

A contributor pays for the suite on every change: this is the figure docs/performance.md records.
The end-to-end tier is run warm and cold in turn (the order alternating per round), so other work on
the machine hits both alike. ``--hogs N`` keeps N CPU-bound processes beside every run, as
``--cpu-hogs`` does (a busy CI runner).

Run: ``python bench/bench_suite.py [--rounds R] [--hogs N] [--workers W]``; ``--quick`` times one
file of the fast tier only (what tests/test_bench.py runs: that the script still works, in
seconds, not the tier again, which the suite runs anyway).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from _common import machine, median, parser, run_session, table

ROOT = Path(__file__).resolve().parent.parent
#: what --quick times: one small file of the fast tier
QUICK_FILE = "tests/unit/test_clock.py"
_COUNTS = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)")


def _tests(output: str) -> int:
    return sum(int(n) for n, _ in _COUNTS.findall(output.splitlines()[-1] if output else ""))


def _tier(args: list[str], workers: int, hogs: int, cold: bool) -> tuple[float, int, str]:
    options = [*args, "-p", "no:randomly", f"--cpu-hogs={hogs}"]
    if workers:
        options += ["-n", str(workers)]
    env = {"TORCHHANG_TESTS_COLD": "1"} if cold else {}
    session = run_session(ROOT, options, env=env, timeout=3600, expect=(0, 1))
    last = session.output.strip().splitlines()[-1] if session.output.strip() else ""
    return session.wall_s, _tests(session.output.strip()), last


def main() -> None:
    args = parser(__doc__)
    args.add_argument("--rounds", type=int, default=1, help="Runs of each end-to-end variant")
    args.add_argument("--hogs", type=int, default=0, help="CPU-bound processes beside each run")
    args.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (-n)")
    options = args.parse_args()
    print(f"the suite's wall time by tier; {machine()}; hogs {options.hogs}, -n {options.workers}")
    rows: list[tuple[object, ...]] = []
    unit = [QUICK_FILE] if options.quick else ["tests/unit"]
    unit_s, unit_n, unit_last = _tier(unit, 0, options.hogs, cold=False)
    rows.append((f"fast tier ({unit[0]}, one process)", unit_n, unit_s, unit_last))
    if not options.quick:
        walls: dict[bool, list[float]] = {False: [], True: []}
        counts: dict[bool, int] = {}
        lasts: dict[bool, str] = {}
        for round_ in range(options.rounds):
            for cold in (round_ % 2 == 1, round_ % 2 == 0):
                wall, count, last = _tier(
                    ["tests", "--ignore=tests/unit"], options.workers, options.hogs, cold
                )
                walls[cold].append(wall)
                counts[cold], lasts[cold] = count, last
        for cold in (False, True):
            name = "end-to-end tier, inner sessions " + ("cold" if cold else "warm")
            rows.append((name, counts[cold], median(walls[cold]), lasts[cold]))
        whole = unit_s + median(walls[False])
        rows.append(("the suite (both tiers, warm)", unit_n + counts[False], whole, ""))
    table(["tier", "tests", "wall s", "outcome"], rows, first=44)
    print(f"measured {time.strftime('%Y-%m-%d')}; goal: the suite under 300 s with -n 2")


if __name__ == "__main__":
    main()

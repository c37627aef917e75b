"""Per-test cost the way a user pays it: the whole pytest process, as the slope between sizes.

Each configuration runs a generated session of trivial passing tests in a fresh ``pytest``
process, at two sizes (2,000 and 6,000 tests); the per-test cost is the slope, (median of the
large sessions less median of the small ones) / 4,000, of the process's wall time and of its CPU
time (user + system of pytest and of every helper process it started and reaped: the monitor).
Whatever a user pays per test is in the slope: collection, the run loop, reporting, the
session's end and the interpreter's exit (a larger session ends slower too); what a session
pays once (interpreter start, imports, the monitor's start and stop) is in the intercept.
The configurations take turns (interleaved, the order rotated every round, so that drift and
other work on the machine hit all alike); pytest-timeout's signal method runs in the same
rounds as the plugin. The session's own conftest times its parts (collection, the run loop,
the session's end), so that the table also says where each part of the slope goes.

Run: ``python bench/bench_overhead.py [--small N] [--large N] [--repeats R] [--variant NAME=PATH]``.
``--variant`` adds the guarding configuration run with PATH first on PYTHONPATH (a modified
copy of the package), measured in the same rounds as the installed code. Each figure is the
median over rounds of that round's slope (its two sizes run back to back), and a difference
between configurations the median of the rounds' differences: drift between rounds cancels.
"""

from __future__ import annotations

import tempfile
import textwrap
from pathlib import Path

from _common import (
    OUT_ENV,
    add_variant_option,
    machine,
    measured_variants,
    median,
    parser,
    run_session,
    table,
)

# Wall and CPU (of the pytest process) at the edges of the session's parts: configure (after
# start-up and imports), collection, the run loop, and the end of unconfigure (after the
# session's end: sessionfinish, the summary, the plugin's stop). The rest of the process's wall
# time is its start-up before configure and its exit after unconfigure.
CONFTEST = textwrap.dedent(
    f"""
    import json
    import os
    import time

    import pytest

    MARKS = {{}}


    def _mark(name):
        MARKS[name] = (time.perf_counter(), time.process_time())


    @pytest.hookimpl(tryfirst=True)
    def pytest_configure(config):
        _mark("configure")


    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_collection(session):
        _mark("collect")
        try:
            return (yield)
        finally:
            _mark("collected")


    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtestloop(session):
        _mark("run")
        try:
            return (yield)
        finally:
            _mark("ran")


    @pytest.hookimpl(trylast=True)
    def pytest_unconfigure(config):
        _mark("unconfigured")
        with open(os.environ["{OUT_ENV}"], "w") as out:
            json.dump(MARKS, out)
    """
)

TESTS = textwrap.dedent(
    """
    import pytest


    @pytest.mark.parametrize("i", range({n}))
    def test_trivial(i):
        pass
    """
)

NO_PLUGIN = "no plugin (-p no:torchhang -p no:timeout)"
TIMEOUT_SIGNAL = "pytest-timeout --timeout=60 --timeout-method=signal"
INERT = "pytest-torchhang inert (no timeout set)"
GUARD = "pytest-torchhang --torch-hang-timeout=60"
#: the session's parts, between the conftest's marks (wall time)
PARTS = {
    "collection": ("collect", "collected"),
    "run loop": ("run", "ran"),
    "session end": ("ran", "unconfigured"),
}
GOAL_MS = 0.100


def configurations(variants: list[tuple[str, str]]) -> dict[str, tuple[list[str], str | None]]:
    """name -> (pytest arguments, PYTHONPATH entry for a variant of the package)."""
    configs: dict[str, tuple[list[str], str | None]] = {
        NO_PLUGIN: (["-p", "no:torchhang", "-p", "no:timeout"], None),
        TIMEOUT_SIGNAL: (["-p", "no:torchhang", "--timeout=60", "--timeout-method=signal"], None),
        INERT: (["-p", "no:timeout"], None),
        GUARD: (["-p", "no:timeout", "--torch-hang-timeout=60"], None),
    }
    for name, path in variants:  # the guarding configuration only: what changes most
        configs[f"{GUARD} [{name}]"] = (["-p", "no:timeout", "--torch-hang-timeout=60"], path)
    return configs


def main() -> None:
    args = parser(__doc__)
    args.add_argument("--small", type=int, help="Tests in the small session (default 2000)")
    args.add_argument("--large", type=int, help="Tests in the large session (default 6000)")
    args.add_argument("--repeats", type=int, help="Sessions per configuration and size (5)")
    add_variant_option(args)
    options = args.parse_args()
    small = options.small or (100 if options.quick else 2000)
    large = options.large or (300 if options.quick else 6000)
    repeats = options.repeats or (1 if options.quick else 5)
    configs = configurations(measured_variants(args, options))
    names = list(configs)
    # per name and size: the process's wall and CPU, and each part's wall
    keys = ["wall", "cpu", *PARTS, "rest"]
    samples = {name: {n: {k: [] for k in keys} for n in (small, large)} for name in names}
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        root = Path(tmp)
        (root / "conftest.py").write_text(CONFTEST)
        for n in (small, large):
            (root / f"test_{n}.py").write_text(TESTS.format(n=n))
        rounds = repeats if options.quick else repeats + 1  # the first round warms caches
        runs = [(name, n) for name in names for n in (small, large)]
        for round_ in range(rounds):
            shift = round_ % len(runs)
            for name, n in runs[shift:] + runs[:shift]:
                pytest_args, path = configs[name]
                session = run_session(root, [*pytest_args, f"test_{n}.py"], pythonpath=path)
                if f"{n} passed" not in session.output:
                    raise RuntimeError(f"{name}: expected {n} passed:\n{session.output[-2000:]}")
                if round_ == 0 and not options.quick:
                    continue
                marks = {k: v[0] for k, v in session.figures.items()}  # type: ignore[index]
                sample = samples[name][n]
                sample["wall"].append(session.wall_s)
                sample["cpu"].append(session.cpu_s)
                inside = 0.0
                for part, (begin, end) in PARTS.items():
                    sample[part].append(marks[end] - marks[begin])
                    inside += marks[end] - marks[begin]
                # start-up before collection (configure included), and the exit after unconfigure
                sample["rest"].append(session.wall_s - inside)

    def slope(name: str, key: str) -> float:
        """ms per test: the median over rounds of each round's slope (the large session less
        the small one, run back to back, per added test): drift between rounds cancels."""
        by_size = samples[name]
        per_round = [
            (big - little) / (large - small) * 1e3
            for big, little in zip(by_size[large][key], by_size[small][key], strict=True)
        ]
        return median(per_round)

    def over(name: str, base: str, key: str) -> float:
        """ms per test: the median over rounds of ``name``'s slope less ``base``'s."""
        pairs = zip(samples[name][large][key], samples[name][small][key], strict=True)
        theirs = zip(samples[base][large][key], samples[base][small][key], strict=True)
        return median(
            [
                ((a - b) - (c - d)) / (large - small) * 1e3
                for (a, b), (c, d) in zip(pairs, theirs, strict=True)
            ]
        )

    def least(name: str, key: str) -> float:
        """ms per test from the least disturbed sessions: the fastest large one less the fastest
        small one (CPU-bound work is only ever slowed down by other work on the machine)."""
        by_size = samples[name]
        return (min(by_size[large][key]) - min(by_size[small][key])) / (large - small) * 1e3

    def fixed(name: str, key: str) -> float:
        """ms per session: the intercept."""
        return median(samples[name][small][key]) * 1e3 - slope(name, key) * small

    print(
        f"whole pytest process, {small} and {large} trivial passing tests, per-test cost = slope; "
        f"median of {repeats} interleaved sessions per configuration and size"
    )
    print(machine())
    table(
        [
            "configuration",
            "CPU ms/test",
            "wall ms/test",
            "CPU ms/session",
            "wall ms/session",
            f"{large} tests s",
        ],
        [
            (
                name,
                slope(name, "cpu"),
                slope(name, "wall"),
                fixed(name, "cpu"),
                fixed(name, "wall"),
                median(samples[name][large]["wall"]),
            )
            for name in names
        ],
        first=56,
    )
    print("\nwhere the wall time per test goes (ms/test, slope of each part of the session):")
    table(
        ["configuration", *PARTS, "start+exit"],
        [(name, *(slope(name, part) for part in [*PARTS, "rest"])) for name in names],
        first=56,
    )
    print(
        "\nCPU: user + system time of the pytest process and of its helper processes (the "
        "monitor); wall: the process's wall time, start to exit.\nms/test is the slope between "
        "the two sizes; ms/session the intercept (what a session pays once)."
    )
    for name in [n for n in names if n.startswith(GUARD)]:
        extra_cpu = over(name, TIMEOUT_SIGNAL, "cpu")
        extra_wall = over(name, TIMEOUT_SIGNAL, "wall")
        verdict = "met" if max(extra_cpu, extra_wall) <= GOAL_MS else "NOT met"
        print(
            f"per test: {name} (guarding): {extra_cpu:+.3f} ms CPU, {extra_wall:+.3f} ms wall "
            f"over pytest-timeout's signal method (goal <= +{GOAL_MS:.3f}: {verdict})"
        )
        print(
            f"  least disturbed: {least(name, 'cpu') - least(TIMEOUT_SIGNAL, 'cpu'):+.3f} ms CPU, "
            f"{least(name, 'wall') - least(TIMEOUT_SIGNAL, 'wall'):+.3f} ms wall "
            "(the fastest sessions of each size)"
        )
    for name in [n for n in names if n.startswith(INERT)]:
        print(
            f"per test: {name} (inert): {over(name, NO_PLUGIN, 'cpu'):+.3f} ms CPU, "
            f"{over(name, NO_PLUGIN, 'wall'):+.3f} ms wall over no plugin"
        )


if __name__ == "__main__":
    main()

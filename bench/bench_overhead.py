"""Per-test overhead on trivial passing tests: pytest-torchhang vs pytest-timeout vs no plugin.

Each configuration runs the same generated session (2,000 passing tests) in a fresh ``pytest``;
the configurations take turns (interleaved, the order rotated every round, so drift and other
work on the machine hit all alike) and the table shows medians. The per-test cost is the
session's collection plus run-loop time (timed by the session's own conftest, so interpreter
start-up and plugin import are left out) minus the no-plugin session's, divided by the number
of tests; the process wall time is shown too.

Run: ``python bench/bench_overhead.py [--tests N] [--repeats R] [--variant NAME=PATH]``.
``--variant`` adds the inert and guarding configurations run with PATH first on PYTHONPATH (a
modified copy of the package), measured in the same rounds as today's code.
"""

from __future__ import annotations

import tempfile
import textwrap
from pathlib import Path

from _common import (
    OUT_ENV,
    add_variant_option,
    imported_modules,
    machine,
    measured_variants,
    median,
    parser,
    run_session,
    spread,
    table,
)

# Timed by the session itself: collection, and the run loop after the first test (whose
# one-off costs, such as starting the plugin's monitor process, are left out: the conftest lets
# that start finish before the clock runs again). CPU time counts the pytest process, all its
# threads, and its helper processes.
CONFTEST = textwrap.dedent(
    f"""
    import json
    import os
    import time

    import psutil
    import pytest

    FIGURES = {{}}


    def _children_cpu():
        total = 0.0
        for child in psutil.Process().children(recursive=True):
            try:
                times = child.cpu_times()
                total += times.user + times.system
            except psutil.Error:
                pass
        return total


    def _now():
        return time.perf_counter(), time.process_time() + _children_cpu()


    def _settle():
        # wait until helper processes started by the first test have finished starting
        before = _children_cpu()
        for _ in range(40):
            time.sleep(0.05)
            now = _children_cpu()
            if now == before:
                return
            before = now


    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_collection(session):
        wall, cpu = _now()
        try:
            return (yield)
        finally:
            wall2, cpu2 = _now()
            FIGURES["collect_wall"], FIGURES["collect_cpu"] = wall2 - wall, cpu2 - cpu


    def pytest_runtest_logfinish(nodeid, location):
        if "start" not in FIGURES:
            settle = time.perf_counter()
            _settle()
            FIGURES["settle"] = time.perf_counter() - settle
            FIGURES["start"] = _now()


    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtestloop(session):
        try:
            return (yield)
        finally:
            wall2, cpu2 = _now()
            if "start" in FIGURES:  # not in a --collect-only session
                wall, cpu = FIGURES.pop("start")
                FIGURES["run_wall"], FIGURES["run_cpu"] = wall2 - wall, cpu2 - cpu


    def pytest_unconfigure(config):
        with open(os.environ["{OUT_ENV}"], "w") as out:
            json.dump(FIGURES, out)
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
TIMEOUT_THREAD = "pytest-timeout --timeout=60 --timeout-method=thread"
INERT = "pytest-torchhang inert (no timeout set)"
GUARD = "pytest-torchhang --torch-hang-timeout=60"


def configurations(
    quick: bool, variants: list[tuple[str, str]]
) -> dict[str, tuple[list[str], str | None]]:
    """name -> (pytest arguments, PYTHONPATH entry for a variant of the package)."""
    configs: dict[str, tuple[list[str], str | None]] = {
        NO_PLUGIN: (["-p", "no:torchhang", "-p", "no:timeout"], None),
        TIMEOUT_SIGNAL: (["-p", "no:torchhang", "--timeout=60", "--timeout-method=signal"], None),
        INERT: (["-p", "no:timeout"], None),
        GUARD: (["-p", "no:timeout", "--torch-hang-timeout=60"], None),
    }
    if not quick:
        configs[TIMEOUT_THREAD] = (
            ["-p", "no:torchhang", "--timeout=60", "--timeout-method=thread"],
            None,
        )
    for name, path in variants:
        configs[f"{INERT} [{name}]"] = (["-p", "no:timeout"], path)
        configs[f"{GUARD} [{name}]"] = (["-p", "no:timeout", "--torch-hang-timeout=60"], path)
    return configs


def import_cost(root: Path, repeats: int) -> tuple[float, float]:
    """What the plugin's import adds to an inert session, in ms: (all of it, the guard's part).

    The modules imported with the plugin and not without, their own import times summed; the
    guard's part is the modules a guarded test needs and an inert session could do without.
    """
    totals, guard = [], []
    for _ in range(repeats):
        base = imported_modules(root, ["-p", "no:torchhang", "-p", "no:timeout", *COLLECT])
        inert = imported_modules(root, ["-p", "no:timeout", *COLLECT])
        added = {name: us for name, us in inert.items() if name not in base}
        totals.append(sum(added.values()) / 1000)
        guard.append(
            sum(
                us
                for name, us in added.items()
                if name.startswith("pytest_torchhang.") and name.split(".")[1] in GUARD_MODULES
            )
            / 1000
        )
    return median(totals), median(guard)


#: A collect-only session: what the plugin's import costs, without any test run.
COLLECT = ["--collect-only", "test_trivial.py"]
#: Packages and modules only a guarded test, a hang or the fixture needs.
GUARD_MODULES = {"watchdog", "processwide", "capture", "diagnosis", "report", "runner", "monitor"}


def main() -> None:
    args = parser(__doc__)
    args.add_argument("--tests", type=int, help="Passing tests per session (default 2000)")
    args.add_argument("--repeats", type=int, help="Sessions per configuration (default 7)")
    add_variant_option(args)
    options = args.parse_args()
    tests = options.tests or (200 if options.quick else 2000)
    repeats = options.repeats or (1 if options.quick else 7)
    variants = measured_variants(args, options)
    configs = configurations(options.quick, variants)
    names = list(configs)
    samples: dict[str, dict[str, list[float]]] = {
        name: {"cpu": [], "inner": [], "collect": [], "wall": []} for name in names
    }
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        root = Path(tmp)
        (root / "conftest.py").write_text(CONFTEST)
        (root / "test_trivial.py").write_text(TESTS.format(n=tests))
        rounds = repeats if options.quick else repeats + 1  # the first full round warms caches
        for round_ in range(rounds):
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            for name in order:
                pytest_args, path = configs[name]
                session = run_session(root, [*pytest_args, "test_trivial.py"], pythonpath=path)
                if f"{tests} passed" not in session.output:
                    raise RuntimeError(
                        f"{name}: expected {tests} passed:\n{session.output[-2000:]}"
                    )
                if round_ == 0 and not options.quick:
                    continue
                figures = {k: float(v) for k, v in session.figures.items()}  # type: ignore[arg-type]
                sample = samples[name]
                # per test: collection of every test, the run of every test but the first
                sample["cpu"].append(
                    figures["collect_cpu"] / tests + figures["run_cpu"] / (tests - 1)
                )
                sample["inner"].append(
                    figures["collect_wall"] / tests + figures["run_wall"] / (tests - 1)
                )
                sample["collect"].append(figures["collect_wall"] / tests)
                # less the conftest's wait for the monitor's start
                sample["wall"].append(session.wall_s - figures["settle"])
        total_import, guard_import = import_cost(root, 1 if options.quick else 5)

    def per_test(name: str, key: str) -> float:
        """Median of ``key`` for ``name`` minus the no-plugin session's, in ms per test."""
        scale = 1 if key in ("cpu", "inner", "collect") else tests  # those are per test already
        return (median(samples[name][key]) - median(samples[NO_PLUGIN][key])) / scale * 1000

    print(f"{tests} trivial passing tests per session, median of {repeats} interleaved sessions")
    print(machine())
    table(
        [
            "configuration",
            "CPU ms/test",
            "wall ms/test",
            "(collect)",
            "session s",
            "(min-max)",
            "process ms/test",
        ],
        [
            (
                name,
                per_test(name, "cpu"),
                per_test(name, "inner"),
                per_test(name, "collect"),
                median(samples[name]["wall"]),
                spread(samples[name]["wall"]),
                per_test(name, "wall"),
            )
            for name in names
        ],
        first=56,
    )
    print(
        "\nCPU: CPU time of the pytest process and its helpers (the monitor) in collection and "
        "the run loop (first test left out);\nwall: wall time of the same; process: the whole "
        "pytest process, with the plugin's import and its once-a-session start and stop.\n"
        "Each against the no-plugin session, per test."
    )
    for label, key in (("CPU", "cpu"), ("wall", "inner"), ("process wall", "wall")):
        extra = per_test(GUARD, key) - per_test(TIMEOUT_SIGNAL, key)
        line = (
            f"{label:>12}: guarding {extra:+.3f} ms/test over pytest-timeout's signal method "
            f"(goal <= +0.100), inert {per_test(INERT, key):.3f} ms/test (goal < 0.020)"
        )
        for variant, _path in variants:
            line += (
                f"; [{variant}] guarding "
                f"{per_test(f'{GUARD} [{variant}]', key) - per_test(TIMEOUT_SIGNAL, key):+.3f}, "
                f"inert {per_test(f'{INERT} [{variant}]', key):.3f}"
            )
        print(line)
    print(
        f"\nimport: the plugin adds {total_import:.1f} ms of imports to an inert session "
        f"(once a session), {guard_import:.1f} ms of them the guard's modules "
        f"({', '.join(sorted(GUARD_MODULES))})"
    )


if __name__ == "__main__":
    main()

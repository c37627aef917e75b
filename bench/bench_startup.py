"""Start-up cost of a guarded one-test session, side by side with pytest-timeout's.

The session a developer runs most: ``pytest -k one_test``. One trivial passing test, run in a
fresh ``pytest`` with ``--torch-hang-timeout=60``, paired with the same session under
pytest-timeout's ``--timeout=60`` (``-p no:torchhang``); the pairs run back to back, their order
alternating, so drift and other work on the machine hit both alike. The figure is the median of
the pairs' differences in process wall time: interpreter start, imports, the session, the exit.
Other installed pytest plugins (hypothesis, xdist, ...) are disabled on both sides, since they
cost both the same and only add noise; ``--all-plugins`` keeps them.

Then, from ``python -X importtime``, the modules the guarded session imports that pytest-timeout's
does not, and whether any of them belongs to the cold path (capture, diagnosis, rendering, the
runner), which must load only at the first fire. Run:
``python bench/bench_startup.py [--pairs N] [--variant NAME=PATH] [--all-plugins]``.
"""

from __future__ import annotations

import tempfile
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

from _common import (
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

TEST = textwrap.dedent(
    """
    def test_one():
        pass
    """
)

#: Plugins the comparison is about: every other pytest11 entry point is disabled on both sides.
COMPARED = {"torchhang", "timeout"}
TIMEOUT = "pytest-timeout --timeout=60 (-p no:torchhang)"
GUARD = "pytest-torchhang --torch-hang-timeout=60"
NO_PLUGIN = "no plugin (-p no:torchhang -p no:timeout)"
GOAL_MS = 50.0

#: The hot path: what a guarded session may import before any test fires (the deadline model,
#: the progress board, the ownership snapshot, and the thin shells around them).
HOT = (
    "pytest_torchhang",
    "pytest_torchhang.plugin",
    "pytest_torchhang.settings",
    "pytest_torchhang.clock",
    "pytest_torchhang.session",
    "pytest_torchhang.deadline",
    "pytest_torchhang.watchdog",
    "pytest_torchhang.processwide",
    "pytest_torchhang.exceptions",
    "pytest_torchhang.debuggers",  # each guarded test's debugger check (stdlib only)
    "pytest_torchhang.rerun",  # records the session's hangs in pytest's cache (pytest only)
    "pytest_torchhang.fixtures",  # the per-test hooks' wrapper of wider fixtures' setup
    "pytest_torchhang.pertest",  # the per-test hooks themselves (plugin.py's split, issue 30)
    "pytest_torchhang.terminal",  # its short summary's wrapper, registered at configure
    "pytest_torchhang.devices",
    "pytest_torchhang.inject",
    "pytest_torchhang.monitor.client",
    "pytest_torchhang.monitor.page",
    "pytest_torchhang.capture.target",
    "pytest_torchhang.capture.procfs",
    "pytest_torchhang.capture.tree",
)
#: Third-party modules only the cold path needs.
COLD_THIRD_PARTY = ("psutil",)


def is_cold(module: str) -> bool:
    """Whether ``module`` belongs to the cold path (loaded at the first fire, never at start)."""
    if module.split(".")[0] in COLD_THIRD_PARTY:
        return True
    if module.split(".")[0] != "pytest_torchhang":
        return False
    return not any(module == hot or module.startswith(hot + ".") for hot in HOT[1:]) and (
        module not in ("pytest_torchhang", "pytest_torchhang.capture", "pytest_torchhang.monitor")
    )


def other_plugins() -> list[str]:
    """``-p no:NAME`` for every installed pytest plugin but the two compared."""
    names = sorted({ep.name for ep in entry_points(group="pytest11")} - COMPARED)
    return [arg for name in names for arg in ("-p", f"no:{name}")]


def configurations(
    variants: list[tuple[str, str]],
) -> dict[str, tuple[list[str], str | None]]:
    """name -> (pytest arguments, PYTHONPATH entry for a variant of the package)."""
    configs: dict[str, tuple[list[str], str | None]] = {
        TIMEOUT: (["-p", "no:torchhang", "--timeout=60"], None),
        GUARD: (["--torch-hang-timeout=60"], None),
        NO_PLUGIN: (["-p", "no:torchhang", "-p", "no:timeout"], None),
    }
    for name, path in variants:
        configs[f"{GUARD} [{name}]"] = (["--torch-hang-timeout=60"], path)
    return configs


def main() -> None:
    args = parser(__doc__)
    args.add_argument("--pairs", type=int, help="Paired sessions (default 11; 3 with --quick)")
    add_variant_option(args)
    args.add_argument(
        "--all-plugins", action="store_true", help="Keep every installed pytest plugin loaded"
    )
    options = args.parse_args()
    pairs = options.pairs or (3 if options.quick else 11)
    variants = measured_variants(args, options)
    # -v undoes the bench's usual -q: the session a user runs, with its header
    common = ["-v", *([] if options.all_plugins else other_plugins())]
    configs = configurations(variants)
    names = list(configs)
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        root = Path(tmp)
        (root / "test_one.py").write_text(TEST)
        for round_ in range(pairs + 1):  # the first round warms the caches and is left out
            order = names if round_ % 2 == 0 else names[::-1]
            for name in order:
                pytest_args, path = configs[name]
                session = run_session(root, [*common, *pytest_args, "test_one.py"], pythonpath=path)
                if "1 passed" not in session.output:
                    raise RuntimeError(f"{name}: expected 1 passed:\n{session.output[-2000:]}")
                if round_:
                    wall[name].append(session.wall_s)
                    cpu[name].append(session.cpu_s)
        timeout_imports = imported_modules(root, [*common, *configs[TIMEOUT][0], "test_one.py"])
        guard_imports = imported_modules(root, [*common, *configs[GUARD][0], "test_one.py"])

    def over_timeout(name: str, of: dict[str, list[float]] = wall) -> list[float]:
        """Each pair's difference, ``name`` less pytest-timeout's, in ms."""
        return [(a - b) * 1000 for a, b in zip(of[name], of[TIMEOUT], strict=True)]

    print(f"one trivial passing test per session, {pairs} interleaved pairs, medians")
    print(machine() + ("" if options.all_plugins else "; other pytest plugins disabled"))
    table(
        ["configuration", "session s", "(min-max)", "wall ms over", "(min-max)", "CPU ms over"],
        [
            (
                name,
                median(wall[name]),
                spread(wall[name]),
                median(over_timeout(name)),
                spread(over_timeout(name)) if name != TIMEOUT else "",
                median(over_timeout(name, cpu)),
            )
            for name in names
        ],
        first=48,
    )
    print(
        "wall ms over: each pair's difference in process wall time, the session less "
        "pytest-timeout's, median;\nCPU ms over: the same of CPU time (user + system of pytest "
        "and of its helper processes)"
    )
    for name in [GUARD, *(f"{GUARD} [{variant}]" for variant, _ in variants)]:
        extra = median(over_timeout(name))
        verdict = "met" if extra <= GOAL_MS else "NOT met"
        print(
            f"start-up: {name}: {extra:+.1f} ms over pytest-timeout's one-test session "
            f"(goal <= +{GOAL_MS:.0f} ms: {verdict}), {median(over_timeout(name, cpu)):+.1f} ms "
            "of CPU"
        )
    added = {m: us for m, us in guard_imports.items() if m not in timeout_imports}
    ours = sorted((m for m in added if m.startswith("pytest_torchhang")), key=lambda m: -added[m])
    cold = sorted(m for m in added if is_cold(m))
    print(
        f"\nimports: the guarded session imports {len(added)} modules pytest-timeout's does not, "
        f"{sum(added.values()) / 1000:.1f} ms of own import time ({len(ours)} of the plugin's: "
        f"{sum(added[m] for m in ours) / 1000:.1f} ms)"
    )
    for module in ours[:8]:
        print(f"  {added[module] / 1000:6.1f} ms  {module}")
    print(f"cold-path modules imported at start: {', '.join(cold) if cold else 'none'}")


if __name__ == "__main__":
    main()

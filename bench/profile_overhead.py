"""Where the plugin's per-test time goes: a profile of a session of trivial passing tests.

Runs the generated session (2,000 passing tests) under ``cProfile`` twice, with the plugin
inert and with ``--torch-hang-timeout=60`` (pytest-timeout disabled in both), and prints, per
test, the plugin's own functions by cumulative time and the system calls they make. Profiling
slows Python code down about twofold, so read the figures as shares, and take the cost itself
from ``bench_overhead.py``. Run: ``python bench/profile_overhead.py [--tests N] [--top K]``.
"""

from __future__ import annotations

import pstats
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from _common import answered, clean_env, machine, parser, table

TESTS = textwrap.dedent(
    """
    import pytest


    @pytest.mark.parametrize("i", range({n}))
    def test_trivial(i):
        pass
    """
)

CONFIGS = {
    "inert (no timeout set)": ["-p", "no:timeout"],
    "--torch-hang-timeout=60": ["-p", "no:timeout", "--torch-hang-timeout=60"],
}
PACKAGE = "pytest_torchhang/"

Key = tuple[str, int, str]


def _ours(key: Key) -> bool:
    return PACKAGE in key[0] and key[2] != "<module>"


def _name(key: Key) -> str:
    filename, line, function = key
    if filename == "~":
        return function  # a builtin, e.g. {built-in method posix.write}
    return f"{filename.split(PACKAGE, 1)[-1]}:{line} {function}"


def profile(root: Path, args: list[str], tests: int, top: int) -> None:
    out = root / "session.prof"
    command = [sys.executable, "-m", "cProfile", "-o", str(out), "-m", "pytest", "-q"]
    done = subprocess.run(
        [*command, "-p", "no:cacheprovider", *args, "test_trivial.py"],
        cwd=root,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    answered(
        f"pytest {' '.join(args)} under cProfile",
        done.returncode == 0 and f"{tests} passed" in done.stdout and out.exists(),
        done.stdout + done.stderr,
    )
    stats = pstats.Stats(str(out)).stats  # type: ignore[attr-defined]
    ours = sorted(
        ((key, row) for key, row in stats.items() if _ours(key)),
        key=lambda kv: kv[1][3],
        reverse=True,
    )
    per_test = 1e6 / tests
    every_test = [(key, row) for key, row in ours if row[1] >= tests / 2]
    table(
        ["per test: function (pytest_torchhang/...)", "cum us/test", "own us/test", "calls/test"],
        [
            (_name(key), row[3] * per_test, row[2] * per_test, f"{row[1] / tests:.2f}")
            for key, row in every_test[:top]
        ],
        first=60,
    )
    once = [(key, row) for key, row in ours if row[1] < tests / 2]
    print()
    table(
        ["once a session (or collection): function", "cum ms", "own ms", "calls"],
        [
            (_name(key), row[3] * 1000, row[2] * 1000, row[1])
            for key, row in once[: max(5, top // 2)]
        ],
        first=60,
    )
    # calls into builtins (system calls, locks) made directly by the plugin's functions
    direct: dict[Key, list[float]] = {}
    for key, (_cc, _nc, _tt, _ct, callers) in stats.items():
        if key[0] != "~":
            continue
        for caller, (_c, ncalls, tottime, _cum) in callers.items():
            if _ours(caller):
                entry = direct.setdefault(key, [0.0, 0.0])
                entry[0] += tottime
                entry[1] += ncalls
    if direct:
        print()
        table(
            ["builtin called by the plugin", "us/test", "calls/test"],
            [
                (_name(key), tottime * per_test, f"{ncalls / tests:.2f}")
                for key, (tottime, ncalls) in sorted(direct.items(), key=lambda kv: -kv[1][0])[
                    : max(5, top // 2)
                ]
            ],
            first=60,
        )


def main() -> None:
    args = parser(__doc__)
    args.add_argument("--tests", type=int, help="Passing tests in the session (default 2000)")
    args.add_argument("--top", type=int, default=15, help="Functions shown (default 15)")
    options = args.parse_args()
    tests = options.tests or (200 if options.quick else 2000)
    print(f"cProfile of {tests} trivial passing tests; {machine()}")
    with tempfile.TemporaryDirectory(prefix="bench-profile-") as tmp:
        root = Path(tmp)
        (root / "test_trivial.py").write_text(TESTS.format(n=tests))
        for name, pytest_args in CONFIGS.items():
            print(f"\n== pytest-torchhang {name}")
            profile(root, pytest_args, tests, options.top)


if __name__ == "__main__":
    main()

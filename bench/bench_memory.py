"""Memory: what the plugin adds to the pytest process, and what its helper processes hold.

Each configuration runs a generated session of 200 passing tests (the first one starts a
Python subprocess, so the dump hook is exercised); its conftest measures the pytest process at
session end, and the plugin's helpers then alive: the monitor (started by the first guarded
test) and the zygote (started by the first ``torch_hang`` fixture call, here ``torch_hang.run``).
Run: ``python bench/bench_memory.py``.
"""

from __future__ import annotations

import tempfile
import textwrap
from pathlib import Path

from _common import OUT_ENV, machine, median, parser, run_session, table

CONFTEST = textwrap.dedent(
    f"""
    import json
    import os

    import psutil


    def _memory(proc):
        info = proc.memory_full_info()
        return {{"rss": info.rss, "uss": info.uss}}


    def pytest_sessionfinish(session):
        me = psutil.Process()
        figures = {{"pytest": _memory(me)}}
        for child in me.children():
            cmdline = " ".join(child.cmdline())
            for helper in ("zygote", "monitor"):
                if f"pytest_torchhang.{{helper}}" in cmdline:
                    figures[helper] = _memory(child)
        with open(os.environ["{OUT_ENV}"], "w") as out:
            json.dump(figures, out)
    """
)

TESTS = textwrap.dedent(
    """
    import subprocess
    import sys

    import pytest


    @pytest.mark.parametrize("i", range({n}))
    def test_it(i):
        if i == 0:
            subprocess.run([sys.executable, "-c", "pass"], check=True)
    """
)

FIXTURE_TEST = textwrap.dedent(
    """
    import os


    def test_uses_the_fixture(torch_hang):
        assert torch_hang.run(os.getpid) != os.getpid()
    """
)

CONFIGS = {
    "no plugin": ["-p", "no:torchhang", "-p", "no:timeout", "test_many.py"],
    "plugin inert (no timeout)": ["-p", "no:timeout", "test_many.py"],
    "--torch-hang-timeout=60": ["-p", "no:timeout", "--torch-hang-timeout=60", "test_many.py"],
    "--torch-hang-timeout=60, torch_hang.run used": [
        "-p",
        "no:timeout",
        "--torch-hang-timeout=60",
        "test_many.py",
        "test_fixture.py",
    ],
}


def mib(value: float) -> float:
    return value / (1 << 20)


def main() -> None:
    args = parser(__doc__)
    options = args.parse_args()
    tests = 50 if options.quick else 200
    repeats = 1 if options.quick else 3
    samples: dict[str, list[dict[str, dict[str, int]]]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        root = Path(tmp)
        (root / "conftest.py").write_text(CONFTEST)
        (root / "test_many.py").write_text(TESTS.format(n=tests))
        (root / "test_fixture.py").write_text(FIXTURE_TEST)
        for _ in range(repeats):
            for name, pytest_args in CONFIGS.items():
                samples[name].append(run_session(root, pytest_args).figures)  # type: ignore[arg-type]

    def figure(name: str, process: str, kind: str) -> float:
        return mib(median([s[process][kind] for s in samples[name]]))

    base = figure("no plugin", "pytest", "rss")
    rows: list[tuple[object, ...]] = []
    for name in CONFIGS:
        rss = figure(name, "pytest", "rss")
        rows.append((f"pytest, {name}", rss, figure(name, "pytest", "uss"), f"{rss - base:+.1f}"))
    last = list(CONFIGS)[-1]
    for helper, what in (("monitor", "monitor process"), ("zygote", "zygote (torch imported)")):
        if all(helper in s for s in samples[last]):
            rows.append((what, figure(last, helper, "rss"), figure(last, helper, "uss"), ""))
        else:
            rows.append((what, "absent", "", ""))
    print(f"at the end of {tests} passing tests, median of {repeats}; {machine()}")
    table(["process", "RSS MiB", "USS MiB", "vs no plugin"], rows, first=52)


if __name__ == "__main__":
    main()

"""Shared helpers of the bench scripts: generated pytest sessions, timing and the table output.

Every figure is taken the way users meet it: a real ``pytest`` session in a fresh interpreter,
running a generated test file, with the installed plugin (or a copy of it put first on
``PYTHONPATH`` with ``--variant``, to measure a change side by side with today's code).
"""

from __future__ import annotations

import argparse
import atexit
import json
import re
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

#: Where a generated session writes its figures (a JSON document) for the bench script.
OUT_ENV = "TORCHHANG_BENCH_OUT"
#: The injected start-up hook's directory, which a guarded session puts on PYTHONPATH.
_INJECT = os.path.join("pytest_torchhang", "inject", "site")


#: Every child process a script asked for an answer (a session's outcome line, a figure on its
#: stdout), and how many gave it: printed at exit, so that a figure never stands on a child that
#: silently did nothing (tests/test_bench.py reads the line).
_CHILDREN = {"asked": 0, "answered": 0}
_OUTCOME = re.compile(r"\b\d+ (passed|failed|hang|stall|error)")


def answered(what: str, ok: bool, output: str = "") -> None:
    """Count one child's answer; a child that gave none stops the script with its output."""
    if not _CHILDREN["asked"]:
        atexit.register(_print_children)
    _CHILDREN["asked"] += 1
    if not ok:
        raise RuntimeError(f"{what} gave no answer:\n{output[-3000:]}")
    _CHILDREN["answered"] += 1


def _print_children() -> None:
    print(f"children answered: {_CHILDREN['answered']} of {_CHILDREN['asked']}", flush=True)


def parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser with ``--quick`` (the small, seconds-long version CI runs)."""
    first = (doc or "").strip().splitlines()[0] if doc else None
    parsed = argparse.ArgumentParser(description=first)
    parsed.add_argument(
        "--quick", action="store_true", help="A small version that runs in seconds (for CI)"
    )
    return parsed


def add_variant_option(args: argparse.ArgumentParser) -> None:
    """``--variant NAME=PATH``: also measure another copy of the package (an older commit's)."""
    args.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="Also measure the package found at PATH (put first on PYTHONPATH)",
    )


def measured_variants(
    args: argparse.ArgumentParser, options: argparse.Namespace
) -> list[tuple[str, str]]:
    """The ``--variant`` values as (name, path) pairs; a value without a path is a usage error."""
    found: list[tuple[str, str]] = []
    for variant in options.variant:
        name, _, path = variant.partition("=")
        if not path:
            args.error(f"--variant takes NAME=PATH, got {variant!r}")
        found.append((name, path))
    return found


def clean_env(pythonpath: str | None = None, **extra: str) -> dict[str, str]:
    """This environment without pytest-torchhang's own settings and injected hook.

    A bench run from inside a guarded session (tests/test_bench.py) must not pass the outer
    session's timeout, dump directory or start-up hook on to the sessions it measures.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_TORCH_HANG")}
    env.pop("PYTEST_ADDOPTS", None)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and _INJECT not in p]
    if pythonpath:
        paths.insert(0, pythonpath)
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    else:
        env.pop("PYTHONPATH", None)
    env.update(extra)
    return env


def pytest_command(*args: str) -> list[str]:
    """A quiet pytest session in a fresh interpreter, without the cache provider."""
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]


@dataclass
class Session:
    """One finished pytest session: its wall time, output and the figures it wrote."""

    wall_s: float
    returncode: int
    output: str
    figures: dict[str, object]
    #: CPU time (user + system) of the session's process and of every descendant reaped by it
    cpu_s: float = 0.0


def run_session(
    root: Path,
    args: Sequence[str],
    *,
    pythonpath: str | None = None,
    timeout: float = 600,
    env: dict[str, str] | None = None,
    expect: Iterable[int] = (0,),
) -> Session:
    """Run ``pytest args`` in ``root``; the figures are what the session wrote to ``OUT_ENV``."""
    out = root / f"figures-{time.monotonic_ns()}.json"
    full_env = clean_env(pythonpath, **(env or {}), **{OUT_ENV: str(out)})
    cpu_before = _children_cpu()
    start = time.perf_counter()
    done = subprocess.run(
        pytest_command(*args),
        cwd=root,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    wall = time.perf_counter() - start
    cpu = _children_cpu() - cpu_before
    output = done.stdout + done.stderr
    if done.returncode not in tuple(expect):
        raise RuntimeError(
            f"pytest {' '.join(args)} exited {done.returncode} in {root}:\n{output[-3000:]}"
        )
    figures = json.loads(out.read_text()) if out.exists() else {}
    out.unlink(missing_ok=True)
    # a session that exits as expected but ran no test (or wrote nothing) answered nothing
    answered(f"pytest {' '.join(args)} in {root}", bool(_OUTCOME.search(output)), output)
    return Session(wall, done.returncode, output, figures, cpu)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def imported_modules(root: Path, args: Sequence[str]) -> dict[str, int]:
    """module -> its own import time (us) in the session ``pytest args`` run in ``root``, read
    from ``python -X importtime``."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", *pytest_command(*args)[1:]],
        cwd=root,
        env=clean_env(**{OUT_ENV: str(root / f"import-session-{time.monotonic_ns()}.json")}),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    answered(f"pytest -X importtime {' '.join(args)}", "import time:" in done.stderr, done.stderr)
    own = {}
    for line in done.stderr.splitlines():
        if line.startswith("import time:") and "|" in line and "self [us]" not in line:
            self_us, _cumulative, name = line[len("import time:") :].split("|")
            own[name.strip()] = int(self_us)
    return own


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def spread(values: Sequence[float]) -> str:
    """``min-max`` of ``values``, for the reader to judge the noise."""
    return f"{min(values):.3f}-{max(values):.3f}"


def table(header: Sequence[str], rows: Iterable[Sequence[object]], first: int = 44) -> None:
    """Print a left-aligned first column and right-aligned figures."""
    widths = [first, *(max(10, len(h)) for h in header[1:])]
    print(
        " ".join(
            f"{h:<{w}}" if i == 0 else f"{h:>{w}}"
            for i, (h, w) in enumerate(zip(header, widths, strict=True))
        )
    )
    for row in rows:
        cells = []
        for i, (cell, w) in enumerate(zip(row, widths, strict=True)):
            text = f"{cell:.3f}" if isinstance(cell, float) else str(cell)
            cells.append(f"{text:<{w}}" if i == 0 else f"{text:>{w}}")
        print(" ".join(cells))


def machine() -> str:
    """One line about where the figures were taken."""
    import platform

    load = os.getloadavg()[0]
    return (
        f"python {platform.python_version()}, {os.cpu_count()} cores, load average {load:.2f}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}"
    )

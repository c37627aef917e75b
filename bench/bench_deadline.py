"""From the deadline to a complete report and a dead tree, for trees of 4 and 64 processes.

Each size runs a real pytest session whose test forks N sleeping Python children (like
DataLoader workers) and waits on them. Three figures per size: the report's own times (how late
the capture began after the deadline, the capture, the kill), and the time from the deadline to
the moment the test is failed, measured from outside the plugin by the session's conftest, which
also checks that every child is then gone. Run: ``python bench/bench_deadline.py [--sizes 1 4 16 64]``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from _common import (
    OUT_ENV,
    answered,
    clean_env,
    machine,
    median,
    parser,
    run_session,
    table,
)

_NUMBER = re.compile(r"\d+(\.\d+)?(e-?\d+)?")

TIMEOUT_S = 3.0

TEST = textwrap.dedent(
    """
    import multiprocessing as mp
    import os
    import time

    N = int(os.environ["BENCH_TREE_SIZE"])


    def sleep_forever():
        time.sleep(1000)


    def test_tree(record_children):
        children = [mp.get_context("fork").Process(target=sleep_forever) for _ in range(N)]
        for child in children:
            child.start()
        record_children([child.pid for child in children])
        for child in children:
            child.join()
    """
)

CONFTEST = textwrap.dedent(
    f"""
    import json
    import os
    import sys
    import time

    import psutil
    import pytest

    STATE = {{"children": []}}


    @pytest.fixture
    def record_children():
        return STATE["children"].extend


    def pytest_runtest_logstart(nodeid, location):
        STATE["armed"] = time.monotonic()  # the plugin armed the deadline just before
        STATE["modules_armed"] = sorted(sys.modules)


    def pytest_runtest_logreport(report):
        if report.when != "call":
            return
        failed_at = time.monotonic()
        alive = []
        for pid in STATE["children"]:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        STATE["deadline_to_failed_s"] = failed_at - STATE["armed"] - {TIMEOUT_S}
        STATE["modules_fired"] = sorted(sys.modules)  # the fire's, and the report's rendering
        STATE["outcome"] = report.outcome
        STATE["alive_at_failure"] = alive


    def pytest_unconfigure(config):
        with open(os.environ["{OUT_ENV}"], "w") as out:
            json.dump(STATE, out)
    """
)


#: Imports, in a fresh interpreter, what a guarded session had loaded when its test was armed
#: (argv[1]), then times the import of what the first fire loaded on top of it (argv[2]).
IMPORT_TIMER = textwrap.dedent(
    """
    import importlib
    import json
    import sys
    import time

    for name in json.loads(sys.argv[1]):
        importlib.import_module(name)
    start = time.perf_counter()
    for name in json.loads(sys.argv[2]):
        importlib.import_module(name)
    print(time.perf_counter() - start)
    """
)
#: Packages whose modules count as the plugin's (the test's own imports are left out).
PLUGIN_PACKAGES = ("pytest_torchhang", "psutil")


def _plugin_modules(names: object) -> list[str]:
    assert isinstance(names, list)
    return [str(n) for n in names if str(n).split(".")[0] in PLUGIN_PACKAGES]


def first_fire_import(figures: dict[str, object], repeats: int) -> tuple[int, float]:
    """(modules, seconds): what the first fire of a session imports (the cold path: capture,
    wait-for graph, diagnosis, the report's rendering), and how long that import takes in a
    fresh interpreter that has what the session had loaded when the test was armed; median of
    ``repeats`` interpreters."""
    armed = ["pytest", *_plugin_modules(figures["modules_armed"])]
    fired = [m for m in _plugin_modules(figures["modules_fired"]) if m not in set(armed)]
    times = []
    for _ in range(repeats):
        done = subprocess.run(
            [sys.executable, "-c", IMPORT_TIMER, json.dumps(armed), json.dumps(fired)],
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        answered("the import timer", bool(_NUMBER.fullmatch(done.stdout.strip())), done.stdout)
        times.append(float(done.stdout.split()[-1]))
    return len(fired), median(times)


def main() -> None:
    args = parser(__doc__)
    args.add_argument("--sizes", type=int, nargs="+", help="Tree sizes (default 4 64)")
    args.add_argument("--repeats", type=int, help="Sessions per size (default 5)")
    options = args.parse_args()
    sizes = options.sizes or ([4] if options.quick else [4, 64])
    repeats = options.repeats or (1 if options.quick else 5)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-deadline-") as tmp:
        root = Path(tmp)
        (root / "conftest.py").write_text(CONFTEST)
        (root / "test_tree.py").write_text(TEST)
        samples: dict[int, list[dict[str, float]]] = {size: [] for size in sizes}
        first_session: dict[str, object] = {}
        for _ in range(repeats):
            for size in sizes:  # sizes take turns
                reports = root / f"reports-{size}-{len(samples[size])}"
                session = run_session(
                    root,
                    [
                        "-p",
                        "no:timeout",
                        f"--torch-hang-timeout={TIMEOUT_S}",
                        f"--torch-hang-report-dir={reports}",
                        "test_tree.py",
                    ],
                    env={"BENCH_TREE_SIZE": str(size)},
                    expect=(1,),
                    timeout=180,
                )
                (path,) = reports.glob("*.json")
                doc = json.loads(path.read_text())
                if len(doc["processes"]) != size + 1:
                    raise RuntimeError(f"expected {size + 1} processes: {len(doc['processes'])}")
                outside = session.figures
                first_session = first_session or outside
                if outside.get("outcome") != "failed" or outside.get("alive_at_failure"):
                    raise RuntimeError(f"children alive when the test failed: {outside}")
                samples[size].append(
                    {
                        "late": doc["elapsed_s"] - doc["timeout_s"],
                        "capture": doc["capture_s"],
                        "kill": doc["kill_s"],
                        "failed": float(outside["deadline_to_failed_s"]),  # type: ignore[arg-type]
                    }
                )
    fire_modules, fire_import_s = first_fire_import(first_session, 3 if options.quick else 7)
    for size in sizes:
        col = {k: median([s[k] for s in samples[size]]) for k in samples[size][0]}
        rows.append(
            (
                size,
                col["late"],
                col["capture"],
                col["kill"],
                col["late"] + col["capture"] + col["kill"],
                col["failed"],
            )
        )
    print(f"timeout {TIMEOUT_S:g}s, median of {repeats} session(s) per size; {machine()}")
    table(
        ["processes", "late s", "capture s", "kill s", "report: to dead s", "to test failed s"],
        rows,
        first=10,
    )
    print(
        "\nlate: capture start after the deadline; to dead: late + capture + kill (the report's "
        "times); to test failed: from the deadline to the failed test, every child gone "
        "(measured outside the plugin). Goals: under 0.5 s for 4 processes, under 2 s for 64."
    )
    print(
        f"\nfirst fire: imports {fire_modules} modules of the cold path (capture, wait-for graph, "
        f"diagnosis, the report's rendering) in {fire_import_s:.3f} s (a fresh interpreter with "
        "what the session had loaded when the test was armed); the watchdog loads it "
        "0.5 s before a test's first deadline, so it is not part of late s"
    )


if __name__ == "__main__":
    main()

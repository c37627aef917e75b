"""From the deadline to a complete report and a dead tree, for trees of 1, 4, 16 and 64 processes.

Each size runs a real pytest session whose test forks N sleeping Python children (like DataLoader
workers) and then waits on them; the JSON report of the hang records how long the capture and the
kill took. Run: ``python bench/bench_deadline.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from bench_jobs import pytest_command

TEST = textwrap.dedent(
    """
    import multiprocessing as mp
    import os
    import time

    N = int(os.environ["BENCH_TREE_SIZE"])


    def sleep_forever():
        time.sleep(1000)


    def test_tree():
        children = [mp.get_context("fork").Process(target=sleep_forever) for _ in range(N)]
        for child in children:
            child.start()
        for child in children:
            child.join()
    """
)


def main() -> None:
    sizes = [int(s) for s in sys.argv[1:]] or [1, 4, 16, 64]
    print(f"{'processes':>9} {'capture s':>10} {'kill s':>8} {'deadline to dead tree s':>24}")
    for size in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            (root / "test_tree.py").write_text(TEST)
            reports = root / "reports"
            subprocess.run(
                pytest_command(
                    "--torch-hang-timeout=4",
                    f"--torch-hang-report-dir={reports}",
                    "test_tree.py",
                ),
                cwd=root,
                env={**__import__("os").environ, "BENCH_TREE_SIZE": str(size)},
                capture_output=True,
                timeout=120,
                check=False,
            )
            (path,) = reports.glob("*.json")
            doc = json.loads(path.read_text())
            assert len(doc["processes"]) == size + 1, len(doc["processes"])
            total = doc["capture_s"] + doc["kill_s"]
            print(f"{size:9d} {doc['capture_s']:10.3f} {doc['kill_s']:8.3f} {total:24.3f}")


if __name__ == "__main__":
    main()

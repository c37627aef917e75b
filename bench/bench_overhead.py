"""Per-test overhead on 2,000 trivial passing tests: no plugin, pytest-timeout, pytest-torchhang.

Each configuration runs the same session several times (interleaved, so drift hits all alike);
the table shows the median session time and the cost per test against the no-plugin baseline.
Run: ``python bench/bench_overhead.py [tests] [repeats]``.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_jobs import pytest_command

CONFIGS = {
    "no plugin": ["-p", "no:torchhang", "-p", "no:timeout"],
    "pytest-timeout --timeout=60 (signal)": ["-p", "no:torchhang", "--timeout=60"],
    "pytest-timeout --timeout=60 (thread)": [
        "-p",
        "no:torchhang",
        "--timeout=60",
        "--timeout-method=thread",
    ],
    "pytest-torchhang, no timeout (inert)": ["-p", "no:timeout"],
    "pytest-torchhang --torch-hang-timeout=60": ["-p", "no:timeout", "--torch-hang-timeout=60"],
}


def main() -> None:
    tests = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "test_many.py").write_text(
            f"import pytest\n\n@pytest.mark.parametrize('i', range({tests}))\ndef test_it(i):\n    pass\n"
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_TORCH_HANG")}
        times: dict[str, list[float]] = {name: [] for name in CONFIGS}
        for _ in range(repeats):
            for name, args in CONFIGS.items():
                start = time.perf_counter()
                subprocess.run(
                    pytest_command(
                        *args,
                        "test_many.py",
                    ),
                    cwd=root,
                    env=env,
                    capture_output=True,
                    check=True,
                    timeout=600,
                )
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times["no plugin"])
    print(f"{tests} passing tests, median of {repeats} sessions each")
    print(f"{'configuration':44} {'session s':>10} {'per test ms':>12}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:44} {median:10.2f} {(median - base) / tests * 1000:12.3f}")


if __name__ == "__main__":
    main()

"""Resident memory the plugin adds to the pytest process, and what its zygote holds.

The pytest figures come from a session of 200 passing tests (one of them forks a child, so the
watchdog, the dump hook and the monitor are all running), measured at session end; the zygote's
from a Runner after one ``torch_hang.run``. Run: ``python bench/bench_memory.py``.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import psutil
from bench_jobs import pytest_command

CONFTEST = """
import os
import psutil

def pytest_sessionfinish(session):
    me = psutil.Process()
    with open(os.environ["BENCH_OUT"], "w") as out:
        out.write(f"{me.memory_info().rss} {me.memory_full_info().uss}")
"""

TESTS = """
import pytest
import subprocess
import sys

@pytest.mark.parametrize("i", range(200))
def test_it(i):
    if i == 0:
        subprocess.run([sys.executable, "-c", "pass"], check=True)
"""

CONFIGS = {
    "no plugin": ["-p", "no:torchhang"],
    "inert (no timeout)": [],
    "--torch-hang-timeout=60": ["--torch-hang-timeout=60"],
}


def mib(value: int) -> str:
    return f"{value / (1 << 20):8.1f}"


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "conftest.py").write_text(CONFTEST)
        (root / "test_mem.py").write_text(TESTS)
        out = root / "out"
        print(f"{'pytest process at session end':40} {'RSS MiB':>8} {'USS MiB':>8}")
        base_rss = 0
        for name, args in CONFIGS.items():
            env = {**os.environ, "BENCH_OUT": str(out)}
            subprocess.run(
                pytest_command(
                    *args,
                    "test_mem.py",
                ),
                cwd=root,
                env=env,
                capture_output=True,
                check=True,
                timeout=300,
            )
            rss, uss = map(int, out.read_text().split())
            if name == "no plugin":
                base_rss = rss
            extra = (
                "" if name == "no plugin" else f"  (+{(rss - base_rss) / (1 << 20):.1f} MiB RSS)"
            )
            print(f"{name:40} {mib(rss)} {mib(uss)}{extra}")

    from pytest_torchhang.fixtures import TorchHang
    from pytest_torchhang.runner import Runner

    runner = Runner()
    TorchHang(lambda: runner, "bench", None).run(os.getpid)
    zygote = psutil.Process(runner.zygote().pid).memory_full_info()
    monitor_like = psutil.Process().memory_info().rss
    print(f"\n{'zygote (torch imported, no op run)':40} {mib(zygote.rss)} {mib(zygote.uss)}")
    print(f"{'this bench process, for scale':40} {mib(monitor_like)}")
    runner.close()


if __name__ == "__main__":
    main()

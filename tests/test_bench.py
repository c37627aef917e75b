"""Every benchmark script still runs on today's code: each one, in its quick mode, exits 0,
prints its figures (a script that no longer ran left stale figures in the README; issue 10), and
every child it measured answered (a session that ran no test, a child that never reached its
blocking call: a figure standing on nothing; issue 21)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
#: Helper modules, not scripts.
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if not p.name.startswith("_"))
#: What some scripts' figures must include (substrings), besides a number: any other script
#: only has to exit 0 and print a figure.
EXPECTED = {
    "bench_overhead.py": ["CPU ms/test", "pytest-timeout", "guarding", "inert"],
    "bench_runner.py": ["torch_hang.run", "bare os.fork()", "run / bare fork", "distributed"],
    "bench_deadline.py": ["processes", "to test failed s", "first fire: imports"],
    "bench_startup.py": ["start-up:", "over pytest-timeout's one-test session", "imports:"],
    "bench_memory.py": ["RSS MiB", "monitor process", "zygote"],
    "profile_overhead.py": ["cum us/test", "--torch-hang-timeout=60", "inert"],
}
#: Scripts without a quick mode, run as they are: on a machine without a real GPU,
#: gpu_check.py says so and exits 0 (it belongs to the GPU checks, see docs/gpus.md).
NO_QUICK = {"gpu_check.py"}
_FIGURE = re.compile(r"\d+\.\d+")
#: what bench/_common.py prints at exit for the children a script asked for an answer
_CHILDREN = re.compile(r"^children answered: (\d+) of (\d+)$", re.M)


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_bench_script_runs_and_prints_its_figures(script: str) -> None:
    args = [] if script in NO_QUICK else ["--quick"]
    done = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        cwd=BENCH.parent,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    if script in NO_QUICK:
        return
    missing = [line for line in EXPECTED.get(script, []) if line not in done.stdout]
    assert not missing, f"{script} printed no {missing}:\n{output[-4000:]}"
    assert _FIGURE.search(done.stdout), f"{script} printed no figure:\n{output[-4000:]}"
    children = _CHILDREN.findall(done.stdout)
    assert children, f"{script} did not say whether its children answered:\n{output[-4000:]}"
    answered, asked = map(int, children[-1])
    assert answered == asked > 0, f"{script}: only {answered} of {asked} children answered"


def test_a_passing_guarded_session_imports_nothing_of_the_cold_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At session start and per test only the deadline model, the board and the ownership
    snapshot load; the capture, psutil, the diagnosis, the report's rendering and the runner
    load at the first fire (issue 16), so a session that captures nothing never pays for them."""
    monkeypatch.syspath_prepend(str(BENCH))
    import _common
    import bench_startup

    (tmp_path / "test_one.py").write_text(bench_startup.TEST)
    session = ["--torch-hang-timeout=60", "-p", "no:randomly", "test_one.py"]
    modules = _common.imported_modules(tmp_path, [*bench_startup.other_plugins(), *session])
    assert "pytest_torchhang.watchdog" in modules, "the test was not guarded"
    assert [m for m in modules if bench_startup.is_cold(m)] == []

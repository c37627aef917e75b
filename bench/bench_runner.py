"""Starting work in children, inside a test: ``torch_hang.run`` / ``.distributed`` vs the alternatives.

A generated pytest session (``--torch-hang-timeout`` set, as users run it) times, inside its
tests, calls that take turns with their alternative in one loop:

- ``torch_hang.run`` of a trivial function (default start method: a fork of the warm zygote)
  vs a bare ``os.fork()`` of a process prepared like the zygote (torch and the child module
  imported, no torch op run): the fork, the child's ``os._exit`` and the ``waitpid``, timed in
  that process, and the same with the request and the answer through a pipe, timed in the test;
- ``torch_hang.distributed(world_size=2)`` (gloo group set up and torn down) vs
  ``torch.multiprocessing.spawn`` of 2 ranks that set up and tear down a gloo group;
- with the full run only (``--quick`` leaves these out): the ``torch.multiprocessing.spawn``
  row, ``run`` with the spawn and forkserver start methods, a
  ``multiprocessing`` spawn ``Process``, and a fresh interpreter importing torch.

Each row is the median (and p90) over its calls, after one warm-up call (which starts the
zygote). Run: ``python bench/bench_runner.py [--calls N]``.
"""

from __future__ import annotations

import json
import tempfile
import textwrap
from pathlib import Path

from _common import OUT_ENV, machine, parser, run_session, table

# Like a user's test code, the module of the jobs imports torch: a spawned child imports it too.
JOBS = textwrap.dedent(
    """
    import torch  # noqa: F401


    def trivial(x=0):
        return x + 1


    def rank_noop(rank, world_size):
        return rank


    def spawn_rank(index, store):
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{store}", rank=index, world_size=2)
        dist.destroy_process_group()
    """
)

# A process prepared as the zygote is (torch and the runner's child module imported, no torch
# op run) that forks on request: the floor any fork-based runner can reach.
FORKER = textwrap.dedent(
    """
    import os
    import sys
    import time

    import torch  # noqa: F401
    import pytest_torchhang.runner.child  # noqa: F401

    print("READY", flush=True)
    for line in sys.stdin:
        start = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        print(f"{time.perf_counter() - start:.6f}", flush=True)
    """
)

CONFTEST = textwrap.dedent(
    f"""
    import json
    import os

    import pytest

    FIGURES = {{}}


    @pytest.fixture
    def figures():
        return FIGURES


    def pytest_unconfigure(config):
        with open(os.environ["{OUT_ENV}"], "w") as out:
            json.dump(FIGURES, out)
    """
)

TESTS = textwrap.dedent(
    """
    import multiprocessing
    import os
    import subprocess
    import sys
    import time

    import torch.multiprocessing

    import benchjobs

    CALLS = int(os.environ["BENCH_CALLS"])
    SLOW_CALLS = int(os.environ["BENCH_SLOW_CALLS"])
    FULL = os.environ["BENCH_FULL"] == "1"


    def timed(fn):
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1000


    def test_run_vs_bare_fork(torch_hang, figures):
        assert torch_hang.run(benchjobs.trivial, 1) == 2  # warm-up: starts the zygote
        forker = subprocess.Popen(
            [sys.executable, os.path.join(os.path.dirname(__file__), "forker.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert forker.stdout.readline() == "READY\\n"
        rows = {"run": [], "fork": [], "fork_pipe": []}

        def bare_fork():
            forker.stdin.write("go\\n")
            forker.stdin.flush()
            rows["fork"].append(float(forker.stdout.readline()) * 1000)

        bare_fork()  # warm-up
        rows["fork"].clear()
        for _ in range(CALLS):
            rows["run"].append(timed(lambda: torch_hang.run(benchjobs.trivial, 1)))
            rows["fork_pipe"].append(timed(bare_fork))
        forker.stdin.close()
        forker.wait()
        if FULL:
            for method in ("forkserver", "spawn"):
                torch_hang.run(benchjobs.trivial, 1, start_method=method)
                rows[f"run_{method}"] = [
                    timed(lambda: torch_hang.run(benchjobs.trivial, 1, start_method=method))
                    for _ in range(SLOW_CALLS)
                ]
        figures.update(rows)


    def test_distributed_vs_torch_spawn(torch_hang, tmp_path, figures):
        torch_hang.distributed(benchjobs.rank_noop, world_size=2)  # warm-up
        rows = {"distributed": [], "tmp_spawn": []} if FULL else {"distributed": []}
        for i in range(max(CALLS // 2, SLOW_CALLS if FULL else 0)):
            if i < CALLS // 2:
                rows["distributed"].append(
                    timed(lambda: torch_hang.distributed(benchjobs.rank_noop, world_size=2))
                )
            if i < SLOW_CALLS and FULL:
                store = str(tmp_path / f"store-{i}")
                rows["tmp_spawn"].append(
                    timed(lambda: torch.multiprocessing.spawn(benchjobs.spawn_rank, (store,), nprocs=2))
                )
        if FULL:
            spawn = multiprocessing.get_context("spawn")

            def mp_spawn():
                process = spawn.Process(target=benchjobs.trivial)
                process.start()
                process.join()

            def fresh():
                subprocess.run([sys.executable, "-c", "import torch"], check=True)

            rows["mp_spawn"] = [timed(mp_spawn) for _ in range(SLOW_CALLS)]
            rows["fresh"] = [timed(fresh) for _ in range(SLOW_CALLS)]
        figures.update(rows)
    """
)

LABELS = {
    "run": "torch_hang.run(trivial), zygote (default)",
    "fork": "bare os.fork() of a zygote-like process",
    "fork_pipe": "same, request and answer through a pipe",
    "run_forkserver": "torch_hang.run, start_method='forkserver'",
    "run_spawn": "torch_hang.run, start_method='spawn'",
    "distributed": "torch_hang.distributed(world_size=2), gloo",
    "tmp_spawn": "torch.multiprocessing.spawn, 2 ranks + gloo",
    "mp_spawn": "multiprocessing spawn Process(trivial), imports torch",
    "fresh": "fresh interpreter importing torch",
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[round(q * (len(ordered) - 1))]


def main() -> None:
    args = parser(__doc__)
    args.add_argument("--calls", type=int, help="Calls of the fast rows (default 40)")
    options = args.parse_args()
    calls = options.calls or (6 if options.quick else 40)
    slow_calls = 1 if options.quick else 5
    with tempfile.TemporaryDirectory(prefix="bench-runner-") as tmp:
        root = Path(tmp)
        (root / "benchjobs.py").write_text(JOBS)
        (root / "forker.py").write_text(FORKER)
        (root / "conftest.py").write_text(CONFTEST)
        (root / "test_runner.py").write_text(TESTS)
        session = run_session(
            root,
            ["-p", "no:timeout", "--torch-hang-timeout=300", "test_runner.py"],
            env={
                "BENCH_CALLS": str(calls),
                "BENCH_SLOW_CALLS": str(slow_calls),
                "BENCH_FULL": "0" if options.quick else "1",
            },
        )
    rows: dict[str, list[float]] = session.figures  # type: ignore[assignment]
    if "run" not in rows or "distributed" not in rows:
        raise RuntimeError(f"the session wrote no figures:\n{session.output[-3000:]}")
    print(f"inside a pytest session (--torch-hang-timeout=300); {machine()}")
    table(
        ["what", "median ms", "p90 ms", "calls"],
        [(LABELS[key], percentile(v, 0.5), percentile(v, 0.9), len(v)) for key, v in rows.items()],
        first=48,
    )
    med = {key: percentile(v, 0.5) for key, v in rows.items()}
    print(
        f"\nrun / bare fork: {med['run'] / med['fork']:.2f}x "
        f"(through a pipe: {med['run'] / med['fork_pipe']:.2f}x; goal: within 2x)"
    )
    if "tmp_spawn" in med:
        print(
            "torch.multiprocessing.spawn / distributed(2): "
            f"{med['tmp_spawn'] / med['distributed']:.1f}x"
        )
    if "mp_spawn" in med:
        print(f"multiprocessing spawn / run: {med['mp_spawn'] / med['run']:.0f}x")
    print(json.dumps({k: round(v, 2) for k, v in med.items()}))


if __name__ == "__main__":
    main()

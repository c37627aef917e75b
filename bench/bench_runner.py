"""Per-call cost of starting work in a child: torch_hang.run and .distributed vs the alternatives.

Prints a table (median and p90 of N calls, milliseconds). Run: ``python bench/bench_runner.py``.
Everything runs on this machine in one process, one method after the other.
"""

from __future__ import annotations

import multiprocessing
import statistics
import sys
import time
from collections.abc import Callable

import torch.multiprocessing as tmp
from bench_jobs import rank_noop, tmp_rank, trivial

from pytest_torchhang.fixtures import TorchHang
from pytest_torchhang.runner import Runner


def measure(fn: Callable[[], object], n: int, warmup: int = 1) -> tuple[float, float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    times.sort()
    return statistics.median(times), times[int(0.9 * (len(times) - 1))]


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    runner = Runner()
    hang = TorchHang(lambda: runner, "bench", None)
    spawn = multiprocessing.get_context("spawn")

    def mp_spawn() -> None:
        process = spawn.Process(target=trivial)
        process.start()
        process.join()

    def fresh() -> None:
        import subprocess

        subprocess.run([sys.executable, "-c", "import torch"], check=True)

    counter = iter(range(10**9))

    def tmp_spawn_2() -> None:
        store = f"{runner.workdir}/tmpstore-{next(counter)}"
        tmp.spawn(tmp_rank, args=(store,), nprocs=2)

    rows = [
        ("torch_hang.run, zygote (default)", lambda: hang.run(trivial, 1), n),
        ("torch_hang.run, forkserver", lambda: hang.run(trivial, 1, start_method="forkserver"), n),
        (
            "torch_hang.run, spawn",
            lambda: hang.run(trivial, 1, start_method="spawn"),
            max(3, n // 5),
        ),
        ("multiprocessing spawn Process", mp_spawn, max(3, n // 5)),
        ("fresh interpreter importing torch", fresh, max(3, n // 5)),
        (
            "torch_hang.distributed(world_size=2)",
            lambda: hang.distributed(rank_noop),
            max(5, n // 2),
        ),
        ("torch.multiprocessing.spawn, 2 ranks + gloo init", tmp_spawn_2, max(3, n // 5)),
    ]
    print(f"{'what':52} {'median ms':>10} {'p90 ms':>10} {'calls':>6}")
    results = {}
    for name, fn, calls in rows:
        median, p90 = measure(fn, calls)
        results[name] = median
        print(f"{name:52} {median:10.1f} {p90:10.1f} {calls:6d}")
    run = results["torch_hang.run, zygote (default)"]
    print(
        f"\nrun vs multiprocessing spawn: {results['multiprocessing spawn Process'] / run:.0f}x lower"
    )
    dist = results["torch_hang.distributed(world_size=2)"]
    print(
        f"distributed(2) vs torch.multiprocessing.spawn: {results['torch.multiprocessing.spawn, 2 ranks + gloo init'] / dist:.1f}x lower"
    )
    runner.close()


if __name__ == "__main__":
    main()

"""Capture cost: the wait-for graph and the whole capture, for a tree of 4 and of 64 processes.

The tree is real: children of this process with the plugin's start-up hook, blocked the ways
hangs block (a pipe read, a lock in a two-thread process, a file lock, a sleep). For each size it
times ``waitgraph.read`` (the kernel's evidence: syscalls, fds, sockets, maps, locks), the hint rules
over the graph, and ``hang.path.capture`` as a hang uses it (evidence, stacks by signal, facts,
flight-recorder requests, roles and hints); the issue's targets are capture plus graph under
0.3 s for 4 processes and under 1 s for 64. Run: ``python bench/bench_capture.py [--quick]``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import answered, machine, median, parser, spread, table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pytest_torchhang.capture import waitgraph  # noqa: E402
from pytest_torchhang.diagnosis import engine  # noqa: E402
from pytest_torchhang.hang import path as hang_path  # noqa: E402
from pytest_torchhang.inject.protocol import DUMP_DIR_ENV  # noqa: E402

CHILD = """
import fcntl, sys, threading, time
kind = int(sys.argv[1])
if kind == 0:
    sys.stdin.buffer.read()  # a pipe the bench holds the write end of
elif kind == 1:
    lock = threading.Lock(); lock.acquire()
    threading.Thread(target=lock.acquire, daemon=True).start()
    threading.Event().wait()
elif kind == 2:
    f = open(sys.argv[2]); fcntl.flock(f, fcntl.LOCK_EX)
    time.sleep(1000)
else:
    time.sleep(1000)
print("never", flush=True)
"""


def _tree(n: int, dump_dir: str, lock: str) -> list[subprocess.Popen[bytes]]:
    env = dict(os.environ)
    env[DUMP_DIR_ENV] = dump_dir
    inject = str(ROOT / "pytest_torchhang" / "inject" / "site")
    env["PYTHONPATH"] = os.pathsep.join([inject, str(ROOT), env.get("PYTHONPATH", "")])
    return [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(i % 4), lock], stdin=subprocess.PIPE, env=env
        )
        for i in range(n)
    ]


def _settle(children: list[subprocess.Popen[bytes]], timeout: float = 60.0) -> None:
    """Wait until every child has its dump handler and sits in its blocking call."""
    deadline = time.monotonic() + timeout
    for child in children:
        settled = False
        while not settled and time.monotonic() < deadline:
            task = waitgraph.read([child.pid]).members[child.pid].tasks
            settled = bool(task and task[0].call not in ("", "running") and _handler(child.pid))
            if not settled:
                time.sleep(0.02)
        answered(f"child {child.pid} (its dump handler, then its blocking call)", settled)


def _handler(pid: int) -> bool:
    from pytest_torchhang.capture.stacks import handles_signal
    from pytest_torchhang.inject.protocol import DUMP_SIGNAL

    return handles_signal(pid, DUMP_SIGNAL)


def measure(n: int, reps: int) -> dict[str, list[float]]:
    figures: dict[str, list[float]] = {
        "read": [],
        "hints": [],
        "capture": [],
        "stacks": [],
        "edges": [],
    }
    with tempfile.TemporaryDirectory() as dump_dir:
        lock = os.path.join(dump_dir, "lock")
        Path(lock).write_text("")
        children = _tree(n, dump_dir, lock)
        try:
            _settle(children)
            pids = [c.pid for c in children]
            for _ in range(reps):
                start = time.perf_counter()
                waitgraph.read([os.getpid(), *pids])
                figures["read"].append(time.perf_counter() - start)
                target = hang_path.CaptureTarget(
                    test_id="bench", timeout_s=1.0, root_pid=os.getpid(), dump_dir=dump_dir
                )
                start = time.perf_counter()
                report = hang_path.capture(target)
                figures["capture"].append(time.perf_counter() - start)
                start = time.perf_counter()
                engine.hints(report.processes)
                figures["hints"].append(time.perf_counter() - start)
                assert len(report.processes) >= n, report.headline
                figures["stacks"].append(sum(p.dump_status == "ok" for p in report.processes))
                figures["edges"].append(
                    sum(
                        len(t.waits_for)
                        for p in report.processes
                        for t in p.tasks
                        if t.tid == p.pid
                    )
                )
        finally:
            for child in children:
                child.kill()
                child.wait()
    return figures


def main() -> None:
    args = parser(__doc__).parse_args()
    reps = 1 if args.quick else 5
    print(machine())
    rows = []
    for n in (4, 64):
        figures = measure(n, reps)
        graph = [r + h for r, h in zip(figures["read"], figures["hints"], strict=True)]
        rows.append(
            [f"{n} processes: wait-for graph (read + hints), s", median(graph), spread(graph)]
        )
        rows.append(
            [
                f"{n} processes: whole capture, s",
                median(figures["capture"]),
                spread(figures["capture"]),
            ]
        )
        stacks, edges = int(median(figures["stacks"])), int(median(figures["edges"]))
        rows.append([f"{n} processes: stacks taken, main-thread edges", stacks, edges])
    table(["figure", "median", "min-max"], rows, first=52)
    print(
        "targets: capture plus graph under 0.3 s for 4 processes, under 1 s for 64; the whole "
        "capture includes its 0.1 s CPU sample"
    )


if __name__ == "__main__":
    main()

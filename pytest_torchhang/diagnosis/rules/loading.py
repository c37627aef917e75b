"""Rules for forked workers: a lock held at fork, OpenMP or CUDA after fork, a lock taken twice."""

from __future__ import annotations

import linecache
import os
import re

from ...report.model import Frame, Hint, ProcessReport
from ..frames import (
    all_frames,
    fork_parent,
    has_frame,
    in_file,
    innermost,
    is_library,
    main_thread,
)
from ..graph import blocked_line, main_task
from ..roles import is_worker

_BLOCKING_CALLS = (
    "sleep(",
    "acquire(",
    "join(",
    ".get(",
    "recv",
    "read(",
    "wait(",
    "select(",
    "accept(",
)


def _omp_stuck(proc: ProcessReport) -> bool:
    """Every thread waits on a futex or spins (libgomp after fork), from the kernel's view."""
    if not proc.tasks:
        return proc.num_threads == 1 and not is_worker(proc)
    calls = {t.call for t in proc.tasks}
    return proc.busy or calls <= {"futex", "sched_yield", "running"}


def hint_openmp_after_fork(procs: list[ProcessReport]) -> list[Hint]:
    """Forked children stuck in a C call straight from their code, every thread on a futex."""
    by_pid = {p.pid: p for p in procs}
    hits = [(proc.pid, hit) for proc in procs if (hit := _openmp_hit(proc, by_pid))]
    if not hits:
        return []
    return [
        Hint(
            f"{len(hits)} forked process(es) are stuck (blocked or spinning) in a C call made from "
            "their code (directly or through a torch wrapper), forked from a multi-threaded parent, with every thread of theirs waiting "
            "on a futex or spinning: if that call is a torch op, this is OpenMP after fork (the parent "
            "ran torch ops before forking; its thread pool does not survive fork). Call "
            "torch.set_num_threads(1) in the child before any op (a DataLoader does, unless "
            "worker_init_fn raises it again), or start it with spawn/forkserver.",
            # the graph's generic fact (nothing in the process can end the wait) is evidence
            # under this cause, not a hint of its own
            [hit for _, hit in hits] + [blocked_line(by_pid[pid]) for pid, _ in hits],
            rule="openmp_after_fork",
            pids=sorted({pid for pid, _ in hits}),
        )
    ]


def _openmp_hit(proc: ProcessReport, by_pid: dict[int, ProcessReport]) -> str:
    """The evidence that ``proc`` is stuck in OpenMP after fork, or nothing."""
    parent = fork_parent(proc, by_pid)
    main = main_thread(proc)
    if (
        parent is None
        or main is None
        or not main.frames
        or parent.num_threads < 2
        or not _omp_stuck(proc)
    ):
        return ""
    if proc.busy and not is_worker(proc):
        return ""  # a rank or child that computes spins like libgomp: only a worker's is telling
    top = main.frames[0]
    line = top.line
    if (is_library(top) and not _torch_op(top)) or not line:
        return ""
    if any(call in line for call in _BLOCKING_CALLS):
        return ""
    strict = is_worker(proc)  # their own loop sets 1 thread
    if not ("torch" in line or "@" in line or (not strict and "." in line)):
        return ""
    threads = (
        f"; its {len(proc.tasks)} thread(s): " + ", ".join(sorted({t.call for t in proc.tasks}))
        if proc.tasks
        else ""
    )
    caller = next((f for f in main.frames if not is_library(f)), None)
    called = (
        f", called from {caller.filename}:{caller.lineno}: {caller.line}"
        if caller and caller is not top
        else ""
    )
    return (
        f"{proc.role} (pid {proc.pid}), forked from pid {parent.pid} ({parent.num_threads} "
        f"threads), at {top.filename}:{top.lineno}: {line}{called}{threads}"
    )


#: torch's Python wrappers of its C ops (``F.interpolate``, ``Tensor.__matmul__``, a module's
#: forward): a stack whose innermost frame is one of them is in the op itself. Not the data
#: loading, distributed or multiprocessing code, which waits on purpose.
_TORCH_OP_FILES = (
    "torch/nn/functional.py",
    "torch/nn/modules/",
    "torch/functional.py",
    "torch/_tensor.py",
    "torchvision/transforms/",
)


def _torch_op(frame: Frame) -> bool:
    """The frame is a torch wrapper calling straight into a C op."""
    path = frame.filename.replace(os.sep, "/")
    return any(part in path for part in _TORCH_OP_FILES) and "torch" in frame.line


def hint_cuda_before_fork(procs: list[ProcessReport]) -> list[Hint]:
    """A process that uses CUDA, forked from a parent that had libcuda loaded (a captured fact)."""
    by_pid = {p.pid: p for p in procs}
    forked = [
        p
        for p in procs
        if (parent := fork_parent(p, by_pid)) is not None
        and parent.libcuda
        and any("torch/cuda" in f.filename for f in all_frames(p))
    ]
    hits = [f"{p.role} (pid {p.pid}), forked from pid {p.ppid}" for p in forked]
    if not hits:
        return []
    return [
        Hint(
            f"{len(hits)} process(es) use CUDA after being forked from a process that had initialised "
            "CUDA (libcuda is loaded in the parent): CUDA state does not survive fork. Start workers "
            "with spawn or forkserver, or initialise CUDA only in the children.",
            hits,
            rule="cuda_before_fork",
            pids=sorted({p.pid for p in forked}),
        )
    ]


def _source_mentions_lock(frame: Frame) -> bool:
    line = frame.line.lower()
    return "acquire" in line or ("with" in line and "lock" in line)


_LOCK_EXPR = re.compile(
    r"^\s*(?:with\s+([\w.\[\]()]+?)\s*(?:as\s+\w+\s*)?:|([\w.\[\]()]+?)\.acquire\()"
)


def _lock_expression(line: str) -> str | None:
    match = _LOCK_EXPR.match(line)
    return (match.group(1) or match.group(2)) if match else None


def _taken_twice(frame: Frame) -> bool:
    """Does the function already hold, on an enclosing line, the lock this line waits for?"""
    lines = linecache.getlines(frame.filename)[: frame.lineno]
    if not lines:
        return False
    expr = _lock_expression(lines[-1])
    if expr is None:
        return False
    indent = len(lines[-1]) - len(lines[-1].lstrip())
    for line in reversed(lines[:-1]):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        depth = len(line) - len(line.lstrip())
        if stripped.startswith(("def ", "async def ")) and depth < indent:
            return False  # reached the function's own line
        if depth < indent and _lock_expression(line) == expr:
            return True
    return False


def hint_worker_lock(procs: list[ProcessReport]) -> list[Hint]:
    """DataLoader workers waiting for a lock: held by a thread at fork, or taken twice."""
    by_pid = {p.pid: p for p in procs}
    at_fork: list[tuple[int, str]] = []
    twice: list[tuple[int, str]] = []
    for proc in procs:
        if not is_worker(proc) or proc.busy:
            continue
        if has_frame(proc, "multiprocessing/managers.py", "_callmethod"):
            continue  # a Manager lock: the Manager rule explains it
        task = main_task(proc)
        if task is not None and task.call and ("/dev/shm/" in task.obj or task.call != "futex"):
            continue  # a lock shared between processes (or no lock at all): the graph tells
        frame = innermost(
            proc,
            lambda f: (
                in_file(f, "logging/__init__.py", "acquire", "_acquireLock")
                or (not is_library(f) and _source_mentions_lock(f))
            ),
        )
        if frame is None:
            continue
        where = (
            f"{proc.role} (pid {proc.pid}) at {frame.filename}:{frame.lineno} in {frame.name}: "
            f"{frame.line}"
        )
        forked = fork_parent(proc, by_pid) is not None
        if not is_library(frame) and _taken_twice(frame):
            twice.append((proc.pid, where))
        elif forked:
            at_fork.append((proc.pid, where))
        else:
            twice.append((proc.pid, where))
    hints = []
    if at_fork:
        hints.append(
            Hint(
                f"{len(at_fork)} DataLoader worker(s) wait for a lock. A lock held by another thread "
                "when the workers were forked (a logging handler, a user lock, a library's global "
                "lock) stays locked forever in the child. Use multiprocessing_context='spawn' or "
                "'forkserver', or create the lock inside the worker (worker_init_fn).",
                [where for _, where in at_fork],
                rule="worker_lock",
                pids=sorted({pid for pid, _ in at_fork}),
            )
        )
    if twice:
        hints.append(
            Hint(
                f"{len(twice)} DataLoader worker(s) wait for a lock that nothing in the worker will "
                "release: a plain Lock acquired twice by one thread (use RLock), or a lock whose "
                "holder is itself blocked.",
                [where for _, where in twice],
                rule="worker_lock",
                pids=sorted({pid for pid, _ in twice}),
            )
        )
    return hints

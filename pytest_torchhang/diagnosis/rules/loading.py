"""Rules for forked workers: a lock at fork or taken twice, OpenMP or CUDA after fork, a bad batch."""

from __future__ import annotations

import linecache
import os
import re

from ...report.model import Frame, Hint, ProcessReport, TaskWait
from ...report.waits import Futex, Semaphore
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
    # a DataLoader worker's own loop sets 1 thread: a call on a tensor variable is telling
    # there only when a native thread (no Python stack: an OpenMP pool's) waits beside it
    native = len(proc.tasks) > len(proc.threads)
    strict = is_worker(proc) and not native
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


def _shared(task: TaskWait) -> bool:
    """The thread waits on a lock in shared memory (a multiprocessing one), not its own."""
    wait = task.wait
    return isinstance(wait, Semaphore) or (isinstance(wait, Futex) and "/dev/shm/" in wait.path)


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
        if task is not None and task.call and (_shared(task) or task.call != "futex"):
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


#: What a queue feeder thread prints when it cannot pickle what was put on its queue.
_PICKLE_ERROR = re.compile(
    r"^(TypeError: cannot pickle |TypeError: can't pickle |(_pickle\.|pickle\.)?PicklingError|"
    r"AttributeError: Can't pickle |AttributeError: Can't get local object)"
)


def _pickle_failure(proc: ProcessReport) -> str:
    """The last pickling error a queue feeder thread of ``proc`` printed on its stderr, or
    nothing (a traceback through multiprocessing's ``_feed``: the feeder dropped the object)."""
    tail = proc.stderr_tail
    for k in range(len(tail) - 1, -1, -1):
        if _PICKLE_ERROR.match(tail[k]):
            start = max((j for j in range(k) if tail[j].startswith("Traceback")), default=-1)
            if start >= 0 and any("multiprocessing/queues.py" in line for line in tail[start:k]):
                return tail[k]
    return ""


def _waits_for_batches(proc: ProcessReport) -> bool:
    """The process waits in a DataLoader for the next batch."""
    return has_frame(proc, "torch/utils/data/dataloader.py", "_try_get_data", "_get_data")


def hint_unpicklable_batch(procs: list[ProcessReport]) -> list[Hint]:
    """A DataLoader worker's feeder thread could not pickle a batch and dropped it, while the
    main process waits for that batch."""
    consumers = [p for p in procs if _waits_for_batches(p) and not p.exit_status]
    hits = [(p, error) for p in procs if is_worker(p) and (error := _pickle_failure(p))]
    if not consumers or not hits:
        return []
    # the worker made the batch and went back to its index queue: it is not busy elsewhere
    idle = [
        p
        for p, _ in hits
        if has_frame(p, "torch/utils/data/_utils/worker.py", "_worker_loop") and not p.busy
    ]
    if not idle:
        return []
    errors = sorted({error for _, error in hits})
    return [
        Hint(
            f"the DataLoader worker could not pickle the batch it made ({'; '.join(errors)}): "
            "its queue feeder thread printed the error on the worker's stderr and dropped the "
            "batch, so the main process waits for a batch that never comes. A sample holds "
            "something that cannot cross processes (an open file, a lock or a generator): return "
            "tensors, numbers or plain containers from __getitem__, or drop the rest in a "
            "collate_fn.",
            [f"{p.role} (pid {p.pid}) stderr: {error}" for p, error in hits]
            + [
                f"{p.role} (pid {p.pid}) is idle in _worker_loop, waiting on its index queue"
                for p in idle
            ]
            + [blocked_line(p) for p in consumers],
            rule="unpicklable_batch",
            pids=sorted({p.pid for p in consumers} | {p.pid for p in idle}),
        )
    ]

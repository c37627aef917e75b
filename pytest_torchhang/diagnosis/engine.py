"""Turn a tree of stacks into roles and plain-language hints; a hint is a hint, never a guess."""

from __future__ import annotations

import functools
import linecache
import os
import re
import sysconfig
from collections import Counter
from collections.abc import Callable

from ..report.model import Collective, Frame, Hint, ProcessReport, TaskWait, ThreadStack, WaitEdge

_STDLIB = os.path.realpath(sysconfig.get_paths()["stdlib"])
_COLLECTIVES = frozenset(
    [
        "all_reduce",
        "barrier",
        "broadcast",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "reduce",
        "gather",
        "scatter",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "all_to_all",
        "all_to_all_single",
        "send",
        "recv",
        "isend",
        "irecv",
        "monitored_barrier",
        "broadcast_object_list",
        "gather_object",
        "scatter_object_list",
        "batch_isend_irecv",
        "wait",
    ]
)
_RENDEZVOUS = frozenset(
    [
        "init_process_group",
        "_store_based_barrier",
        "rendezvous",
        "_create_c10d_store",
        "_env_rendezvous_handler",
        "_tcp_rendezvous_handler",
        "_file_rendezvous_handler",
    ]
)


def _is_library(frame: Frame) -> bool:
    path = frame.filename
    return (
        path.startswith("<")
        or "/pytest_torchhang/" in path.replace(os.sep, "/")
        or "site-packages" in path
        or "dist-packages" in path
        or os.path.realpath(path).startswith(_STDLIB)
    )


def _in(frame: Frame, path_suffix: str, *names: str) -> bool:
    return frame.filename.replace(os.sep, "/").endswith(path_suffix) and (
        not names or frame.name in names
    )


def _frames(proc: ProcessReport) -> list[Frame]:
    return [f for t in proc.threads for f in t.frames]


def _main_thread(proc: ProcessReport) -> ThreadStack | None:
    for thread in proc.threads:
        if thread.current or thread.name == "MainThread":
            return thread
    return proc.threads[0] if proc.threads else None


def _has(proc: ProcessReport, path_suffix: str, *names: str) -> bool:
    return any(_in(f, path_suffix, *names) for f in _frames(proc))


_CLASS_LINE = re.compile(r"^(\s*)class\s+([A-Za-z_]\w*)")


@functools.lru_cache(maxsize=256)
def _enclosing_class(filename: str, lineno: int) -> str:
    """The class whose body holds ``lineno``, by indentation (no ``ast``: see below).

    ``ast.parse`` must not run here: in CPython 3.11 the AST recursion counter is shared between
    threads, and parsing in the watchdog thread while the main thread compiles corrupts it.
    """
    lines = linecache.getlines(filename)[:lineno]
    if not lines:
        return ""
    target = lines[-1]
    indent = len(target) - len(target.lstrip())
    for line in reversed(lines[:-1]):
        match = _CLASS_LINE.match(line)
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "@")):
            continue
        depth = len(line) - len(line.lstrip())
        if depth < indent:
            if match and len(match.group(1)) == depth:
                return match.group(2)
            indent = depth
    return ""


def _dataset_name(proc: ProcessReport) -> str:
    for frame in _frames(proc):
        if frame.name in (
            "__getitem__",
            "__getitems__",
            "__iter__",
            "__next__",
        ) and not _is_library(frame):
            return _enclosing_class(frame.filename, frame.lineno)
    return ""


def _target_name(proc: ProcessReport) -> str:
    main = _main_thread(proc)
    if main is None:
        return ""
    frames = main.frames
    for i, frame in enumerate(frames):
        if _in(frame, "multiprocessing/process.py", "run") and i > 0:
            return frames[i - 1].name
    return ""


def _ordered(procs: list[ProcessReport]) -> list[ProcessReport]:
    return sorted(procs, key=lambda p: (-p.age_s, p.pid))  # oldest first: start order


_THREAD_ROLES: list[tuple[str, tuple[str, ...], str]] = [
    ("torch/utils/data/_utils/pin_memory.py", ("_pin_memory_loop",), "pin-memory thread"),
    ("multiprocessing/queues.py", ("_feed",), "queue feeder thread"),
    (
        "multiprocessing/pool.py",
        ("_handle_workers", "_handle_tasks", "_handle_results"),
        "Pool handler thread",
    ),
    (
        "multiprocessing/managers.py",
        ("serve_client", "handle_request", "accepter"),
        "Manager server thread",
    ),
    ("pytest_torchhang/watchdog.py", (), "torch-hang watchdog"),
    ("pytest_torchhang/processwide.py", ("serve",), "torch-hang launcher"),
    (
        "pytest_torchhang/inject/hook.py",
        ("_serve_collectives",),
        "torch-hang flight-recorder listener",
    ),
]


def label_roles(
    processes: list[ProcessReport], root_pid: int, env: dict[int, dict[str, str]], root_role: str
) -> None:
    """Give every process and notable thread a role, as specific as the stacks allow."""
    for proc in processes:
        for thread in proc.threads:
            for suffix, names, role in _THREAD_ROLES:
                if any(_in(f, suffix, *names) for f in thread.frames):
                    proc.thread_roles[thread.ident] = role
                    break
    workers: dict[int, list[ProcessReport]] = {}
    ranks: dict[int, list[ProcessReport]] = {}
    for proc in processes:
        if proc.pid == root_pid and not proc.role:
            proc.role = root_role
        elif proc.exit_status and not proc.role:
            proc.role = "exited child"  # a zombie: no stack, no environment, no command line
        elif proc.role:
            continue  # already known (a helper recognised by its command line)
        elif _has(proc, "torch/utils/data/_utils/worker.py", "_worker_loop"):
            workers.setdefault(proc.ppid, []).append(proc)
        elif "RANK" in env.get(proc.pid, {}):
            e = env[proc.pid]
            size = e.get("WORLD_SIZE", "?")
            proc.role = f"rank {e['RANK']}/{size}" + (
                f" ({e['TORCH_HANG_BACKEND']})" if e.get("TORCH_HANG_BACKEND") else ""
            )
        elif _has(proc, "torch/multiprocessing/spawn.py", "_wrap"):
            ranks.setdefault(proc.ppid, []).append(proc)
        elif _importing(proc) and "multiprocessing" in proc.cmdline:
            proc.role = "multiprocessing child (still starting: importing)"
        elif _has(proc, "multiprocessing/managers.py", "serve_forever"):
            proc.role = "Manager server"
        elif _has(proc, "multiprocessing/pool.py", "worker"):
            proc.role = "Pool worker"
        elif _has(proc, "multiprocessing/process.py", "_bootstrap"):
            target = _target_name(proc)
            proc.role = (
                f"multiprocessing.Process(target={target})" if target else "multiprocessing child"
            )
        elif proc.dump_status == "ok":
            proc.role = "Python child"
        else:
            proc.role = "child process"
    for group in workers.values():
        for k, proc in enumerate(_ordered(group)):
            dataset = _dataset_name(proc)
            proc.role = f"DataLoader worker {k}/{len(group)}" + (
                f" (dataset {dataset})" if dataset else ""
            )
    for group in ranks.values():
        for r, proc in enumerate(_ordered(group)):
            proc.role = f"rank {r}/{len(group)} (torch.multiprocessing.spawn)"
    for proc in processes:
        proc.stuck_at = stuck_at(proc)
        proc.busy = is_busy(proc)


def is_busy(proc: ProcessReport) -> bool:
    """CPU time grew while the stacks were taken, or the process runs and mostly has been running.

    The second test matters on a loaded machine, where a spinning process may get little CPU in
    the short capture window.
    """
    return proc.cpu_delta_s >= 0.02 or (proc.state == "running" and proc.cpu_s > 0.5 * proc.age_s)


_USER_FRAME_WINDOW = 6
HELPER_ROLES = ("Manager server", "resource_tracker", "forkserver", "torch_shm_manager", "zygote")


def _importing(proc: ProcessReport) -> bool:
    main = _main_thread(proc)
    return main is not None and any(
        f.filename == "<frozen importlib._bootstrap>" and f.name == "_find_and_load"
        for f in main.frames
    )


def _hint_still_starting(procs: list[ProcessReport]) -> list[Hint]:
    starting = [
        p
        for p in procs
        if p.role != "pytest" and not p.role.startswith("pytest ") and _importing(p)
    ]
    if not starting:
        return []
    oldest = max(p.age_s for p in starting)
    return [
        Hint(
            f"{len(starting)} process(es) are still starting up, importing modules {oldest:.1f}s after "
            "they were started: the deadline may be shorter than their start-up (spawn and forkserver "
            "children import the test module, and torch, anew). Raise the timeout, start them with "
            "fork, or preload heavy modules in the forkserver (set_forkserver_preload).",
            [
                f"{p.role} (pid {p.pid}), age {p.age_s:.1f}s, importing in {p.stuck_at}"
                for p in starting
            ],
        )
    ]


def stuck_at(proc: ProcessReport) -> str:
    """Where the process's main thread waits: its innermost frame in user code, else the innermost."""
    main = _main_thread(proc)
    if main is None or not main.frames:
        return ""
    if any(_in(f, "multiprocessing/util.py", "_exit_function") for f in main.frames) and any(
        _in(f, "multiprocessing/queues.py", "_finalize_join", "join_thread") for f in main.frames
    ):
        return "exit (flushing a multiprocessing Queue)"
    # The innermost frame of user code, when it is close to the top: deeper than that (a fork child
    # still shows its parent's frames far below) the library call it is in says more.
    user = next((f for f in main.frames[:_USER_FRAME_WINDOW] if not _is_library(f)), None)
    frame = user or main.frames[0]
    return frame.name


def _role_kind(role: str) -> str:
    words = []
    for word in role.split():
        if any(c.isdigit() for c in word) or word.startswith("("):
            break
        words.append(word)
    return " ".join(words) or role


def headline(test_id: str, elapsed: float, processes: list[ProcessReport], root_pid: int) -> str:
    """``HANG after 8.0s in test_x: 3 processes, 2 stuck in DataLoader worker __getitem__``."""
    live = len([p for p in processes if not p.exit_status])
    head = f"HANG after {elapsed:.1f}s in {test_id}: {live} process{'es' if live != 1 else ''}"
    # helpers wait by design: they name the hang only when nothing else does
    others = [
        p
        for p in processes
        if p.pid != root_pid
        and p.stuck_at
        and not p.role.startswith(HELPER_ROLES)
        and not p.exit_status
    ]
    if not others:
        root = next((p for p in processes if p.pid == root_pid), None)
        return head + (f", stuck in {root.stuck_at}" if root and root.stuck_at else "")
    groups = Counter((_role_kind(p.role), p.stuck_at) for p in others)
    (kind, where), count = groups.most_common(1)[0]
    return f"{head}, {count} stuck in {kind} {where}"


# --- hints ---------------------------------------------------------------------------------------


def _innermost(proc: ProcessReport, pred: Callable[[Frame], bool]) -> Frame | None:
    main = _main_thread(proc)
    return next((f for f in main.frames if pred(f)), None) if main else None


def pending_collective(proc: ProcessReport) -> Collective | None:
    """The rank's oldest flight-recorder entry that has not completed: where it waits."""
    return next((c for c in proc.collectives if not c.completed), None)


def _last_completed(proc: ProcessReport) -> Collective | None:
    done = [c for c in proc.collectives if c.completed]
    return done[-1] if done else None


def _in_backward(proc: ProcessReport) -> bool:
    return _innermost(proc, lambda f: _in(f, "torch/autograd/__init__.py", "backward")) is not None


def _collective(proc: ProcessReport) -> str | None:
    """The collective (or rendezvous) a rank waits in: the flight recorder's, else its frames'."""
    pending = pending_collective(proc)
    frame_name = _frame_collective(proc)
    if pending is not None and frame_name not in _RENDEZVOUS:
        return pending.name
    if frame_name is None and _in_backward(proc):
        return "backward"  # DDP all-reduces gradients in backward; no flight recorder to say so
    return frame_name


def _frame_collective(proc: ProcessReport) -> str | None:
    frame = _innermost(
        proc,
        lambda f: (
            _in(f, "torch/distributed/distributed_c10d.py") and f.name in _COLLECTIVES | _RENDEZVOUS
        ),
    )
    return frame.name if frame else None


def _rank_no(proc: ProcessReport) -> str:
    return proc.role.split()[1] if proc.role.startswith("rank ") else str(proc.pid)


def _fr_detail(ranks: list[ProcessReport]) -> str:
    """``rank 0/2 is in #12 all_reduce([1024]) (from DDP's backward); rank 1/2 completed #11 ...``."""
    parts = []
    for proc in ranks:
        pending, done = pending_collective(proc), _last_completed(proc)
        if pending is None and done is None:
            continue
        words = [f"rank {_rank_no(proc)}"]
        if done is not None:
            words.append(f"completed {done.label()}")
        if pending is not None:
            words.append(("and " if done is not None else "") + f"is in {pending.label()}")
            if _in_backward(proc):
                words.append("(from DDP's backward)")
            elif _has(proc, "torch/nn/parallel/distributed.py", "forward", "_pre_forward"):
                words.append("(from DDP's forward)")
        parts.append(" ".join(words))
    return "; ".join(parts)


def _collective_words(name: str | None) -> str:
    return "backward (DDP's gradient all_reduce)" if name == "backward" else str(name)


def _hint_collectives(procs: list[ProcessReport]) -> list[Hint]:
    # a process in a rendezvous is a rank, whatever started it (a plain Process, a Popen)
    ranks = [
        p
        for p in procs
        if (p.role.startswith("rank ") or _frame_collective(p) in _RENDEZVOUS) and not p.exit_status
    ]
    if not ranks:
        return []
    where = {_rank_no(p): _collective(p) for p in ranks}
    waiting = {r: c for r, c in where.items() if c and c not in _RENDEZVOUS}
    rendezvous = {r: c for r, c in where.items() if c in _RENDEZVOUS}
    based = [
        f"{p.role} (pid {p.pid}) in {_collective_words(where[_rank_no(p)]) if where[_rank_no(p)] else p.stuck_at}"
        for p in ranks
    ]
    based += [
        f"rank {_rank_no(p)} (pid {p.pid}) flight recorder: "
        + ", ".join(
            f"{c.label()} {'completed' if c.completed else 'pending'}" for c in p.collectives[-3:]
        )
        for p in ranks
        if p.collectives
    ]
    detail = _fr_detail(ranks)
    detail = f" Flight recorder: {detail}." if detail else ""
    hints = []
    if rendezvous and not waiting:
        hints.append(
            Hint(
                f"{len(rendezvous)} rank(s) wait in the process-group rendezvous "
                f"({', '.join(sorted(set(rendezvous.values())))}) and {len(ranks)} rank(s) were started: "
                "the other ranks of the world never arrived (world_size larger than the ranks "
                "launched, a rank that crashed before init, or another store/MASTER_ADDR/port). "
                "Start exactly world_size ranks on one rendezvous.",
                based,
            )
        )
    elif len(set(waiting.values())) > 1:
        pairs = ", ".join(f"rank {r} in {_collective_words(c)}" for r, c in sorted(waiting.items()))
        hints.append(
            Hint(
                f"ranks wait in different collectives ({pairs}): every rank must call the same "
                "collectives in the same order; look for a rank-dependent branch before them (uneven "
                "inputs, a layer used on one rank only, an early exit)." + detail,
                based,
            )
        )
    elif waiting and len(waiting) == len(ranks) and set(waiting.values()) <= {"recv", "irecv"}:
        hints.append(
            Hint(
                f"all {len(ranks)} ranks wait in recv and none sends: every recv needs a matching "
                "send on its source rank (look for a rank-dependent branch that swapped a send "
                "for a recv, or the wrong src/dst)." + detail,
                based,
            )
        )
    elif waiting and len(waiting) < len(ranks):
        by_pid = {p.pid: p for p in procs}
        missing, cycles = [], []
        for proc in ranks:
            if where[_rank_no(proc)]:
                continue
            missing.append(f"rank {_rank_no(proc)} at {proc.stuck_at}")
            task = _main_task(proc)
            if task is None:
                continue
            for edge in task.waits_for:
                other = by_pid.get(edge.pid)
                if other is not None and other in ranks and where[_rank_no(other)]:
                    cycles.append(
                        f"rank {_rank_no(proc)} {_doing(proc)} for rank {_rank_no(other)} "
                        f"({edge.via}), which waits in {_collective_words(_collective(other))} "
                        f"for rank {_rank_no(proc)}: a cycle"
                    )
                    based.append(
                        f"rank {_rank_no(proc)} (pid {proc.pid}) blocked in {task.summary()}"
                    )
                    break
        coll = _collective_words(next(iter(waiting.values())))
        hints.append(
            Hint(
                f"{len(waiting)} rank(s) wait in {coll} for a rank that is not in a collective "
                f"({', '.join(missing)}): that rank skipped the call or is stuck before it."
                + (f" {'; '.join(cycles)}." if cycles else "")
                + detail,
                based,
            )
        )
    return hints


def _world_size(proc: ProcessReport) -> int | None:
    try:
        return int(proc.role.split()[1].split("/")[1])
    except (IndexError, ValueError):
        return None


def _hint_rank_gone(procs: list[ProcessReport]) -> list[Hint]:
    ranks = [p for p in procs if p.role.startswith("rank ")]
    sizes = {_world_size(p) for p in ranks} - {None}
    if not ranks or len(sizes) != 1:
        return []
    size = sizes.pop()
    assert size is not None
    present = {_rank_no(p).split("/")[0] for p in ranks}
    missing = sorted(set(map(str, range(size))) - present, key=int)
    waiting = [p for p in ranks if _collective(p)]
    if not missing or not waiting:
        return []
    where = ", ".join(f"rank {_rank_no(p)} waits in {_collective(p)}" for p in waiting)
    return [
        Hint(
            f"rank(s) {', '.join(missing)} of {size} are no longer running (they returned, exited or "
            f"crashed) while {where}: a rank that leaves early, or dies, leaves its peers waiting; "
            "look at how that rank ended (its exception or exit code, or an OOM kill).",
            [f"{p.role} (pid {p.pid}) in {_collective(p)}" for p in waiting],
        )
    ]


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


def _fork_parent(proc: ProcessReport, by_pid: dict[int, ProcessReport]) -> ProcessReport | None:
    """The parent ``proc`` was forked from (without exec): same command line, in the tree."""
    parent = by_pid.get(proc.ppid)
    return parent if parent is not None and parent.cmdline == proc.cmdline else None


def _omp_stuck(proc: ProcessReport) -> bool:
    """Every thread waits on a futex or spins (libgomp after fork), from the kernel's view."""
    if not proc.tasks:
        return proc.num_threads == 1 and not proc.role.startswith("DataLoader worker")
    calls = {t.call for t in proc.tasks}
    return proc.busy or calls <= {"futex", "sched_yield", "running"}


def _hint_openmp_after_fork(procs: list[ProcessReport]) -> list[Hint]:
    by_pid = {p.pid: p for p in procs}
    hits = []
    for proc in procs:
        parent = _fork_parent(proc, by_pid)
        main = _main_thread(proc)
        if (
            parent is None
            or main is None
            or not main.frames
            or parent.num_threads < 2
            or not _omp_stuck(proc)
        ):
            continue
        top = main.frames[0]
        line = top.line
        if _is_library(top) or not line or any(call in line for call in _BLOCKING_CALLS):
            continue
        strict = proc.role.startswith("DataLoader worker")  # their own loop sets 1 thread
        if "torch" in line or "@" in line or (not strict and "." in line):
            hits.append(
                f"{proc.role} (pid {proc.pid}), forked from pid {parent.pid} ({parent.num_threads} threads), "
                f"at {top.filename}:{top.lineno}: {line}"
                + (
                    f"; its {len(proc.tasks)} thread(s): "
                    + ", ".join(sorted({t.call for t in proc.tasks}))
                    if proc.tasks
                    else ""
                )
            )
    if not hits:
        return []
    return [
        Hint(
            f"{len(hits)} forked process(es) are stuck (blocked or spinning) in a C call made straight "
            "from their code, forked from a multi-threaded parent, with every thread of theirs waiting "
            "on a futex or spinning: if that call is a torch op, this is OpenMP after fork (the parent "
            "ran torch ops before forking; its thread pool does not survive fork). Call "
            "torch.set_num_threads(1) in the child before any op (a DataLoader does, unless "
            "worker_init_fn raises it again), or start it with spawn/forkserver.",
            hits,
        )
    ]


def _maps_cuda(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as maps:
            return any("libcuda.so" in line for line in maps)
    except OSError:
        return False


def _hint_cuda_before_fork(procs: list[ProcessReport]) -> list[Hint]:
    by_pid = {p.pid: p for p in procs}
    hits = [
        f"{p.role} (pid {p.pid}), forked from pid {p.ppid}"
        for p in procs
        if (parent := _fork_parent(p, by_pid)) is not None
        and _maps_cuda(parent.pid)
        and any("torch/cuda" in f.filename for f in _frames(p))
    ]
    if not hits:
        return []
    return [
        Hint(
            f"{len(hits)} process(es) use CUDA after being forked from a process that had initialised "
            "CUDA (libcuda is loaded in the parent): CUDA state does not survive fork. Start workers "
            "with spawn or forkserver, or initialise CUDA only in the children.",
            hits,
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


def _hint_worker_lock(procs: list[ProcessReport]) -> list[Hint]:
    by_pid = {p.pid: p for p in procs}
    at_fork, twice = [], []
    for proc in procs:
        if not proc.role.startswith("DataLoader worker") or proc.busy:
            continue
        if _has(proc, "multiprocessing/managers.py", "_callmethod"):
            continue  # a Manager lock: the Manager rule explains it
        task = _main_task(proc)
        if task is not None and task.call and ("/dev/shm/" in task.obj or task.call != "futex"):
            continue  # a lock shared between processes (or no lock at all): the graph tells
        frame = _innermost(
            proc,
            lambda f: (
                _in(f, "logging/__init__.py", "acquire", "_acquireLock")
                or (not _is_library(f) and _source_mentions_lock(f))
            ),
        )
        if frame is None:
            continue
        where = f"{proc.role} (pid {proc.pid}) at {frame.filename}:{frame.lineno} in {frame.name}: {frame.line}"
        forked = _fork_parent(proc, by_pid) is not None
        if not _is_library(frame) and _taken_twice(frame):
            twice.append(where)
        elif forked:
            at_fork.append(where)
        else:
            twice.append(where)
    hints = []
    if at_fork:
        hints.append(
            Hint(
                f"{len(at_fork)} DataLoader worker(s) wait for a lock. A lock held by another thread "
                "when the workers were forked (a logging handler, a user lock, a library's global "
                "lock) stays locked forever in the child. Use multiprocessing_context='spawn' or "
                "'forkserver', or create the lock inside the worker (worker_init_fn).",
                at_fork,
            )
        )
    if twice:
        hints.append(
            Hint(
                f"{len(twice)} DataLoader worker(s) wait for a lock that nothing in the worker will "
                "release: a plain Lock acquired twice by one thread (use RLock), or a lock whose "
                "holder is itself blocked.",
                twice,
            )
        )
    return hints


def _hint_queue_join(procs: list[ProcessReport]) -> list[Hint]:
    flushing = [
        p
        for p in procs
        if _has(p, "multiprocessing/queues.py", "_finalize_join", "join_thread")
        or (
            _has(p, "multiprocessing/util.py", "_exit_function")
            and _has(p, "multiprocessing/queues.py")
        )
    ]
    joining = [
        p
        for p in procs
        if _has(p, "multiprocessing/popen_fork.py", "wait", "poll")
        or _has(p, "multiprocessing/process.py", "join")
    ]
    if not flushing or not joining:
        return []
    return [
        Hint(
            f"{', '.join(f'pid {p.pid}' for p in joining)} joins a process that cannot exit until its "
            "multiprocessing Queue is flushed: a child that put data on a Queue waits at exit for the "
            "data to be read. Drain the queue (get() every item) before join().",
            [f"{p.role} (pid {p.pid}) flushing its queue at exit" for p in flushing]
            + [f"{p.role} (pid {p.pid}) in join" for p in joining],
        )
    ]


def _hint_manager(procs: list[ProcessReport]) -> list[Hint]:
    clients = [p for p in procs if _has(p, "multiprocessing/managers.py", "_callmethod")]
    if not clients:
        return []
    servers = [p for p in procs if p.role == "Manager server"]
    # A server thread whose innermost Python frame is serve_client itself is inside a C call made
    # for a client (Lock.acquire, Event.wait, ...): that call blocks every proxy waiting on it.
    blocked = [
        f"Manager server (pid {s.pid}) thread {t.ident} in {t.frames[0].name}: {t.frames[0].line}"
        for s in servers
        for t in s.threads
        if t.frames
        and (
            _in(t.frames[0], "multiprocessing/managers.py", "serve_client")
            or t.frames[0].name in ("acquire", "wait", "__enter__")
        )
    ]
    if blocked:
        text = (
            f"{len(clients)} process(es) wait on a Manager proxy call while the Manager server is "
            "blocked serving it (a Lock/Condition/Event acquired through the Manager and never "
            "released): release it in a finally block, or use a timeout."
        )
    elif not servers:
        text = (
            f"{len(clients)} process(es) wait on a Manager proxy whose server is not in the tree "
            "(gone or never started): keep the Manager alive while proxies are in use."
        )
    else:
        text = f"{len(clients)} process(es) wait for an answer from the Manager server."
    return [Hint(text, [f"{p.role} (pid {p.pid}) in _callmethod" for p in clients] + blocked)]


# --- the wait-for graph --------------------------------------------------------------------------
#
# Every process report carries its kernel threads (``tasks``), each with the system call it was
# blocked in and its edges: "this thread waits for process P (through object O)". The rules
# below read those edges, and name the primitive from the Python frames of the same thread.

_SLEEP_CALLS = ("nanosleep", "clock_nanosleep", "pause", "rt_sigsuspend", "rt_sigtimedwait")
_PLUGIN = "pytest_torchhang/"


def _task_thread(proc: ProcessReport, task: TaskWait) -> ThreadStack | None:
    return next((t for t in proc.threads if t.ident == task.python_thread), None)


def _main_task(proc: ProcessReport) -> TaskWait | None:
    main = _main_thread(proc)
    if main is not None:
        task = next((t for t in proc.tasks if t.python_thread == main.ident), None)
        if task is not None:
            return task
    return next((t for t in proc.tasks if t.tid == proc.pid), None)


def _ignored(proc: ProcessReport, task: TaskWait) -> bool:
    """Threads that release nothing of the test's: the plugin's own (watchdog, monitor), native
    threads that were there before the test began, and, in the pytest process, Python threads
    from before the test that are not running (an earlier test's leftovers: they cannot know the
    pipes and locks this test created)."""
    thread = _task_thread(proc, task)
    if thread is not None and any(_PLUGIN in f.filename for f in thread.frames[:3]):
        return True
    if not task.before_test:
        return False
    if thread is None:  # a library's native thread (gloo, OpenMP) of an earlier test
        return bool(proc.threads)
    return _is_pytest(proc) and task.call != "running" and task.state != "R"


#: Libraries that wait with a timeout of their own choosing, only to check for errors, and
#: then wait again (DataLoader's ``_try_get_data``, a Pool's handler threads, a rank's store).
_RETRY_LOOPS = (
    "torch/utils/data/",
    "torch/distributed/",
    "multiprocessing/pool.py",
    "multiprocessing/managers.py",
    "multiprocessing/queues.py",
    "multiprocessing/resource_sharer.py",
)


def _user_timeout(proc: ProcessReport, task: TaskWait) -> bool:
    """A timed wait whose timeout the user chose (``event.wait(1)`` in a loop of theirs): the
    thread wakes up and may do what others wait for. Not a library's error-checking loop."""
    thread = _task_thread(proc, task)
    if thread is None:
        return False  # native threads (gloo, OpenMP) poll with timeouts to check for shutdown
    paths = [f.filename.replace(os.sep, "/") for f in thread.frames]
    return not any(loop in path for path in paths for loop in _RETRY_LOOPS)


def _kind(proc: ProcessReport, task: TaskWait) -> str:
    """stopped, dead, running, sleeping, blocked (edges in the tree), outside or unknown."""
    if proc.exit_status:
        return "dead"
    if proc.state.startswith("stopped") or task.state in ("T", "t"):
        return "stopped"
    if task.call == "running" or task.state == "R":
        return "running"
    if task.call in _SLEEP_CALLS:
        return "sleeping"
    if task.timed and _user_timeout(proc, task):
        return "sleeping"  # it wakes up by itself, and may then do what others wait for
    if not task.waits_for:
        return "unknown"
    if any(e.pid < 0 for e in task.waits_for):
        return "outside"
    return "blocked"


_PRIMITIVES: list[tuple[str, tuple[str, ...], str]] = [
    (
        "torch/utils/data/dataloader.py",
        ("_try_get_data", "_get_data"),
        "DataLoader's _try_get_data",
    ),
    ("concurrent/futures/_base.py", ("result",), "Future.result()"),
    ("concurrent/futures/_base.py", ("wait", "as_completed"), "concurrent.futures.wait()"),
    ("multiprocessing/pool.py", ("map", "starmap"), "Pool.map()"),
    ("multiprocessing/pool.py", ("get",), "AsyncResult.get()"),
    ("multiprocessing/pool.py", ("join",), "Pool.join()"),
    ("multiprocessing/managers.py", ("_callmethod",), "a Manager proxy call"),
    ("multiprocessing/queues.py", ("get",), "multiprocessing Queue.get()"),
    ("multiprocessing/queues.py", ("put",), "multiprocessing Queue.put()"),
    ("multiprocessing/synchronize.py", ("wait",), "multiprocessing {cls}.wait()"),
    ("multiprocessing/synchronize.py", ("__enter__", "acquire"), "multiprocessing {cls}.acquire()"),
    ("multiprocessing/connection.py", ("recv", "recv_bytes", "poll"), "Connection.{name}()"),
    ("multiprocessing/connection.py", ("send", "send_bytes"), "Connection.{name}()"),
    ("multiprocessing/popen_fork.py", ("wait", "poll"), "Process.join()"),
    ("multiprocessing/process.py", ("join",), "Process.join()"),
    ("subprocess.py", ("communicate",), "Popen.communicate()"),
    ("subprocess.py", ("wait",), "Popen.wait()"),
    ("queue.py", ("get", "put", "join"), "queue.Queue.{name}()"),
    ("threading.py", ("wait", "wait_for"), "{cls}.wait()"),
    ("threading.py", ("join",), "Thread.join()"),
    ("torch/distributed/distributed_c10d.py", tuple(_COLLECTIVES | _RENDEZVOUS), "{name}"),
]


def primitive(thread: ThreadStack | None) -> tuple[str, Frame | None]:
    """What the thread waits in, in the user's terms, and the user's frame that called it.

    ``("Event.wait()", Frame(dataset.py:31))``: the library call nearest to the user's code wins
    (the user called Event.wait, which called Condition.wait).
    """
    if thread is None or not thread.frames:
        return "", None
    frames = thread.frames
    user = next((i for i, f in enumerate(frames) if not _is_library(f)), len(frames))
    for frame in reversed(frames[:user]):
        for suffix, names, label in _PRIMITIVES:
            if _in(frame, suffix) and frame.name in names:
                cls = _enclosing_class(frame.filename, frame.lineno) or "Condition"
                cls = "Lock" if cls == "SemLock" else cls
                return label.format(cls=cls, name=frame.name), (
                    frames[user] if user < len(frames) else None
                )
    if user < len(frames):
        frame = frames[user]
        line = frame.line
        if "acquire(" in line or ("with " in line and "lock" in line.lower()):
            return "Lock.acquire()", frame
        if "sleep(" in line:
            return "time.sleep()", frame
        if user == 0 and line:
            return f"`{line}`", frame  # a C call made straight from user code
    return "", frames[user] if user < len(frames) else None


def _at(frame: Frame | None) -> str:
    return f" at {os.path.basename(frame.filename)}:{frame.lineno}" if frame else ""


def _who(proc: ProcessReport) -> str:
    return f"{proc.role} (pid {proc.pid})"


def _doing(proc: ProcessReport) -> str:
    """``waits in Event.wait() at ds.py:12``, ``is stopped``: what a process does, in a phrase."""
    if proc.exit_status:
        return f"{proc.exit_status} (not reaped yet)"
    if proc.state.startswith("stopped"):
        return "is stopped"
    if proc.busy:
        return f"is running (+{proc.cpu_delta_s:.2f}s CPU during the capture) in {proc.stuck_at}"
    task = _main_task(proc)
    thread = _task_thread(proc, task) if task else _main_thread(proc)
    name, frame = primitive(thread or _main_thread(proc))
    if task is not None and task.call in _SLEEP_CALLS:
        return f"sleeps{_at(frame)}" + (f" in {name}" if name and "sleep" not in name else "")
    if name:
        return f"waits in {name}{_at(frame)}"
    call = _call_phrase(task)
    if call:
        return f"{call}{_at(frame)}"
    return f"waits in {proc.stuck_at}" if proc.stuck_at else "waits"


_WRITES = ("write", "writev", "sendto", "sendmsg")
_READS = ("read", "readv", "recvfrom", "recvmsg")


def _call_phrase(task: TaskWait | None) -> str:
    """The blocked system call in words, when the Python frames name no primitive."""
    if task is None or not task.obj:
        return ""
    if task.call in _WRITES:
        return f"is blocked writing to {task.obj} (the pipe or socket is full)"
    if task.call in _READS:
        return f"is blocked reading {task.obj}"
    if task.call in ("flock", "fcntl"):
        return f"waits for a {task.obj}"
    if task.call in ("wait4", "waitid"):
        return task.obj
    return ""


def _edges_to(procs: list[ProcessReport], target: int) -> list[tuple[ProcessReport, WaitEdge]]:
    """(waiter, edge) for every process with a Python-visible thread that waits for ``target``."""
    out = []
    for proc in procs:
        if proc.pid == target:
            continue
        for task in proc.tasks:
            if _ignored(proc, task):
                continue
            edge = next((e for e in task.waits_for if e.pid == target), None)
            if edge is not None and (task.python_thread or not proc.threads):
                out.append((proc, edge))
                break
    return out


def _waiters_text(waiters: list[tuple[ProcessReport, WaitEdge]]) -> str:
    return "; ".join(f"{_who(p)} {_doing(p)}, through {e.via}" for p, e in waiters)


def _edge_lines(waiters: list[tuple[ProcessReport, WaitEdge]], target: ProcessReport) -> list[str]:
    return [f"{_who(p)} waits for pid {target.pid}: {e.via}" for p, e in waiters]


def _hint_stopped(procs: list[ProcessReport]) -> list[Hint]:
    hints = []
    for proc in procs:
        if not proc.state.startswith("stopped"):
            continue
        main = _main_thread(proc)
        _name, frame = primitive(main)
        where = f" in {proc.stuck_at}{_at(frame)}" if proc.stuck_at else ""
        waiters = _edges_to(procs, proc.pid)
        text = (
            f"{_who(proc)} is stopped (SIGSTOP or SIGTSTP, or a debugger holds it){where}: it "
            "does nothing until it gets SIGCONT, and whatever waits for it waits forever. Look for "
            "what stopped it (a kill -STOP, a job-control signal, a tracer)."
        )
        if waiters:
            text += f" Waiting for it: {_waiters_text(waiters)}."
        hints.append(
            Hint(
                text,
                [
                    f"pid {proc.pid} was in state T (stopped) in /proc/{proc.pid}/stat, "
                    "read before the capture continued it",
                    *_edge_lines(waiters, proc),
                ],
                rule="stopped",
                pids=[proc.pid] + [p.pid for p, _ in waiters],
            )
        )
    return hints


def _hint_dead(procs: list[ProcessReport]) -> list[Hint]:
    hints = []
    by_pid = {p.pid: p for p in procs}
    for proc in procs:
        if not proc.exit_status:
            continue
        parent = by_pid.get(proc.ppid)
        waiters = _edges_to(procs, proc.pid)
        ranks = [p for p in procs if _collective(p)]  # in a rendezvous or a collective
        text = (
            f"{proc.role or 'a child'} (pid {proc.pid}"
            + (f", child of {_who(parent)}" if parent else "")
            + f") {proc.exit_status} before the deadline and was not reaped yet."
        )
        if waiters:
            text += f" Waiting for it: {_waiters_text(waiters)}."
        if ranks and not proc.role.startswith("rank "):
            text += (
                " Ranks wait for peers meanwhile ("
                + ", ".join(f"{_who(r)} in {_collective(r)}" for r in ranks)
                + "): if it was a rank, it died before or during the collective they wait in; "
                "its output (stderr) says why."
            )
        elif not waiters:
            text += " Its parent may still be waiting for what it was doing."
        hints.append(
            Hint(
                text,
                [f"pid {proc.pid} is a zombie: {proc.exit_status} (/proc/{proc.pid}/stat)"]
                + _edge_lines(waiters, proc)
                + [f"{r.role} in {_collective(r)}" for r in ranks],
                rule="dead",
                # not the ranks: the rank rules say what they know about the missing one
                pids=[proc.pid, *(p.pid for p, _ in waiters)],
            )
        )
    return hints


def _pool_parent(proc: ProcessReport) -> Frame | None:
    return _innermost(
        proc, lambda f: _in(f, "multiprocessing/pool.py", "map", "starmap", "get", "wait")
    )


def _hint_pool_lost(procs: list[ProcessReport]) -> list[Hint]:
    hints = []
    for parent in procs:
        if _pool_parent(parent) is None:
            continue
        workers = [p for p in procs if p.ppid == parent.pid and p.role == "Pool worker"]
        idle = [
            w
            for w in workers
            if not w.busy and _innermost(w, lambda f: _in(f, "multiprocessing/queues.py", "get"))
        ]
        if not workers or len(idle) != len(workers):
            continue  # a worker still works (or is stuck in the task): another story
        name, frame = primitive(_main_thread(parent))
        oldest = max(w.age_s for w in workers)
        young = [w for w in workers if oldest - w.age_s > 0.5]
        dead = [p for p in procs if p.ppid == parent.pid and p.exit_status]
        based = [f"{_who(w)} idle, waiting for a task (age {w.age_s:.1f}s)" for w in workers]
        if young or dead:
            evidence = ", ".join(
                f"{_who(w)} is {oldest - w.age_s:.1f}s younger than its siblings" for w in young
            ) or ", ".join(f"pid {d.pid} {d.exit_status}" for d in dead)
            text = (
                f"{_who(parent)} waits in {name or 'a Pool call'}{_at(frame)} for results that will never "
                f"come: a Pool worker died with a task ({evidence}: the Pool replaced a dead worker), "
                f"and multiprocessing.Pool does not run a lost task again; all {len(workers)} Pool "
                "workers are idle, waiting for a task. Find what killed the worker (the OOM killer, a signal, os._exit), or use "
                "concurrent.futures.ProcessPoolExecutor, which raises BrokenProcessPool instead."
            )
            based += [f"pid {d.pid}: {d.exit_status}" for d in dead]
        else:
            text = (
                f"{_who(parent)} waits in {name or 'a Pool call'}{_at(frame)} while all "
                f"{len(workers)} Pool workers are idle, waiting for a task: nothing is computing "
                "the results it waits for (a task lost with a worker that died, or results "
                "awaited from a different Pool)."
            )
        hints.append(
            Hint(text, based, rule="pool_lost", pids=[parent.pid, *(w.pid for w in workers)])
        )
    return hints


def _knot(procs: list[ProcessReport]) -> dict[int, set[int]]:
    """Processes whose threads wait only for each other: pid -> the pids they wait for.

    A thread stays in the set while every process it waits for has all its (non-plugin) threads
    in the set; a process with a running, sleeping, stopped or unreadable thread, or one that
    waits for something outside the tree, can still move, or is another story.
    """
    by_pid = {p.pid: p for p in procs}
    threads: dict[int, list[TaskWait]] = {
        p.pid: [t for t in p.tasks if not _ignored(p, t)] for p in procs if p.tasks
    }
    members: dict[tuple[int, int], set[int]] = {}
    for pid, tasks in threads.items():
        for task in tasks:
            if _kind(by_pid[pid], task) == "blocked":
                members[(pid, task.tid)] = {e.pid for e in task.waits_for if e.pid > 0}
    changed = True
    while changed:
        changed = False
        stuck = Counter(pid for pid, _ in members)
        for key, targets in list(members.items()):
            if any(stuck[t] != len(threads.get(t, [])) or t not in threads for t in targets):
                del members[key]
                changed = True
    out: dict[int, set[int]] = {}
    stuck = Counter(pid for pid, _ in members)
    for (pid, _), targets in members.items():
        if stuck[pid] == len(threads[pid]):
            out.setdefault(pid, set()).update(targets)
    return out


def _components(knot: dict[int, set[int]]) -> list[list[int]]:
    seen: set[int] = set()
    out = []
    for start in sorted(knot):
        if start in seen:
            continue
        group, todo = [], [start]
        while todo:
            pid = todo.pop()
            if pid in seen or pid not in knot:
                continue
            seen.add(pid)
            group.append(pid)
            todo.extend(knot[pid] | {q for q, t in knot.items() if pid in t})
        out.append(sorted(group))
    return out


def _why_alone(proc: ProcessReport, task: TaskWait | None, name: str, forked: bool) -> str:
    vias = " ".join(e.via for e in task.waits_for) if task else ""
    if "no other thread" in vias:
        reason = f"it is the only thread of its process{' (threads are not copied by fork)' if forked else ''}"
    elif "own copy" in vias:
        reason = "the only write end of the pipe it reads is its own"
    else:
        reason = "every other thread of its process waits too"
    if name == "Future.result()":
        reason += "; a Future is completed by a pool thread, and the pool's threads were not copied by fork, so nothing will run the task"
    elif name.startswith(("Event.", "Condition.", "Barrier.")):
        reason += f"; no live thread can set the {name.split('.')[0]}"
    elif "acquire" in name:
        reason += "; nobody can release the lock"
    return reason


def _hint_deadlock(procs: list[ProcessReport], explained: set[int]) -> list[Hint]:
    by_pid = {p.pid: p for p in procs}
    knot = _knot(procs)
    hints = []
    for group in _components(knot):
        listed = [by_pid[p] for p in group if not by_pid[p].role.startswith(HELPER_ROLES)]
        pids = {p.pid for p in listed}
        if not listed or explained & {p for p in pids if not _is_pytest(by_pid[p])}:
            continue
        if pids <= explained:
            continue
        alone = [p for p in listed if knot[p.pid] <= {p.pid}]
        based = []
        for proc in listed:
            task = _main_task(proc)
            edges = [e for e in (task.waits_for if task else []) if e.pid != proc.pid][:4]
            based.append(
                f"{_who(proc)} blocked in {task.summary() if task else '?'}"
                + "".join(
                    f"; waits for pid {e.pid}: {e.via}" if e.pid else f"; {e.via}" for e in edges
                )
            )
        if alone:
            parts = []
            for proc in alone:
                task = _main_task(proc)
                name, frame = primitive(_task_thread(proc, task) if task else _main_thread(proc))
                forked = _fork_parent(proc, by_pid) is not None or proc.role.startswith(
                    "DataLoader worker"
                )
                parts.append(
                    f"{_who(proc)} waits in {name or proc.stuck_at}{_at(frame)}, and nothing can "
                    f"end that wait: {_why_alone(proc, task, name, forked)}"
                )
            others = [p for p in listed if p not in alone]
            text = ". ".join(parts) + "."
            if others:
                text += (
                    " Waiting for it: " + "; ".join(f"{_who(p)} {_doing(p)}" for p in others) + "."
                )
            rule = "nobody"
        else:
            cycle = "; ".join(
                f"{_who(p)} {_doing(p)}, for "
                + ", ".join(f"pid {q}" for q in sorted(knot[p.pid] - {p.pid}) if q in by_pid)
                for p in listed
            )
            text = (
                f"deadlock: {len(listed)} processes wait only for each other, and none of them can "
                f"move: {cycle}. Something one of them waits for (a batch, an Event, a lock, a "
                "message) is only produced after a wait of its own."
            )
            rule = "deadlock"
        hints.append(Hint(text, based, rule=rule, pids=[p.pid for p in listed]))
    return hints


def _hint_sleeper(procs: list[ProcessReport]) -> list[Hint]:
    """A wait whose other end belongs to processes that sleep (a long sleep, or a polling loop)."""
    by_pid = {p.pid: p for p in procs}
    hints = []
    for proc in procs:
        task = _main_task(proc)
        if task is None or _kind(proc, task) != "blocked" or proc.role.startswith(HELPER_ROLES):
            continue
        targets = {e.pid for e in task.waits_for if e.pid > 0 and e.pid != proc.pid}
        ends = [by_pid.get(t) for t in targets]
        if not ends or any(e is None or e.busy or e.exit_status for e in ends):
            continue
        kinds = {e.pid: _kind(e, t) for e in ends if e and (t := _main_task(e))}
        sleepers = [e for e in ends if e and kinds.get(e.pid) == "sleeping"]
        if not sleepers or any(kinds.get(e.pid) not in ("sleeping", "blocked") for e in ends if e):
            continue
        if any(_frame_collective(e) for e in sleepers):
            continue  # a rank polling its store: the rank rules tell why
        name, frame = primitive(_task_thread(proc, task))
        via = next(e.via for e in task.waits_for if e.pid == sleepers[0].pid)
        hints.append(
            Hint(
                f"{_who(proc)} waits in {name or proc.stuck_at}{_at(frame)} for "
                + ", ".join(f"{_who(s)}, which {_doing(s)}" for s in sleepers)
                + f" (through {via}): the wait ends only when the sleeper wakes up and acts. A long "
                "sleep, or a loop that polls for something that never comes.",
                [f"{_who(proc)} blocked in {task.summary()}"]
                + [f"{_who(s)} blocked in {t.summary()}" for s in sleepers if (t := _main_task(s))],
                rule="sleeper",
                pids=[proc.pid, *(s.pid for s in sleepers)],
            )
        )
    return hints


def _is_pytest(proc: ProcessReport) -> bool:
    return proc.role.split(" ")[0] == "pytest"


def _hint_outside(procs: list[ProcessReport]) -> list[Hint]:
    """A read on a socket whose peer is no process of this test: a server, a service."""
    hits, based, pids = [], [], []
    for proc in procs:
        task = _main_task(proc)
        if (
            task is None
            or task.call not in _READS
            or proc.role.startswith(("rank ", *HELPER_ROLES))
        ):
            continue
        outside = [e for e in task.waits_for if e.pid == -1 and "socket" in e.via]
        if not outside or any(e.pid > 0 for e in task.waits_for):
            continue
        name, frame = primitive(_task_thread(proc, task))
        hits.append(f"{_who(proc)} in {name or task.call}{_at(frame)}")
        based.append(f"{_who(proc)} blocked in {task.summary()}: {outside[0].via}")
        pids.append(proc.pid)
    if not hits:
        return []
    return [
        Hint(
            f"{len(hits)} process(es) wait for data on a socket whose other end is no process of "
            f"this test (a server, a service, or a process started before the test): "
            f"{'; '.join(hits)}. Check that the peer is up and answers, and give the call a timeout.",
            based,
            rule="outside",
            pids=pids,
        )
    ]


def _reads(proc: ProcessReport) -> list[tuple[TaskWait, Frame | None]]:
    out = []
    main = _main_task(proc)
    # in the pytest process, only the test's own thread: others may be left over from earlier tests
    for task in [main] if _is_pytest(proc) and main else proc.tasks:
        if task.call in ("read", "readv", "recvfrom", "recvmsg") and (
            "pipe:" in task.obj or "socket:" in task.obj
        ):
            thread = _task_thread(proc, task)
            if thread is not None:
                _, frame = primitive(thread)
                out.append((task, frame or (thread.frames[0] if thread.frames else None)))
    return out


def _hint_pipe(procs: list[ProcessReport]) -> list[Hint]:
    by_pid = {p.pid: p for p in procs}
    hits, based, pids = [], [], []
    for proc in procs:
        if _has(proc, "multiprocessing/managers.py", "_callmethod") or _has(
            proc, "torch/utils/data/dataloader.py", "_try_get_data"
        ):
            continue  # a Manager client, or a DataLoader waiting for its workers: other rules
        if proc.role.startswith(("rank ", *HELPER_ROLES)) or proc.busy:
            continue
        if proc.role == "Pool worker" and _has(proc, "multiprocessing/pool.py", "worker"):
            continue  # waiting for a task is what an idle Pool worker does
        for task, frame in _reads(proc):
            writers = [by_pid.get(e.pid) for e in task.waits_for]
            if any(
                w is None or w.busy or w.exit_status or w.state.startswith("stopped")
                for w in writers
            ):
                continue  # a writer outside the tree, busy, dead or stopped: another story
            ends = "; ".join(
                "itself (its own copy)" if w.pid == proc.pid else f"{_who(w)}, which {_doing(w)}"
                for w in writers
                if w is not None
            )
            hits.append(
                f"{_who(proc)} reads {task.obj}{_at(frame)}; the other end is held by {ends}"
            )
            based.append(f"{_who(proc)} blocked in {task.summary()}")
            based += [f"  {e.via}: pid {e.pid}" for e in task.waits_for]
            pids.append(proc.pid)
    if not hits:
        return []
    return [
        Hint(
            f"{len(hits)} process(es) block reading a pipe, FIFO, socket or Connection whose writer "
            f"never writes: {'; '.join(hits)}. Check that the other end was started, writes, and "
            "closes its copy of the descriptors it does not use.",
            based,
            rule="pipe",
            pids=pids,
        )
    ]


def _hint_busy(procs: list[ProcessReport], explained: set[int] | None = None) -> list[Hint]:
    busy = [p for p in procs if p.busy and p.pid not in (explained or set())]
    if not busy:
        return []
    waiting = [(b, _edges_to(procs, b.pid)) for b in busy]
    text = (
        f"{len(busy)} process(es) used CPU during the capture: they are computing or spinning, not "
        "waiting (an endless loop, a retry loop, or work too slow for the timeout)."
    )
    for proc, waiters in waiting:
        if waiters:
            text += f" Waiting for {_who(proc)}: {_waiters_text(waiters)}."
    return [
        Hint(
            text,
            [f"{p.role} (pid {p.pid}) +{p.cpu_delta_s:.2f}s CPU at {p.stuck_at}" for p in busy]
            + [line for proc, waiters in waiting for line in _edge_lines(waiters, proc)],
            rule="busy",
            pids=[p.pid for p in busy],
        )
    ]


#: Rules in order: facts first (stopped, dead), then the specific stories, then the graph's
#: general ones; a later general rule stays silent about processes an earlier hint explained.
_RULES: tuple[Callable[[list[ProcessReport]], list[Hint]], ...] = (
    _hint_stopped,
    _hint_dead,
    _hint_collectives,
    _hint_rank_gone,
    _hint_worker_lock,
    _hint_queue_join,
    _hint_manager,
    _hint_pool_lost,
    _hint_pipe,
    _hint_openmp_after_fork,
    _hint_cuda_before_fork,
    _hint_sleeper,
    _hint_outside,
)
_AFTER_GRAPH: tuple[Callable[[list[ProcessReport]], list[Hint]], ...] = (_hint_still_starting,)
_PID = re.compile(r"\(pid (\d+)\)")


def _said(pids: set[int], pytest: set[int], explained: set[int]) -> bool:
    """Whether earlier hints explained these processes (the pytest process, which waits in most
    stories, counts only for a hint about it alone)."""
    others = pids - pytest
    return others <= explained if others else pids <= explained


def _rule_name(rule: Callable[..., list[Hint]]) -> str:
    return rule.__name__.removeprefix("_hint_")


def hints(processes: list[ProcessReport]) -> list[Hint]:
    """Every hint whose rule matches; a single 'no known pattern' hint when none does."""
    found: list[Hint] = []
    explained: set[int] = set()
    # the pytest process waits in most stories: naming it explains nothing
    pytest = {p.pid for p in processes if _is_pytest(p)}
    for rule in _RULES:
        for hint in rule(processes):
            hint.rule = hint.rule or _rule_name(rule)
            if not hint.pids:
                hint.pids = sorted({int(m) for b in hint.based_on for m in _PID.findall(b)})
            if hint.rule in ("stopped", "dead") or not _said(set(hint.pids), pytest, explained):
                found.append(hint)
                explained.update(hint.pids)
    found += _hint_deadlock(processes, explained)
    for rule in _AFTER_GRAPH:
        for hint in rule(processes):
            hint.rule = hint.rule or _rule_name(rule)
            hint.pids = hint.pids or sorted(
                {int(m) for b in hint.based_on for m in _PID.findall(b)}
            )
            found.append(hint)
            explained.update(hint.pids)
    found += _hint_busy(processes, explained - pytest)
    if not found:
        found.append(
            Hint(
                "no known hang pattern matched; the stacks below show where each process waits "
                "(innermost frame first).",
                rule="none",
            )
        )
    return found

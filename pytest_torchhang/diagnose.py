"""Turn a tree of stacks into roles and plain-language hints; a hint is a hint, never a guess."""

from __future__ import annotations

import functools
import linecache
import os
import re
import sysconfig
from collections import Counter
from collections.abc import Callable

from .report import Hint, ProcessReport
from .stacks import Frame, ThreadStack

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
    head = f"HANG after {elapsed:.1f}s in {test_id}: {len(processes)} process{'es' if len(processes) != 1 else ''}"
    # helpers wait by design: they name the hang only when nothing else does
    others = [
        p
        for p in processes
        if p.pid != root_pid and p.stuck_at and not p.role.startswith(HELPER_ROLES)
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


def _collective(proc: ProcessReport) -> str | None:
    frame = _innermost(
        proc,
        lambda f: (
            _in(f, "torch/distributed/distributed_c10d.py") and f.name in _COLLECTIVES | _RENDEZVOUS
        ),
    )
    return frame.name if frame else None


def _rank_no(proc: ProcessReport) -> str:
    return proc.role.split()[1] if proc.role.startswith("rank ") else str(proc.pid)


def _hint_collectives(procs: list[ProcessReport]) -> list[Hint]:
    ranks = [p for p in procs if p.role.startswith("rank ")]
    if not ranks:
        return []
    where = {_rank_no(p): _collective(p) for p in ranks}
    waiting = {r: c for r, c in where.items() if c and c not in _RENDEZVOUS}
    rendezvous = {r: c for r, c in where.items() if c in _RENDEZVOUS}
    based = [
        f"rank {r} (pid {p.pid}) in {where[_rank_no(p)] or p.stuck_at}"
        for r, p in ((_rank_no(p), p) for p in ranks)
    ]
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
        pairs = ", ".join(f"rank {r} in {c}" for r, c in sorted(waiting.items()))
        hints.append(
            Hint(
                f"ranks wait in different collectives ({pairs}): every rank must call the same "
                "collectives in the same order; look for a rank-dependent branch before them.",
                based,
            )
        )
    elif waiting and len(waiting) < len(ranks):
        missing = [
            f"rank {r} at {next(p.stuck_at for p in ranks if _rank_no(p) == r)}"
            for r, c in where.items()
            if not c
        ]
        coll = next(iter(waiting.values()))
        hints.append(
            Hint(
                f"{len(waiting)} rank(s) wait in {coll} for a rank that is not in a collective "
                f"({', '.join(missing)}): that rank skipped the call or is stuck before it.",
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
            or proc.role.startswith("DataLoader worker")
            or proc.num_threads != 1
            or parent.num_threads < 2
        ):
            continue
        top = main.frames[0]
        line = top.line
        if _is_library(top) or not line or any(call in line for call in _BLOCKING_CALLS):
            continue
        if "torch" in line or "@" in line or "." in line:
            hits.append(
                f"{proc.role} (pid {proc.pid}), forked from pid {parent.pid} ({parent.num_threads} threads), "
                f"at {top.filename}:{top.lineno}: {line}"
            )
    if not hits:
        return []
    return [
        Hint(
            f"{len(hits)} forked process(es) are stuck (blocked or spinning) in a C call made straight "
            "from their code, with a single thread, forked from a multi-threaded parent: if that call is "
            "a torch op, this is OpenMP after fork (the parent ran torch ops before forking; its thread "
            "pool does not survive fork). Call torch.set_num_threads(1) in the child before any op, or "
            "start it with spawn/forkserver.",
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


def _hint_pipe(procs: list[ProcessReport]) -> list[Hint]:
    hits = []
    for proc in procs:
        if _has(proc, "multiprocessing/managers.py", "_callmethod") or _has(
            proc, "torch/utils/data/dataloader.py", "_try_get_data"
        ):
            continue  # a Manager client, or a DataLoader waiting for its workers: other rules
        frame = _innermost(
            proc,
            lambda f: (
                _in(
                    f,
                    "multiprocessing/connection.py",
                    "_recv",
                    "_recv_bytes",
                    "recv_bytes",
                    "recv",
                    "poll",
                    "_poll",
                )
                or (
                    not _is_library(f)
                    and any(s in f.line for s in ("os.read(", ".recv(", ".read(", ".readline("))
                )
            ),
        )
        if frame is not None and not proc.role.startswith(
            ("rank ", "resource_tracker", "forkserver")
        ):
            hits.append(
                f"{proc.role} (pid {proc.pid}) at {frame.filename}:{frame.lineno} in {frame.name}"
            )
    if not hits:
        return []
    return [
        Hint(
            f"{len(hits)} process(es) block reading a pipe, FIFO, socket or Connection whose writer "
            "never writes: check that the other end was started, writes, and closes its copy of the "
            "descriptors it does not use.",
            hits,
        )
    ]


def _hint_busy(procs: list[ProcessReport]) -> list[Hint]:
    busy = [p for p in procs if p.busy]
    if not busy:
        return []
    return [
        Hint(
            f"{len(busy)} process(es) used CPU during the capture: they are computing or spinning, not "
            "waiting (an endless loop, a retry loop, or work too slow for the timeout).",
            [f"{p.role} (pid {p.pid}) +{p.cpu_delta_s:.2f}s CPU at {p.stuck_at}" for p in busy],
        )
    ]


_RULES = (
    _hint_collectives,
    _hint_rank_gone,
    _hint_worker_lock,
    _hint_queue_join,
    _hint_manager,
    _hint_pipe,
    _hint_openmp_after_fork,
    _hint_cuda_before_fork,
    _hint_still_starting,
    _hint_busy,
)


def hints(processes: list[ProcessReport]) -> list[Hint]:
    """Every hint whose rule matches; a single 'no known pattern' hint when none does."""
    found = [hint for rule in _RULES for hint in rule(processes)]
    if not found:
        found.append(
            Hint(
                "no known hang pattern matched; the stacks below show where each process waits "
                "(innermost frame first)."
            )
        )
    return found

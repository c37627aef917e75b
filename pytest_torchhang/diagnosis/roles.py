"""Role labelling: what each process and notable thread of the tree is, as data (a Role)."""

from __future__ import annotations

from ..report.model import (
    BUSY_CPU_S,
    HELPER_KINDS,
    SPAWNED,
    TORCHRUN,
    ProcessReport,
    Role,
)
from ..report.model import (
    MANAGER_SERVER as MANAGER_KIND,
)
from .frames import (
    all_frames,
    enclosing_class,
    has_frame,
    importing,
    in_file,
    is_library,
    main_thread,
    stuck_at,
)

#: Roles of processes that wait by design: they name the hang only when nothing else does.
HELPER_ROLES = HELPER_KINDS
WORKER = "DataLoader worker"
RANK = "rank"
PYTEST = "pytest"
POOL_WORKER = Role("Pool worker")
MANAGER_SERVER = Role(MANAGER_KIND)
EXITED = Role("exited child")  # a zombie: no stack, no environment, no command line
TORCHRUN_AGENT = Role("torchrun agent")  # torch.distributed.run's elastic agent

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
    # its thread runs ``Watchdog._run``; the test's own thread may be in watchdog.py too (waiting
    # for a capture from pytest's report hook): that is not the watchdog
    ("pytest_torchhang/watchdog.py", ("_run",), "torch-hang watchdog"),
    ("pytest_torchhang/processwide.py", ("serve",), "torch-hang launcher"),
    (
        "pytest_torchhang/inject/hook.py",
        ("_serve_collectives",),
        "torch-hang flight-recorder listener",
    ),
]


def _dataset_name(proc: ProcessReport) -> str:
    for frame in all_frames(proc):
        if frame.name in (
            "__getitem__",
            "__getitems__",
            "__iter__",
            "__next__",
        ) and not is_library(frame):
            return enclosing_class(frame.filename, frame.lineno)
    return ""


def _target_name(proc: ProcessReport) -> str:
    main = main_thread(proc)
    if main is None:
        return ""
    frames = main.frames
    for i, frame in enumerate(frames):
        if in_file(frame, "multiprocessing/process.py", "run") and i > 0:
            return frames[i - 1].name
    return ""


def _ordered(procs: list[ProcessReport]) -> list[ProcessReport]:
    return sorted(procs, key=lambda p: (-p.age_s, p.pid))  # oldest first: start order


def _set(proc: ProcessReport, role: Role) -> None:
    proc.role_facts = role
    proc.role = role.text()


def label_roles(
    processes: list[ProcessReport], root_pid: int, env: dict[int, dict[str, str]], root_role: str
) -> None:
    """Give every process and notable thread a role, as specific as the stacks allow."""
    for proc in processes:
        _label_threads(proc)
    workers: dict[int, list[ProcessReport]] = {}
    ranks: dict[int, list[ProcessReport]] = {}
    agents = {p.pid for p in processes if not p.role and _is_torchrun_agent(p)}
    for proc in processes:
        if proc.pid == root_pid and not proc.role:
            _set(proc, Role.parse(root_role))
        elif proc.exit_status and not proc.role:
            _set(proc, EXITED)
        elif proc.group_role is not None:
            # its own process group says it is a rank, whoever started it; the launcher, when
            # known, stays as a detail
            _set(proc, _with_launcher(proc.group_role, _launcher(proc, agents)))
        elif proc.role:
            # known before the stacks, as text: a role the process stated (a runner's child, a
            # rank of the distributed fixture), or a helper recognised by its command line
            _set(proc, Role.parse(proc.role))
        elif has_frame(proc, "torch/utils/data/_utils/worker.py", "_worker_loop"):
            workers.setdefault(proc.ppid, []).append(proc)
        elif proc.pid in agents:
            _set(proc, TORCHRUN_AGENT)
        elif "RANK" in env.get(proc.pid, {}):
            _set(proc, _rank_from(env[proc.pid], TORCHRUN if proc.ppid in agents else None))
        elif has_frame(proc, "torch/multiprocessing/spawn.py", "_wrap"):
            ranks.setdefault(proc.ppid, []).append(proc)
        else:
            _set(proc, _from_stacks(proc))
    for group in ranks.values():
        for r, proc in enumerate(_ordered(group)):
            _set(proc, Role(RANK, rank=r, world=len(group), detail=SPAWNED))
    # after the ranks: a worker says whose it is
    by_pid = {p.pid: p for p in processes}
    for parent, group in workers.items():
        owner = _owner(by_pid.get(parent))
        for k, proc in enumerate(_ordered(group)):
            dataset = _dataset_name(proc) or None
            _set(proc, Role(WORKER, index=k, count=len(group), dataset=dataset, owner=owner))
    for proc in processes:
        proc.stuck_at = stuck_at(proc)
        proc.busy = is_busy(proc)


def _launcher(proc: ProcessReport, agents: set[int]) -> str | None:
    """How a rank was started, when that shows: torchrun's agent, torch.multiprocessing.spawn."""
    if proc.ppid in agents:
        return TORCHRUN
    if has_frame(proc, "torch/multiprocessing/spawn.py", "_wrap"):
        return SPAWNED
    return None


def _with_launcher(role: Role, launcher: str | None) -> Role:
    return Role(RANK, rank=role.rank, world=role.world, backend=role.backend, detail=launcher)


def _owner(parent: ProcessReport | None) -> str | None:
    """``rank 1``: whose DataLoader workers a parent's are, when the parent is a rank (the
    workers of two ranks are told apart); None for any other parent."""
    if parent is None or parent.role_facts is None or parent.role_facts.kind != RANK:
        return None
    rank = parent.role_facts.rank
    return None if rank is None else f"rank {rank}"


def _label_threads(proc: ProcessReport) -> None:
    for thread in proc.threads:
        for suffix, names, role in _THREAD_ROLES:
            if any(in_file(f, suffix, *names) for f in thread.frames):
                proc.thread_roles[thread.ident] = role
                break


def _rank_from(env: dict[str, str], started: str | None = None) -> Role:
    """A rank's role from the variables torch.distributed reads (RANK, WORLD_SIZE)."""
    backend = env.get("TORCH_HANG_BACKEND") or None
    return Role(
        RANK,
        rank=_number(env["RANK"]),
        world=_number(env.get("WORLD_SIZE", "")),
        backend=backend,
        detail=started if backend is None else None,  # one parenthesis: the text parses back
    )


#: Command-line words of torch's elastic launcher (``python -m torch.distributed.run``,
#: ``torchrun``); accelerate and deepspeed start one of them under their own name.
_TORCHRUN_WORDS = ("torch.distributed.run", "torch.distributed.launch", "torchrun")


def _is_torchrun_agent(proc: ProcessReport) -> bool:
    """torchrun's elastic agent: by its command line, or by its frames (the agent's loop)."""
    words = proc.cmdline.replace("/", " ").split()
    return any(word in words for word in _TORCHRUN_WORDS) or has_frame(
        proc, "torch/distributed/elastic/agent/server/api.py", "_invoke_run"
    )


def _number(value: str) -> int | None:
    return int(value) if value.strip().isdigit() else None


def _from_stacks(proc: ProcessReport) -> Role:
    """The role of a process that is no DataLoader worker and no rank, from its frames."""
    if importing(proc) and "multiprocessing" in proc.cmdline:
        # "still starting" only while it moves: one blocked in its import waits (issue 32)
        starting = "still starting: importing" if making_progress(proc) else "importing"
        return Role("multiprocessing child", detail=starting)
    if has_frame(proc, "multiprocessing/managers.py", "serve_forever"):
        return MANAGER_SERVER
    if has_frame(proc, "multiprocessing/pool.py", "worker"):
        return POOL_WORKER
    if has_frame(proc, "multiprocessing/process.py", "_bootstrap"):
        target = _target_name(proc)
        return (
            Role("multiprocessing.Process", target=target)
            if target
            else Role("multiprocessing child")
        )
    return Role("Python child") if proc.dump_status == "ok" else Role("child process")


def is_busy(proc: ProcessReport) -> bool:
    """CPU time grew while the stacks were taken, or the process runs and mostly has been running.

    The second test matters on a loaded machine, where a spinning process may get little CPU in
    the short capture window. Two looks half a second apart (``proc.motion``) overrule both: a
    process that spun between them is busy; one that polled (slept and woke, little CPU) or
    did not move at all waits, whatever CPU answering the capture's signals cost it.
    """
    if proc.motion is not None and proc.motion.kind in ("spinning", "polling", "blocked"):
        return proc.motion.kind == "spinning"
    return proc.cpu_delta_s >= BUSY_CPU_S or (
        proc.state == "running" and proc.cpu_s > 0.5 * proc.age_s
    )


def making_progress(proc: ProcessReport) -> bool:
    """The process moves: it used CPU during the capture or runs, or its main thread is in
    uninterruptible I/O (reading a file) with nothing of the tree to wait for. A process whose
    main thread is blocked in a wait (a lock, a pipe, a futex, a sleep) does not, however young:
    it is not "still starting up", it is stuck."""
    if is_busy(proc):
        return True
    main = main_thread(proc)
    ident = main.ident if main is not None else None
    task = next((t for t in proc.tasks if ident and t.python_thread == ident), None)
    task = task or next((t for t in proc.tasks if t.tid == proc.pid), None)
    if task is None:  # no /proc facts: only its state says
        return proc.state in ("running", "disk-sleep")
    return task.call == "running" or task.state == "R" or (task.state == "D" and not task.waits_for)


def role_of(proc: ProcessReport) -> Role:
    """The process's role as data; a report built without it (by hand) has its text read."""
    return proc.role_data()


def is_pytest(proc: ProcessReport) -> bool:
    """The pytest process (an xdist worker's included)."""
    return role_of(proc).kind == PYTEST


def is_rank(proc: ProcessReport) -> bool:
    """A rank of torch.distributed, as its role says."""
    return role_of(proc).kind == RANK


def is_worker(proc: ProcessReport) -> bool:
    """A DataLoader worker."""
    return role_of(proc).kind == WORKER


def is_helper(proc: ProcessReport) -> bool:
    """A process that waits by design (a Manager server, resource_tracker, forkserver, ...)."""
    return role_of(proc).kind in HELPER_ROLES


def rank_no(proc: ProcessReport) -> str:
    """``0/2``: a rank's number and world size, as hints name it; another process's pid."""
    role = role_of(proc)
    if role.kind != RANK:
        return str(proc.pid)
    world = "?" if role.world is None else role.world
    return f"{'?' if role.rank is None else role.rank}/{world}"


def world_size(proc: ProcessReport) -> int | None:
    """The world size a rank's role names, None when unknown (or not a rank)."""
    role = role_of(proc)
    return role.world if role.kind == RANK else None

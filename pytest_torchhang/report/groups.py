"""One hang's processes grouped by identical stacks: the odd one out first, the crowd folded.

Of four DataLoader workers, three idle in ``_worker_loop -> queues.get`` and one stuck in
``__getitem__``, the one that differs is the story; the three are one group, printed once with
their pids (the heuristic of ByteRobust and XPUTimer: among peers, the dominant identical stack
is waiting, the outliers are where to look). Rendering only: the JSON keeps every process whole.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection
from dataclasses import dataclass, field

from ..inject.protocol import PLUGIN_THREAD_NAMES
from .model import (
    ASIDE_ROLES,
    HELPER_KINDS,
    MANAGER_SERVER,
    Collective,
    Frame,
    ProcessReport,
    TaskWait,
    ThreadStack,
)
from .waits import LISTENING

#: Roles of processes that wait by design (helpers) or that the test did not start (context):
#: they come last, whatever their stacks. A Manager server is not among them: it is ordered by
#: its stacks, as the test's own processes are (a server blocked serving a call is a culprit).
HELPERS = (*(kind for kind in HELPER_KINDS if kind != MANAGER_SERVER), *ASIDE_ROLES)


def helper_role(role: str) -> bool:
    """Whether a role's text is a helper's (``forkserver``, ``Manager server (pid 12)``)."""
    return role.startswith(HELPER_KINDS)


def aside_role(role: str) -> bool:
    """Whether a role's text is of a process shown for context (``started before this test
    (zygote)``, ``fixture-owned worker (Pool worker)``), not one of the test's own."""
    return role.startswith(ASIDE_ROLES)


#: The placeholder frames of cut stacks (pytest's own, the plugin's, multiprocessing's start-up).
STARTUP_CUT = "<multiprocessing>"
_PLACEHOLDERS = ("<pytest>", "<pytest-torchhang>", STARTUP_CUT)
#: Where a child of multiprocessing or torch.multiprocessing begins: the frames from here outward
#: say how it was started (after a fork, its parent's frames down to the test), not where it waits.
_CHILD_ENTRY = (
    ("multiprocessing/process.py", ("_bootstrap",)),
    ("multiprocessing/spawn.py", ("spawn_main", "_main")),
    ("multiprocessing/forkserver.py", ("main", "_serve_one")),
)
#: Frames just inside the entry that are start-up too: ``Process.run`` calling the target, and
#: torch.multiprocessing's ``_wrap`` calling a rank's function.
_ENTRY_SHELL = (
    ("multiprocessing/process.py", ("run",)),
    ("torch/multiprocessing/spawn.py", ("_wrap",)),
)
#: The entry of a process that runs its own code: ``Process._bootstrap`` calls ``run``.
_BOOTSTRAP = (("multiprocessing/process.py", ("_bootstrap",)),)
#: Where ``_bootstrap`` hands over to the child's code (its target, its exit handlers): from
#: there on the start-up frames below say nothing about where it waits.
_OWN_CODE = (
    ("multiprocessing/process.py", ("run",)),
    ("multiprocessing/util.py", ("_exit_function",)),
)
#: A Pool's maintenance thread, which replaces the workers that exit (``maxtasksperchild``, a
#: worker that died): a fork child whose fork history holds it was forked by that thread.
_POOL_MAINTENANCE = (("multiprocessing/pool.py", ("_maintain_pool", "_handle_workers")),)
_POOL_WORKER = (("multiprocessing/pool.py", ("worker",)),)
#: The forkserver's serving loop (it waits there by design, a helper).
_FORKSERVER_LOOP = (("multiprocessing/forkserver.py", ("main",)),)
#: spawn's frames that import the main module again (``prepare``), by path or by name.
_PREPARE = (
    (
        "multiprocessing/spawn.py",
        ("prepare", "_fixup_main_from_path", "_fixup_main_from_name", "import_main_path"),
    ),
)

#: The frames every thread started by ``threading`` has at its bottom.
_THREAD_START = (("/threading.py", ("_bootstrap", "_bootstrap_inner", "run")),)


def _in(frame: Frame, table: tuple[tuple[str, tuple[str, ...]], ...]) -> bool:
    path = frame.filename.replace(os.sep, "/")
    return any(path.endswith(suffix) and frame.name in names for suffix, names in table)


def _imports(frame: Frame) -> bool:
    """importlib's frames, a module's top level, spawn's own ``prepare``: an import under way."""
    return (
        frame.filename.startswith("<frozen importlib")
        or frame.name == "<module>"
        or _in(frame, _PREPARE)
    )


def _entry(frames: list[Frame]) -> int | None:
    """The index of the child's innermost entry frame (its start-up begins there), if any."""
    return next((i for i, frame in enumerate(frames) if _in(frame, _CHILD_ENTRY)), None)


def in_startup(frames: list[Frame]) -> bool:
    """The stuck (innermost) frame is inside multiprocessing's start-up, which then explains it:
    a spawned or forkserver child that has not reached its target (importing the main module
    again, unpickling the target and importing the modules that define it, reading what its
    parent sends), the forkserver preloading, or ``_bootstrap``'s own work before ``run`` (in a
    fork child, its parent's frames below say which thread forked it: a Pool's maintenance
    thread replacing a worker, say). Issue 32: cut there, the stuck frame lost its story."""
    i = _entry(frames)
    if i is None:
        return False
    above = frames[:i]
    if _in(frames[i], _BOOTSTRAP):
        if not any(_in(f, _OWN_CODE) for f in above):
            return True  # in _bootstrap's own work, before run
        # a Pool worker still in its initializer that the pool's maintenance thread forked (a
        # replacement): forked at any moment, beside whatever the other threads held then
        worker = next((f for f in above if _in(f, _POOL_WORKER)), None)
        return (
            worker is not None
            and "initializer" in worker.line
            and any(_in(f, _POOL_MAINTENANCE) for f in frames[i + 1 :])
        )
    if _in(frames[i], _FORKSERVER_LOOP):  # serving, by design; preloading is start-up
        return any(_imports(f) for f in above)
    return True  # spawn_main, spawn's _main, forkserver's _serve_one: before _bootstrap


def reimports(frames: list[Frame]) -> str:
    """``while spawn re-imports test_x``: the module a child in its start-up imports again (the
    outermost module being imported above the start-up frames), named by its start method;
    empty when the child is not importing in its start-up."""
    i = _entry(frames)
    if i is None or _in(frames[i], _BOOTSTRAP) or not in_startup(frames):
        return ""  # a fork child imports nothing again: it has its parent's modules
    modules = [f for f in frames[:i] if f.name == "<module>" and not f.filename.startswith("<")]
    if not modules:
        return ""
    path = modules[-1].filename.replace(os.sep, "/")
    stem = os.path.splitext(os.path.basename(path))[0]
    name = os.path.basename(os.path.dirname(path)) if stem == "__init__" else stem
    method = (
        "forkserver"
        if any("multiprocessing/forkserver.py" in f.filename for f in frames)
        else "spawn"
    )
    return f"while {method} re-imports {name}"


def cut_startup(frames: list[Frame]) -> list[Frame]:
    """The frames (innermost first) without multiprocessing's start-up below the child's code:
    ``_bootstrap``, ``run``, ``_wrap`` and, in a fork child, the parent's ``_launch``,
    ``_Popen``, ``start``, ``start_process`` down to the test. A parent starting a process keeps
    its ``_launch``: only a child's entry cuts. A thread's ``threading`` start-up is cut too.
    A child stuck inside its start-up (:func:`in_startup`) keeps every frame: they are the
    evidence."""
    i = _entry(frames)
    if i is not None and not in_startup(frames):
        keep = frames[:i]
        # a target that is a C function (time.sleep) waits in run: that frame stays
        while len(keep) > 1 and _in(keep[-1], _ENTRY_SHELL):
            keep = keep[:-1]
        return [*keep, Frame(STARTUP_CUT, 0, "... multiprocessing's start-up frames cut")]
    # (a fork child kept whole ends in the frames of the thread that forked it: cut them too)
    cut = len(frames)
    while cut > 1 and _in(frames[cut - 1], _THREAD_START):
        cut -= 1
    if cut < len(frames):
        return [*frames[:cut], Frame(STARTUP_CUT, 0, "... threading's start-up frames cut")]
    return frames


#: Where ``--torch-hang-hunt-stress`` wraps the user's calls (its ``stressed`` wrappers, its
#: meeting points): frames of the plugin inside the user's stacks, not of the user's program.
_STRESS_FILES = ("pytest_torchhang/inject/stress.py", "pytest_torchhang/inject/stress_schedule.py")
#: The placeholder of cut stress frames: the plugin's own, rendered as pytest's are.
STRESS_CUT = Frame("<pytest-torchhang>", 0, "... --torch-hang-hunt-stress frames cut")


def cut_stress(frames: list[Frame]) -> list[Frame]:
    """The frames without stress's wrappers around the user's calls: each run of them becomes
    one ``STRESS_CUT`` line, where it was (the call it wrapped stays, innermost). A step apart
    from :func:`cut_startup`, run before it."""
    out: list[Frame] = []
    for frame in frames:
        if not frame.filename.replace(os.sep, "/").endswith(_STRESS_FILES):
            out.append(frame)
        elif not out or out[-1] is not STRESS_CUT:
            out.append(STRESS_CUT)
    return out


def is_plugin_thread(thread: ThreadStack) -> bool:
    """A thread of pytest-torchhang itself: by its name, or by the function it was started with."""
    if thread.current or thread.name == "MainThread":
        return False
    if thread.name.startswith(PLUGIN_THREAD_NAMES):
        return True
    started = [f for f in thread.frames if not _in(f, _THREAD_START)]
    return bool(started) and "/pytest_torchhang/" in started[-1].filename.replace(os.sep, "/")


def main_thread(proc: ProcessReport) -> ThreadStack | None:
    """The thread that dumped the stacks, else the one named MainThread, else the first."""
    for thread in proc.threads:
        if thread.current or thread.name == "MainThread":
            return thread
    return proc.threads[0] if proc.threads else None


def _frames_key(frames: list[Frame]) -> tuple[tuple[str, int, str], ...]:
    return tuple((f.filename, f.lineno, f.name) for f in cut_startup(cut_stress(frames)))


def thread_key(thread: ThreadStack) -> tuple[tuple[str, int, str], ...]:
    """What makes two threads' stacks the same: their frames, start-up cut (not their ids)."""
    return _frames_key(thread.frames)


def pending(proc: ProcessReport) -> Collective | None:
    """The rank's oldest collective that has not completed (the flight recorder's)."""
    return next((c for c in proc.collectives if not c.completed), None)


def collective_text(collective: Collective) -> str:
    """``#3 all_reduce on process group 'default_pg'``: which collective, in which group."""
    group = f" on process group {collective.group!r}" if collective.group else ""
    return f"{collective.label()}{group}"


_NUMBERS = re.compile(r"\d+")


def _program(text: str) -> str:
    """A command line or a native dump without its numbers: spawn children of one parent differ
    by ``pipe_handle=N`` only, two different scripts by their text."""
    return _NUMBERS.sub("#", text)


def stack_key(proc: ProcessReport) -> tuple[object, ...]:
    """What makes two processes the same: role (its kind), the program (its command line, but
    for numbers), their threads' stacks (the plugin's own threads left out), the collective
    they wait in with its group, how they ended, native stacks, and what they wrote to stderr."""
    threads = [t for t in proc.threads if not is_plugin_thread(t)]
    main = main_thread(proc)
    others = sorted(thread_key(t) for t in threads if t is not main)
    waiting = pending(proc)
    native = () if proc.threads else tuple(sorted((t.call, t.wchan) for t in proc.tasks))
    return (
        proc.role_data().general(),
        _program(proc.cmdline),
        thread_key(main) if main is not None else (),
        tuple(others),
        (waiting.name, waiting.group) if waiting is not None else None,
        proc.exit_status.split(" ")[0] if proc.exit_status else "",
        proc.dump_status == "ok",
        native,
        _program(proc.native),
        tuple(proc.stderr_tail),  # its own last words: never folded into another's
    )


def where(proc: ProcessReport) -> str:
    """Where the process waits, in a few words: ``_worker_loop -> queues.get -> select``
    (its outermost frame of its own, what that called, and the innermost frame)."""
    if proc.exit_status:
        return proc.exit_status
    main = main_thread(proc)
    cut = cut_startup(cut_stress(main.frames)) if main is not None else []
    frames = [f for f in cut if f.filename not in _PLACEHOLDERS]
    if not frames:
        return proc.stuck_at
    path = [frames[-1].name]
    if len(frames) > 1:
        module = os.path.splitext(os.path.basename(frames[-2].filename))[0]
        path.append(f"{module}.{frames[-2].name}")
    inner = proc.stuck_at or frames[0].name
    if len(frames) > 2 and inner not in (frames[-1].name, frames[-2].name):
        path.append(inner)
    text = " -> ".join(path)
    waiting = pending(proc)
    return f"{text}, in {collective_text(waiting)}" if waiting is not None else text


@dataclass
class StackGroup:
    """Processes of one role with identical stacks; ``crowd``: the dominant group of its role
    (its peers that differ are the outliers, printed first)."""

    role: str  # the role without its number: "DataLoader worker", "rank", "pytest"
    processes: list[ProcessReport] = field(default_factory=list)
    crowd: bool = False
    outlier: bool = False  # differs from the crowd of its role

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    @property
    def where(self) -> str:
        return where(self.processes[0])

    def who(self) -> str:
        """``DataLoader worker 1/4 (pid 10045)``, ``3 DataLoader workers (pids 1, 2, 3)``."""
        if len(self.processes) == 1:
            proc = self.processes[0]
            return f"{proc.role} (pid {proc.pid})"
        return f"{len(self.processes)} {plural(self.role)} (pids {pid_list(self.pids)})"

    def line(self) -> str:
        """``3 DataLoader workers (pids 1, 2, 3): _worker_loop -> queues.get -> select``."""
        return f"{self.who()}: {self.where}" if self.where else self.who()


#: Pids named in a group's summary line; the rest are counted (its block names them all, up to
#: ``MAX_BLOCK_PIDS``).
MAX_PIDS = 16
MAX_BLOCK_PIDS = 1024


def pid_list(pids: list[int], limit: int = MAX_PIDS) -> str:
    """``1, 2, 3``, or the first ``limit`` and ``+48 more``."""
    shown = ", ".join(map(str, pids[:limit]))
    return shown + (f" +{len(pids) - limit} more" if len(pids) > limit else "")


_IRREGULAR = {"child": "children", "process": "processes"}


def plural(role: str) -> str:
    """``DataLoader workers``, ``ranks``, ``Python children``; ``processes [X]`` for a role whose
    last word is no noun to put in the plural (``multiprocessing.Process(target=f)``)."""
    head, _, last = role.rpartition(" ")
    if not last.isalpha():
        return f"processes [{role}]"
    many = _IRREGULAR.get(last, last + ("es" if last.endswith(("s", "sh", "ch")) else "s"))
    return f"{head} {many}" if head else many


#: Where a service loop waits for its next client or task, by (file suffix, function): a
#: socketserver's ``serve_forever``, an idle ``ProcessPoolExecutor`` worker.
_SERVICE_LOOPS = (
    ("/socketserver.py", ("serve_forever",)),
    ("concurrent/futures/process.py", ("_process_worker",)),
    ("concurrent/futures/thread.py", ("_worker",)),
    # a ProcessPoolExecutor's manager thread waiting for a result, a Queue's feeder thread
    # waiting for something to send: the parent's halves of idle workers
    ("concurrent/futures/process.py", ("wait_result_broken_or_wakeup",)),
    ("multiprocessing/queues.py", ("_feed",)),
)

#: Where a service loop waits: its selector, or the queue it takes its next task from.
_WAITING_IN = (
    "/selectors.py",
    "/socketserver.py",
    "/threading.py",
    "/queue.py",
    "multiprocessing/queues.py",
    "multiprocessing/connection.py",
    "multiprocessing/synchronize.py",
)


def idle_loop(frames: list[Frame]) -> bool:
    """The stack (innermost first) waits in a service loop's own wait for its next request or
    task, not in a request's handler."""
    loop = next((i for i, f in enumerate(frames) if _in(f, _SERVICE_LOOPS)), None)
    return loop is not None and all(
        f.filename.replace(os.sep, "/").endswith(_WAITING_IN) for f in frames[:loop]
    )


def idle_service_thread(proc: ProcessReport, task: TaskWait) -> bool:
    """A thread that only waits for work: in a service loop's wait (its Python stack), or for a
    client to connect to a listening socket (the kernel's evidence)."""
    thread = next((t for t in proc.threads if task.python_thread == t.ident), None)
    if thread is not None and task.python_thread and idle_loop(thread.frames):
        return True
    return bool(task.waits_for) and all(e.kind == LISTENING for e in task.waits_for)


def idle_service(proc: ProcessReport) -> bool:
    """A healthy service waiting for work: its main thread waits in a service loop for the
    next request (a socketserver, an executor's worker, an asyncio loop with no task), or
    every thread of its waits for a client to connect. It waits by design: a helper, never
    the odd one out or the culprit."""
    if proc.busy or proc.exit_status or proc.state.startswith("stopped"):
        return False
    main = main_thread(proc)
    if main is not None:
        loops = [loop for loop in proc.event_loops if loop.thread == main.ident]
        if loops and all(not loop.tasks and not loop.tasks_left_out for loop in loops):
            return True
        if any(_in(f, _SERVICE_LOOPS) for f in main.frames):
            return idle_loop(main.frames)
    return bool(proc.tasks) and all(idle_service_thread(proc, t) for t in proc.tasks)


def _is_background(proc: ProcessReport) -> bool:
    return (
        any(word in proc.role for word in HELPERS)
        or proc.role_data().kind.startswith(HELPERS)
        or idle_service(proc)
    )


def group_processes(
    processes: list[ProcessReport], culprits: Collection[int] = ()
) -> list[StackGroup]:
    """The processes in groups of identical stacks, in reading order: the groups of the
    ``culprits`` the headline names first when given, else the outliers of a role whose peers
    mostly agree; then every other distinct process (the test's own, in tree order), then the
    crowds, then helpers and context. Within a role, the crowd is the largest group of
    identical stacks, of two or more, larger than any other of that role."""
    groups: dict[tuple[object, ...], StackGroup] = {}
    for proc in processes:
        key = stack_key(proc)
        groups.setdefault(key, StackGroup(str(key[0]))).processes.append(proc)
    by_role: dict[str, list[StackGroup]] = {}
    for group in groups.values():
        by_role.setdefault(group.role, []).append(group)
    for peers in by_role.values():
        sizes = sorted((len(g.processes) for g in peers), reverse=True)
        biggest = max(peers, key=lambda g: len(g.processes))
        if sizes[0] >= 2 and (len(sizes) == 1 or sizes[0] > sizes[1]):
            biggest.crowd = True
            for group in peers:
                group.outlier = group is not biggest

    named = set(culprits)

    def rank(group: StackGroup) -> int:
        if all(_is_background(p) for p in group.processes):
            return 3
        if named.intersection(group.pids) or (group.outlier and not named):
            return 0
        return 2 if group.crowd else 1

    return sorted(groups.values(), key=rank)  # stable: tree order within each rank

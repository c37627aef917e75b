"""Facts read from a process's Python frames: library or user code, where it waits, in what."""

from __future__ import annotations

import functools
import linecache
import os
import re
import sysconfig
from collections.abc import Callable

from ..inject.beats import COLLECTIVES as BEATEN
from ..report.groups import reimports
from ..report.model import AsyncTask, Collective, Frame, ProcessReport, ThreadStack, same_thread

#: A rank may wait in these too, which the progress beats do not count as collectives.
_NOT_BEATEN = (
    "isend",
    "irecv",
    "gather_object",
    "scatter_object_list",
    "batch_isend_irecv",
    "wait",
)
#: The collectives a rank's frames can wait in: the beats' list and the calls above.
COLLECTIVES = frozenset(BEATEN) | frozenset(_NOT_BEATEN)
STDLIB = os.path.realpath(sysconfig.get_paths()["stdlib"])
#: The functions of a rank's rendezvous (process-group start-up).
RENDEZVOUS = frozenset(
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


def is_library(frame: Frame) -> bool:
    """Code of the standard library, an installed package or this plugin: not the user's."""
    path = frame.filename
    return (
        path.startswith("<")
        or "/pytest_torchhang/" in path.replace(os.sep, "/")
        or "site-packages" in path
        or "dist-packages" in path
        or os.path.realpath(path).startswith(STDLIB)
    )


def in_file(frame: Frame, path_suffix: str, *names: str) -> bool:
    """The frame is in a file ending with ``path_suffix`` (in one of the functions ``names``)."""
    return frame.filename.replace(os.sep, "/").endswith(path_suffix) and (
        not names or frame.name in names
    )


def all_frames(proc: ProcessReport) -> list[Frame]:
    """Every frame of every thread of the process."""
    return [f for t in proc.threads for f in t.frames]


def main_thread(proc: ProcessReport) -> ThreadStack | None:
    """The thread that dumped the stacks, else the one named MainThread, else the first."""
    for thread in proc.threads:
        if thread.current or thread.name == "MainThread":
            return thread
    return proc.threads[0] if proc.threads else None


def has_frame(proc: ProcessReport, path_suffix: str, *names: str) -> bool:
    """Some thread of the process is in that file (in one of those functions)."""
    return any(in_file(f, path_suffix, *names) for f in all_frames(proc))


_CLASS_LINE = re.compile(r"^(\s*)class\s+([A-Za-z_]\w*)")


@functools.lru_cache(maxsize=256)
def enclosing_class(filename: str, lineno: int) -> str:
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


def innermost(proc: ProcessReport, pred: Callable[[Frame], bool]) -> Frame | None:
    """The innermost frame of the main thread that ``pred`` accepts."""
    main = main_thread(proc)
    return next((f for f in main.frames if pred(f)), None) if main else None


def importing(proc: ProcessReport) -> bool:
    """The main thread is importing a module (a spawn child still starting up), or running the
    main module's top level again as spawn does (``runpy``, with no importlib frame)."""
    main = main_thread(proc)
    return main is not None and (
        any(
            f.filename == "<frozen importlib._bootstrap>" and f.name == "_find_and_load"
            for f in main.frames
        )
        or bool(reimports(main.frames))
    )


_USER_FRAME_WINDOW = 6


def stuck_at(proc: ProcessReport) -> str:
    """Where the process's main thread waits: its innermost frame in user code, else the innermost."""
    main = main_thread(proc)
    if main is None or not main.frames:
        return ""
    task = stuck_task(proc, main)
    if task is not None:  # the thread's select() says nothing: the task's await point does
        return f"{task.awaited()} (asyncio task {task.name!r})"
    # a module's top level says nothing by itself: that spawn imports it again in the child does
    again = reimports(main.frames)
    if again:
        return again
    if any(in_file(f, "multiprocessing/util.py", "_exit_function") for f in main.frames) and any(
        in_file(f, "multiprocessing/queues.py", "_finalize_join", "join_thread")
        for f in main.frames
    ):
        return "exit (flushing a multiprocessing Queue)"
    # The innermost frame of user code, when it is close to the top: deeper than that (a fork child
    # still shows its parent's frames far below) the library call it is in says more.
    user = next((f for f in main.frames[:_USER_FRAME_WINDOW] if not is_library(f)), None)
    frame = user or main.frames[0]
    return frame.name


#: What an asyncio task can await that no other task of the loop ends (rules/aio.py's words).
AWAIT_POINTS = ("Event", "Lock", "Semaphore", "Condition", "Barrier", "Queue", "future")


def stuck_task(proc: ProcessReport, thread: ThreadStack) -> AsyncTask | None:
    """The first task awaiting an asyncio primitive without a timeout, of the loop that
    ``thread`` runs while it waits in ``select``."""
    if not thread.frames or not in_file(thread.frames[0], "selectors.py", "select"):
        return None
    for loop in proc.event_loops:
        if same_thread(loop.thread, thread.ident):
            return next((t for t in loop.tasks if t.awaits in AWAIT_POINTS and not t.timed), None)
    return None


def waits_in_user_code(proc: ProcessReport) -> bool:
    """The main thread waits in the user's code: a frame of it among the innermost, as
    :func:`stuck_at` looks for one (a worker idle in its loop waits in library code only)."""
    main = main_thread(proc)
    return main is not None and any(not is_library(f) for f in main.frames[:_USER_FRAME_WINDOW])


def pending_collective(proc: ProcessReport) -> Collective | None:
    """The rank's oldest flight-recorder entry that has not completed: where it waits."""
    return next((c for c in proc.collectives if not c.completed), None)


def last_completed(proc: ProcessReport) -> Collective | None:
    """The rank's newest flight-recorder entry that completed."""
    done = [c for c in proc.collectives if c.completed]
    return done[-1] if done else None


def in_backward(proc: ProcessReport) -> bool:
    """The main thread is in autograd's backward (DDP all-reduces gradients there)."""
    return (
        innermost(proc, lambda f: in_file(f, "torch/autograd/__init__.py", "backward")) is not None
    )


def collective_of(proc: ProcessReport) -> str | None:
    """The collective (or rendezvous) a rank waits in: the flight recorder's, else its frames'."""
    pending = pending_collective(proc)
    frame_name = frame_collective(proc)
    if pending is not None and frame_name not in RENDEZVOUS:
        return pending.name
    if frame_name is None and in_backward(proc):
        return "backward"  # DDP all-reduces gradients in backward; no flight recorder to say so
    return frame_name


def frame_collective(proc: ProcessReport) -> str | None:
    """The collective or rendezvous function of torch.distributed the main thread is in."""
    frame = innermost(
        proc,
        lambda f: (
            in_file(f, "torch/distributed/distributed_c10d.py")
            and f.name in COLLECTIVES | RENDEZVOUS
        ),
    )
    return frame.name if frame else None


def fork_parent(proc: ProcessReport, by_pid: dict[int, ProcessReport]) -> ProcessReport | None:
    """The parent ``proc`` was forked from (without exec): same command line, in the tree."""
    parent = by_pid.get(proc.ppid)
    return parent if parent is not None and parent.cmdline == proc.cmdline else None


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
    ("torch/distributed/distributed_c10d.py", tuple(COLLECTIVES | RENDEZVOUS), "{name}"),
]


def primitive(thread: ThreadStack | None) -> tuple[str, Frame | None]:
    """What the thread waits in, in the user's terms, and the user's frame that called it.

    ``("Event.wait()", Frame(dataset.py:31))``: the library call nearest to the user's code wins
    (the user called Event.wait, which called Condition.wait).
    """
    if thread is None or not thread.frames:
        return "", None
    frames = thread.frames
    user = next((i for i, f in enumerate(frames) if not is_library(f)), len(frames))
    for frame in reversed(frames[:user]):
        for suffix, names, label in _PRIMITIVES:
            if in_file(frame, suffix) and frame.name in names:
                cls = enclosing_class(frame.filename, frame.lineno) or "Condition"
                cls = "Lock" if cls == "SemLock" else cls
                return label.format(cls=cls, name=frame.name), (
                    frames[user] if user < len(frames) else None
                )
    if user < len(frames):
        frame = frames[user]
        line = frame.line
        if "acquire(" in line or ("with " in line and "lock" in line.lower()):
            # a C acquire called from the user's code: its object's name says what it is only
            # when it says lock (a semaphore's acquire is not a Lock's)
            match = re.search(r"([\w.\[\]]+)\.acquire\(", line)
            if match and "lock" not in match.group(1).lower():
                return f"{match.group(1)}.acquire()", frame
            return "Lock.acquire()", frame
        if "sleep(" in line:
            return "time.sleep()", frame
        if user == 0 and line:
            return f"`{line}`", frame  # a C call made straight from user code
    return "", frames[user] if user < len(frames) else None


def located(frame: Frame | None) -> str:
    """`` at dataset.py:31``, or nothing without a frame."""
    return f" at {os.path.basename(frame.filename)}:{frame.lineno}" if frame else ""

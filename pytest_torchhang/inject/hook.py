"""Start-up hook for every Python process of a guarded test: dump all thread stacks on a signal
(and, from the main thread, the pending tasks of its asyncio event loops).

This module must stay standard-library only and cheap to import: the injected ``sitecustomize``
loads it by path in every interpreter a guarded test starts, before any user code runs.
"""

from __future__ import annotations

import faulthandler
import functools
import os
import signal
import time
from typing import TYPE_CHECKING, Any, TextIO

from .protocol import (
    DUMP_DIR_ENV,
    DUMP_SIGNAL,
    THREAD_PREFIX,
    collectives_path,
    collectives_request_path,
    dump_path,
    notes_path,
    role_path,
    signals_path,
    tasks_path,
)
from .stderr import StderrTail

if TYPE_CHECKING:
    import threading
    from types import FrameType

# Wall time out of reach of a test's patches of ``time`` (freezegun, time-machine), as the
# package's ``clock.wall`` reads it (this module may not import the package): the host's while
# it agrees with its last trusted reading carried on the boot clock, else that reading carried.
# A note's time is compared with a capture's start.
_boottime = functools.partial(time.clock_gettime, time.CLOCK_BOOTTIME)
_realtime = functools.partial(time.time)
_anchor = (time.time(), _boottime())


def _wall() -> float:
    global _anchor
    wall_then, boot_then = _anchor
    now = _boottime()
    carried = wall_then + (now - boot_then)
    host = _realtime()
    if abs(host - carried) < 1.0:
        _anchor = (host, now)
        return host
    return carried


def name_thread(thread: threading.Thread) -> None:
    """Give a started thread of the plugin its Python name in the kernel too (Python before 3.14
    does not), where a reader from outside sees it."""
    if thread.native_id is None:
        return
    try:
        with open(f"/proc/self/task/{thread.native_id}/comm", "w") as comm:
            comm.write(thread.name.encode()[:15].decode(errors="ignore"))
    except OSError:  # no procfs (another platform), or the thread is gone
        pass


def child_note(text: str) -> None:
    """Record a failure of the plugin's own child-side code (a patch, a listener) for the report.

    Nothing the plugin does in a child may fail silently: the capture reads these notes into the
    hang report. Each line starts with the wall time, so a capture keeps only its test's notes.
    Never raises (no dump directory: nothing is written).
    """
    dump_dir = _Registration.dump_dir or os.environ.get(DUMP_DIR_ENV)
    if not dump_dir:
        return
    line = f"{_wall():.3f} " + " ".join(text.split())[:1000] + "\n"
    try:
        fd = os.open(
            notes_path(dump_dir, os.getpid()), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600
        )
    except OSError:
        return
    try:
        os.write(fd, line.encode("utf-8", "replace"))  # one write: lines never interleave
    except OSError:
        pass
    finally:
        os.close(fd)


def set_role(role: str) -> None:
    """Record this process's role for hang reports (no-op when no dump directory is set)."""
    dump_dir = _Registration.dump_dir or os.environ.get(DUMP_DIR_ENV)
    if dump_dir and os.path.isdir(dump_dir):
        try:
            with open(role_path(dump_dir, os.getpid()), "w") as out:
                out.write(role)
        except OSError as exc:
            child_note(
                f"pytest-torchhang could not record the role {role!r} of pid {os.getpid()}: {exc}"
            )


class _Registration:
    """Per-process state of the hook: which file the handler writes to (kept open on purpose)."""

    dump_dir: str | None = None
    file: TextIO | None = None
    pid: int = 0  # the process the handler was registered in (a fork child re-registers)
    fork_hook_installed = False
    finder_installed = False
    listener_pid = 0  # the process whose flight-recorder listener runs (not inherited by fork)
    #: Flight-recorder entries older than this (ns, wall clock) are not this process's: a fork
    #: copies its parent's ring buffer, and an earlier, destroyed process group leaves entries.
    group_since_ns = 0
    #: The dump handler chains to the Python one that writes the asyncio tasks (main thread).
    python_handler = False


def keep_stderr_tail() -> bool:
    """Copy what this process writes to ``sys.stderr`` to its file in the dump directory.

    For the processes of a guarded tree only (the start-up hook and every fork of a guarded
    process call it; pytest captures its own stderr). Returns False when there is no dump
    directory or no ``sys.stderr``. Idempotent: an inherited wrapper is kept (it opens this
    process's own file at its first write).
    """
    import sys

    dump_dir = _Registration.dump_dir or os.environ.get(DUMP_DIR_ENV)
    stream = sys.stderr
    if not dump_dir or stream is None:
        return False
    if isinstance(stream, StderrTail):
        stream._torchhang_dir = dump_dir
        return True
    sys.stderr = StderrTail(stream, dump_dir, child_note)
    return True


def guarded_env() -> dict[str, str]:
    """Extra environment variables every process of a guarded tree gets, unless the user set them.

    ``TORCH_FR_BUFFER_SIZE`` turns on torch's flight recorder, so a hang report can show each
    rank's last collectives; it must be set before a process group is created.
    """
    return {"TORCH_FR_BUFFER_SIZE": "100"}


def _register() -> None:
    dump_dir = _Registration.dump_dir
    if dump_dir is None:
        return
    inherited = _Registration.file
    try:
        new_file = open(dump_path(dump_dir, os.getpid()), "w")  # noqa: SIM115 - must outlive us
    except OSError as exc:
        child_note(
            f"pytest-torchhang could not open the stack dump file of pid {os.getpid()}, so its "
            f"stacks cannot be taken: {exc}"
        )
        return
    if inherited is None:  # faulthandler is not registered here yet: install its chain first
        _chain_python_handler()
    chain = _Registration.python_handler
    faulthandler.register(DUMP_SIGNAL, file=new_file, all_threads=True, chain=chain)
    _Registration.file = new_file
    _Registration.pid = os.getpid()
    if inherited is not None and inherited is not new_file:
        # After fork the parent's file object came along; close our copy of its descriptor so
        # every fork generation does not carry one more open file.
        try:  # noqa: SIM105 - no contextlib: this module must stay cheap to import
            inherited.close()
        except OSError:
            pass


def _after_fork() -> None:
    """A fork child of a guarded process is a process of the tree: its own dump file, and its
    own stderr tail (a fork of the pytest process included, whose stderr pytest does not show
    as the child's)."""
    _register()
    if _Registration.dump_dir is not None:
        try:
            keep_stderr_tail()
        except Exception as exc:
            child_note(
                f"pytest-torchhang could not keep the stderr lines of pid {os.getpid()}: "
                f"{type(exc).__name__}: {exc}"
            )


def install(dump_dir: str | None = None) -> bool:
    """Register the dump handler for this process and, through ``os.register_at_fork``, its forks
    (which also keep their stderr tail: see :func:`keep_stderr_tail`).

    Returns False (and does nothing) when no dump directory is configured or it does not exist.
    """
    dump_dir = dump_dir or os.environ.get(DUMP_DIR_ENV)
    if not dump_dir or not os.path.isdir(dump_dir):
        return False
    if (
        _Registration.dump_dir == dump_dir
        and _Registration.pid == os.getpid()
        and _Registration.file is not None
    ):
        return True  # already answering in this process (the start-up hook, then the runner)
    _Registration.dump_dir = dump_dir
    _register()
    if not _Registration.fork_hook_installed:
        os.register_at_fork(after_in_child=_after_fork)
        _Registration.fork_hook_installed = True
    try:  # ranks' collectives are a bonus: never break the start-up
        _install_finder()
    except Exception as exc:
        child_note(
            f"pytest-torchhang could not hook torch.distributed in pid {os.getpid()} (no flight-"
            f"recorder entries from it): {type(exc).__name__}: {exc}"
        )
    return True


#: Flight-recorder fields kept per entry (the rest, such as frames, stays in the process).
_FR_KEYS = (
    "collective_seq_id",
    "profiling_name",
    "input_sizes",
    "state",
    "retired",
    "process_group",
)


def _sibling(name: str) -> Any:
    """``pytest_torchhang.inject.<name>``, loaded by path as the start-up hook loads this module
    (importing the package would need pytest); the loaded one when there is one."""
    import sys

    full = f"pytest_torchhang.inject.{name}"
    module = sys.modules.get(full)
    if module is None:
        import importlib.util

        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
        spec = importlib.util.spec_from_file_location(full, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"no {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[full] = module
        spec.loader.exec_module(module)
    return module


def _dump_collectives(out_path: str, since_ns: int) -> None:
    import json
    import pickle

    try:  # the rank's role and store waits, read now: they hold whatever the entries hold
        facts: dict[str, object] = _sibling("ranks").rank_facts()
    except Exception as exc:
        facts = {"errors": [f"{type(exc).__name__}: {exc}"]}
    try:
        import torch

        dump = torch._C._distributed_c10d._dump_fr_trace  # type: ignore[attr-defined,unused-ignore]
        try:  # without C++ stack traces: symbolising them takes seconds
            raw = dump(includeStackTraces=False)
        except TypeError:  # an older torch without the argument
            raw = dump()
        entries = [
            e
            for e in pickle.loads(raw).get("entries", [])
            if (e.get("time_created_ns") or 0) >= since_ns
        ]
        doc: dict[str, object] = {"entries": [{k: e.get(k) for k in _FR_KEYS} for e in entries]}
    except Exception as exc:  # stacks must still work: the capture reads the error instead
        doc = {"error": f"{type(exc).__name__}: {exc}"}
    doc.update(facts)
    tmp = out_path + ".tmp"
    with open(tmp, "w") as out:
        json.dump(doc, out, default=str)
    os.replace(tmp, out_path)


def _serve_collectives(fifo: str, out_path: str, since_ns: int) -> None:
    while True:
        try:
            fd = os.open(fifo, os.O_RDONLY)  # blocks until the capture opens the other end
            try:
                os.read(fd, 64)
            finally:
                os.close(fd)
            _dump_collectives(out_path, since_ns)
        except Exception as exc:
            # Said here, or the report would read the missing answer as a GIL held in C.
            child_note(
                f"pytest-torchhang's flight-recorder listener in pid {os.getpid()} died, so its "
                f"collectives cannot be shown: {type(exc).__name__}: {exc}"
            )
            try:  # noqa: SIM105 - no contextlib: this module must stay cheap to import
                os.unlink(fifo)  # nobody listens: the capture must not ask
            except OSError:
                pass
            return


def start_collectives_listener(since_ns: int | None = None) -> bool:
    """Answer flight-recorder requests from a daemon thread of this process (ranks only).

    A Python signal handler would not run while the rank's main thread waits in C++; this thread
    blocks on a FIFO in the dump directory and, when the capture writes to it, writes the
    entries of ``torch._C._distributed_c10d._dump_fr_trace()`` next to the stack dump.
    Started once per process, after ``init_process_group``; ``since_ns`` (wall clock, ns) is
    when that call began: older entries are left out. Returns False when there is no dump
    directory or it cannot start.
    """
    dump_dir = _Registration.dump_dir or os.environ.get(DUMP_DIR_ENV)
    if not dump_dir or not os.path.isdir(dump_dir) or _Registration.listener_pid == os.getpid():
        return False
    pid = os.getpid()
    fifo = collectives_request_path(dump_dir, pid)
    try:
        if os.path.exists(fifo):
            os.unlink(fifo)  # left by an earlier process with this pid
        os.mkfifo(fifo, 0o600)
    except OSError as exc:
        child_note(
            f"pytest-torchhang could not start the flight-recorder listener of pid {pid}: {exc}"
        )
        return False
    import threading

    thread = threading.Thread(
        target=_serve_collectives,
        args=(fifo, collectives_path(dump_dir, pid), since_ns or _Registration.group_since_ns),
        name=f"{THREAD_PREFIX}flight-recorder",
        daemon=True,
    )
    thread.start()
    name_thread(thread)
    _Registration.listener_pid = pid
    return True


def _wrap_init(module: object) -> None:
    init = getattr(module, "init_process_group", None)
    if init is None or getattr(init, "_torch_hang_wrapped", False):
        return
    import functools

    @functools.wraps(init)
    def init_process_group(*args: object, **kwargs: object) -> object:
        _Registration.group_since_ns = int(_wall() * 1e9)
        result = init(*args, **kwargs)
        start_collectives_listener()
        return result

    init_process_group._torch_hang_wrapped = True  # type: ignore[attr-defined]
    module.init_process_group = init_process_group  # type: ignore[attr-defined]
    try:  # the key a rank waits for in store.get/wait, for its hang report
        _sibling("ranks").wrap_stores()
    except Exception as exc:
        child_note(
            f"pytest-torchhang could not record the store keys pid {os.getpid()} waits for: "
            f"{type(exc).__name__}: {exc}"
        )
    import sys

    package = sys.modules.get("torch.distributed")
    if package is not None and getattr(package, "init_process_group", None) is init:
        package.init_process_group = init_process_group  # type: ignore[attr-defined]


class _C10dFinder:
    """Import hook: wraps ``init_process_group`` when torch.distributed's c10d module loads."""

    name = "torch.distributed.distributed_c10d"

    @classmethod
    def find_spec(cls, fullname: str, path: object = None, target: object = None) -> object:
        if fullname != cls.name:
            return None
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(fullname, path)  # type: ignore[arg-type]
        loader = getattr(spec, "loader", None)
        exec_module = getattr(loader, "exec_module", None)
        if spec is None or exec_module is None:
            return spec

        def exec_and_wrap(module: object) -> None:
            exec_module(module)
            try:
                _wrap_init(module)
            except Exception as exc:
                child_note(
                    f"pytest-torchhang could not wrap init_process_group in pid {os.getpid()} "
                    f"(no flight-recorder entries from it): {type(exc).__name__}: {exc}"
                )

        loader.exec_module = exec_and_wrap  # type: ignore[union-attr]
        return spec


def _install_finder() -> None:
    import sys

    if _Registration.finder_installed:
        return
    _Registration.finder_installed = True
    loaded = sys.modules.get(_C10dFinder.name)
    if loaded is not None:
        _wrap_init(loaded)  # torch came first (the zygote's preload): wrap in place
    else:
        sys.meta_path.insert(0, _C10dFinder)  # type: ignore[arg-type]


# --- asyncio tasks -------------------------------------------------------------------------
# A thread that runs an event loop shows only the loop's ``select`` in its stack: what hangs
# is in suspended coroutines. On the dump signal faulthandler writes the threads' stacks (in C,
# at once), then chains to a Python handler that writes the pending tasks of the process's
# running loops to ``PID.tasks.json`` as soon as the main thread runs Python code again.

#: Bounds of one snapshot: tasks per loop, coroutine frames per task, locals and timers read.
MAX_TASKS = 200
MAX_TASK_FRAMES = 40
_MAX_LOCALS = 50
_MAX_TIMERS = 1000

#: asyncio's await points (a task's innermost coroutine frame), by qualified name.
_PRIMITIVES = {
    "Event.wait": "Event",
    "Lock.acquire": "Lock",
    "Condition.wait": "Condition",
    "Condition.wait_for": "Condition",
    "Semaphore.acquire": "Semaphore",
    "Barrier.wait": "Barrier",
    "Barrier._block": "Barrier",
    "Barrier._wait": "Barrier",
    "Queue.get": "Queue",
    "Queue.put": "Queue",
    "Queue.join": "Queue",
    "sleep": "sleep",
}
_PRIMITIVE_FILES = ("asyncio/locks.py", "asyncio/queues.py", "asyncio/tasks.py")


def _qualname(code: Any, owner: object = None) -> str:
    """``Event.wait``: the code's qualified name (3.10 has none: found in ``owner``'s classes)."""
    qualname = getattr(code, "co_qualname", None)  # 3.11+
    if qualname:
        return str(qualname)
    name = str(code.co_name)
    classes = type(owner).__mro__ if owner is not None else ()
    for cls in classes:
        if getattr(cls.__dict__.get(name), "__code__", None) is code:
            return f"{cls.__name__}.{name}"
    return name


def _all_tasks(asyncio: Any) -> list[Any]:
    """Every task the process knows of, whatever its loop: 3.10 to 3.13 keep them in
    module-level sets (a copy that meets a set changing size in another thread is retried)."""
    found: list[Any] = []
    for name in ("_all_tasks", "_scheduled_tasks", "_eager_tasks"):
        group = getattr(asyncio.tasks, name, None)
        for _ in range(100 if group is not None else 0):
            try:
                found.extend(list(group))  # type: ignore[arg-type]
                break
            except RuntimeError:
                continue
    return found


def _running_loops(asyncio: Any) -> list[Any]:
    """Loops found in the threads' frames (``self`` of ``run_forever``), for a Python that keeps
    its tasks in no module-level set (3.14 keeps them per thread)."""
    import sys

    loops: list[Any] = []
    for top in sys._current_frames().values():
        frame: FrameType | None = top
        while frame is not None:
            code = frame.f_code
            if code.co_name == "run_forever" and code.co_filename.endswith("base_events.py"):
                loop = frame.f_locals.get("self")
                if isinstance(loop, asyncio.AbstractEventLoop) and loop not in loops:
                    loops.append(loop)
                break
            frame = frame.f_back
    return loops


def _coroutine_frames(coro: Any) -> list[Any]:
    """A task's suspended frames, outermost first, down its coroutines' ``cr_await`` chain (it
    ends where a future is awaited: the task's ``_fut_waiter``), async generators included."""
    frames: list[Any] = []
    obj = coro
    while obj is not None and len(frames) < MAX_TASK_FRAMES:
        frame = getattr(obj, "cr_frame", None) or getattr(obj, "ag_frame", None)
        frame = frame or getattr(obj, "gi_frame", None)
        if frame is None:
            break
        frames.append(frame)
        obj = _awaited_by(obj, frame)
    return frames


#: What a frame awaits when it awaits an async generator (``async for``, ``__anext__()``).
_ASEND = ("async_generator_asend", "async_generator_athrow")


def _awaited_by(obj: Any, frame: Any) -> Any:
    """What the coroutine (or async generator, or generator) ``obj`` awaits."""
    if hasattr(obj, "cr_frame"):
        awaited = obj.cr_await
    elif hasattr(obj, "ag_frame"):
        awaited = obj.ag_await
    else:
        awaited = getattr(obj, "gi_yieldfrom", None)
    if type(awaited).__name__ in _ASEND:
        # The asend object does not say its generator: it is the one running among the objects
        # the suspended frame holds (its locals, its closure's cells, and its value stack, where
        # ``async for`` keeps it).
        import gc

        held = gc.get_referents(obj, frame)
        for cell in [ref for ref in held if type(ref).__name__ == "cell"]:
            try:
                held.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
        awaited = next(
            (
                ref
                for ref in held
                if type(ref).__name__ == "async_generator" and getattr(ref, "ag_running", False)
            ),
            None,
        )
    return awaited


def _await_point(frames: list[Any]) -> tuple[str, Any, Any]:
    """(kind, frame, owner) of the asyncio primitive the user's code awaits: the outermost of
    the innermost frames in asyncio's own files (``Queue.join`` awaits its own ``Event``)."""
    found: tuple[str, Any, Any] = ("", None, None)
    for frame in reversed(frames):  # innermost first
        if not frame.f_code.co_filename.replace(os.sep, "/").endswith(_PRIMITIVE_FILES):
            break
        owner = frame.f_locals.get("self")
        kind = _PRIMITIVES.get(_qualname(frame.f_code, owner), "")
        if kind:
            found = (kind, frame, owner)
    return found


def _awaits(frames: list[Any], waiter: Any, names: dict[int, str]) -> dict[str, Any]:
    """What a task waits for: an asyncio primitive (one's await point is among its innermost
    frames), another task, a ``gather()`` of tasks, or a future."""
    out: dict[str, Any] = {"kind": "", "call": "", "obj": 0, "detail": "", "tasks": []}
    kind, frame, owner = _await_point(frames)
    if kind:
        method = _qualname(frame.f_code, owner).rpartition(".")[2]
        out["kind"] = kind
        out["call"] = f"{type(owner).__name__}.{method}()" if owner is not None else "sleep()"
        if owner is not None:
            out["obj"] = id(owner)
            out["detail"] = _primitive_state(kind, owner)
        return out
    if waiter is None:
        return out
    children = getattr(waiter, "_children", None)
    if children is not None:  # the future of a gather()
        out.update(kind="gather", call="gather()")
        out["tasks"] = [names[id(c)] for c in children if id(c) in names]
    elif id(waiter) in names:
        out.update(kind="task", call=f"task {names[id(waiter)]!r}", tasks=[names[id(waiter)]])
    else:
        out.update(kind="future", call=type(waiter).__name__, obj=id(waiter))
    return out


def _primitive_state(kind: str, owner: Any) -> str:
    """``not set``, ``locked``, ``0 item(s) of unbounded``: the awaited primitive's state."""
    try:
        if kind == "Event":
            return "set" if owner.is_set() else "not set"
        if kind in ("Lock", "Semaphore"):
            return "locked" if owner.locked() else "free"
        if kind == "Queue":
            size = f"of {owner.maxsize}" if owner.maxsize > 0 else "of unbounded"
            unfinished = getattr(owner, "_unfinished_tasks", 0)
            done = f", {unfinished} not task_done()" if unfinished else ""
            return f"{owner.qsize()} item(s) {size}{done}"
    except Exception:  # a user's subclass: its state is a bonus
        pass
    return ""


def _timer_refs(loop: Any) -> set[int]:
    """Ids of what the loop's live timers will wake: a future (``sleep()``, ``wait_for()`` on
    3.10/3.11), a task (``asyncio.timeout()``'s), the object of a bound callback."""
    refs: set[int] = set()
    for handle in list(getattr(loop, "_scheduled", ()))[:_MAX_TIMERS]:
        if getattr(handle, "_cancelled", False):
            continue
        callback = getattr(handle, "_callback", None)
        for ref in (getattr(callback, "__self__", None), *(getattr(handle, "_args", ()) or ())):
            if ref is not None:
                refs.add(id(ref))
                task = getattr(ref, "_task", None)  # asyncio.timeout()'s Timeout
                if task is not None:
                    refs.add(id(task))
    return refs


def _loop_facts(loop: Any) -> dict[str, Any]:
    """What could still wake the loop: ready callbacks, timers, file descriptors, signals
    (-1: unknown, a loop of another kind than asyncio's own)."""
    try:
        ssock = getattr(loop, "_ssock", None)
        own = ssock.fileno() if ssock is not None else -1  # its self-pipe: only for call_soon
        fds = len([fd for fd in loop._selector.get_map() if fd != own])
    except Exception:
        fds = -1
    scheduled = getattr(loop, "_scheduled", None)
    ready = getattr(loop, "_ready", None)
    return {
        "loop": f"{type(loop).__module__}.{type(loop).__qualname__}",
        "ready": len(ready) if ready is not None else -1,
        "timers": len([h for h in scheduled if not h._cancelled]) if scheduled is not None else -1,
        "fds": fds,
        "signal_handlers": len(getattr(loop, "_signal_handlers", None) or {}) + _user_handlers(),
    }


#: Python signal handlers that cannot end a wait: Ctrl-C's (pytest's, asyncio.run's) and ours.
_NOT_WAKERS = ("Runner._on_sigint", "default_int_handler")


def _user_handlers() -> int:
    """Python-level signal handlers of the process's own (a signal from outside runs them,
    and they could end a wait), Ctrl-C's and the plugin's left out."""
    count = 0
    for signum in signal.valid_signals():
        try:
            handler = signal.getsignal(signum)
        except (ValueError, OSError):
            continue
        handler = getattr(handler, "func", handler)  # asyncio.run's: a functools.partial
        ours = str(getattr(handler, "__module__", "")).startswith("pytest_torchhang")
        waker = getattr(handler, "__qualname__", "") not in _NOT_WAKERS
        if callable(handler) and waker and not ours:
            count += 1
    return count


def signal_snapshot() -> dict[str, Any]:
    """What only this process can tell of its signals: its pending ``ITIMER_REAL`` alarm
    (``signal.alarm``, ``setitimer``) and its Python handlers by signal name (Ctrl-C's and the
    plugin's own left out), for a report to say what a signal would still end."""
    handlers: dict[str, str] = {}
    for signum in signal.valid_signals():
        try:
            handler = signal.getsignal(signum)
            name = signal.Signals(signum).name
        except (ValueError, OSError):
            continue
        handler = getattr(handler, "func", handler)
        qualname = str(getattr(handler, "__qualname__", "") or type(handler).__name__)
        ours = str(getattr(handler, "__module__", "")).startswith("pytest_torchhang")
        if callable(handler) and not ours and qualname not in _NOT_WAKERS:
            handlers[name] = qualname
    return {"alarm_s": signal.getitimer(signal.ITIMER_REAL)[0], "handlers": handlers}


def _write_signals() -> None:
    """Write :func:`signal_snapshot` to this process's ``PID.signals.json``."""
    import json

    dump_dir = _Registration.dump_dir
    if dump_dir is None:
        return
    path = signals_path(dump_dir, os.getpid())
    try:  # without them the report says only what /proc shows: no note needed
        with open(path + ".tmp", "w") as out:
            json.dump({"pid": os.getpid(), **signal_snapshot()}, out)
        os.replace(path + ".tmp", path)
    except (OSError, ValueError):
        pass


def _task_row(task: Any, names: dict[int, str], timers: set[int]) -> dict[str, Any]:
    """One task: its frames, what it awaits, whether a timer wakes it, what its frames hold."""
    coro = task.get_coro()
    frames = _coroutine_frames(coro)
    waiter = getattr(task, "_fut_waiter", None)
    awaits = _awaits(frames, waiter, names)
    wake = {id(task), awaits["obj"]} | ({id(waiter)} if waiter is not None else set())
    refs: set[int] = set()
    for frame in frames:
        refs.update(id(value) for value in list(frame.f_locals.values())[:_MAX_LOCALS])
    code = getattr(coro, "cr_code", None) or getattr(coro, "gi_code", None)
    return {
        "name": task.get_name(),
        "coro": _qualname(code) if code is not None else type(coro).__name__,
        "frames": [
            [f.f_code.co_filename, f.f_lineno or 0, _qualname(f.f_code, f.f_locals.get("self"))]
            for f in reversed(frames)  # most recent call first, as threads' stacks
        ],
        "awaits": awaits,
        "timed": bool(wake & timers),
        "refs": refs,
    }


def asyncio_snapshot() -> list[dict[str, Any]]:
    """The running event loops of this process, each with its pending tasks and their coroutine
    stacks (what ``python -m asyncio pstree`` shows on 3.14), as JSON-ready data.

    It only reads, from any thread (the capture's, or the main thread's signal handler). Empty
    when asyncio was never imported; bounded by ``MAX_TASKS`` and ``MAX_TASK_FRAMES``. Object
    ids (``obj``, ``refs``) mean something within one snapshot only: which tasks refer to (in a
    local of one of their frames) the primitive another task waits on.
    """
    import sys
    import threading

    asyncio = sys.modules.get("asyncio")
    if asyncio is None or not hasattr(asyncio, "tasks"):
        return []
    tasks = _all_tasks(asyncio)
    loops = list({id(t._loop): t._loop for t in tasks if getattr(t, "_loop", None)}.values())
    if sys.version_info >= (3, 14):  # native tasks live per thread, in no module-level set
        for loop in _running_loops(asyncio):
            if loop not in loops:
                loops.append(loop)
                tasks.extend(asyncio.all_tasks(loop))
    # No threading.enumerate(): its lock may be held by the very code the main thread's signal
    # handler interrupted. A copy of the dict needs none (names are a bonus).
    try:
        threads = {i: t.name for i, t in dict(getattr(threading, "_active", {})).items()}
    except RuntimeError:  # changed size while copied
        threads = {}
    current = getattr(asyncio.tasks, "_current_tasks", {})
    out: list[dict[str, Any]] = []
    for loop in loops:
        if not loop.is_running() or loop.is_closed():
            continue  # nothing runs it, so nothing of it is stuck (an earlier test's loop)
        pending = [
            t for t in dict.fromkeys(tasks) if getattr(t, "_loop", None) is loop and not t.done()
        ]
        names = {id(t): t.get_name() for t in pending}
        timers = _timer_refs(loop)
        rows = [_task_row(t, names, timers) for t in pending[:MAX_TASKS]]
        awaited = {row["awaits"]["obj"] for row in rows} - {0}
        for task, row in zip(pending[:MAX_TASKS], rows, strict=True):
            row["refs"] = sorted(row["refs"] & awaited)
            row["state"] = "running" if current.get(loop) is task else "pending"
        ident = getattr(loop, "_thread_id", None)
        out.append(
            {
                "thread": hex(ident) if ident else "",
                "thread_name": threads.get(ident, "") if ident else "",
                **_loop_facts(loop),
                "tasks": rows,
                "tasks_left_out": max(len(pending) - MAX_TASKS, 0),
            }
        )
    return out


def _write_tasks() -> None:
    """Write this process's snapshot to its ``PID.tasks.json`` (only where asyncio is imported)."""
    import sys

    dump_dir = _Registration.dump_dir
    if dump_dir is None or "asyncio" not in sys.modules:
        return
    import json

    try:
        doc: dict[str, Any] = {"pid": os.getpid(), "loops": asyncio_snapshot()}
    except Exception as exc:  # the stacks are taken already: say why the tasks are not
        doc = {"pid": os.getpid(), "loops": [], "error": f"{type(exc).__name__}: {exc}"}
    doc["written"] = _wall()
    path = tasks_path(dump_dir, os.getpid())
    with open(path + ".tmp", "w") as out:
        json.dump(doc, out, default=str)
    os.replace(path + ".tmp", path)


def _on_dump_signal(signum: int, frame: object) -> None:
    """The Python half of the dump handler (faulthandler chains to it): the asyncio tasks."""
    try:
        _write_signals()
        _write_tasks()
    except Exception as exc:  # never into the user's code
        child_note(
            f"pytest-torchhang could not write the asyncio tasks of pid {os.getpid()}: "
            f"{type(exc).__name__}: {exc}"
        )


def _chain_python_handler() -> bool:
    """Install :func:`_on_dump_signal` as the handler faulthandler chains to, before it
    registers. Where that cannot be (not the main thread; the user's own handler is there),
    faulthandler does not chain: chaining to the default action would kill the process."""
    current = signal.getsignal(DUMP_SIGNAL)
    if getattr(current, "__qualname__", None) == _on_dump_signal.__qualname__:
        # An earlier copy of this module (pytester's inline sessions import it anew) chained
        # it: faulthandler's registration chains to it still, and signal.signal would take
        # faulthandler's place in the kernel.
        _Registration.python_handler = True
        return True
    if current not in (signal.SIG_DFL, None):
        return False
    # An earlier copy's registration that did not chain: it is registered again, chained.
    faulthandler.unregister(DUMP_SIGNAL)
    try:
        signal.signal(DUMP_SIGNAL, _on_dump_signal)
    except ValueError:  # not the main thread
        return False
    _Registration.python_handler = True
    return True


def uninstall() -> None:
    """Stop answering the dump signal in this process (used by the pytest process at the end)."""
    _Registration.dump_dir = None
    _Registration.pid = 0
    try:  # noqa: SIM105
        faulthandler.unregister(DUMP_SIGNAL)
    except (RuntimeError, ValueError):
        pass
    if _Registration.python_handler:
        _Registration.python_handler = False
        try:  # noqa: SIM105
            signal.signal(DUMP_SIGNAL, signal.SIG_DFL)
        except (ValueError, OSError):  # not the main thread: ours stays, and only reads
            pass
    if _Registration.file is not None:
        _Registration.file.close()
        _Registration.file = None


def stress_requested(switch: str) -> bool:
    """Whether this run is stressed (inject/stress.py's ``seed_from_env``, without loading it: a
    plain run of a stressed hunt never does): the variable holds a seed, or names the hunt's
    switch file holding one."""
    if not switch or switch.isdigit():
        return bool(switch)
    try:
        with open(switch) as state:
            return state.read(32).strip().isdigit()
    except OSError:
        return False

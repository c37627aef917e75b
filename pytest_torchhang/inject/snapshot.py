"""What only a process itself can tell at a dump: the pending tasks of its running asyncio event
loops, and its signals (its pending alarm, its Python handlers).

Read from any thread (the capture's own, for the pytest process; the dump handler's Python half,
``hook._on_dump_signal``, in a child). Standard library only and cheap to import, like all of
``inject/``: the start-up hook loads it by path before ``hook.py``, which imports it.
"""

from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from types import FrameType


# --- asyncio tasks -------------------------------------------------------------------------
# A thread that runs an event loop shows only the loop's ``select`` in its stack: what hangs
# is in suspended coroutines. The dump handler's Python half (``hook._on_dump_signal``) writes
# the pending tasks of the process's running loops to ``PID.tasks.json``.

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

"""Both ends of a wait: what a blocked thread waits on, who could end that wait, and what each
of those is doing now or did last (issue 28, item 2).

One mechanism for any hang, described or not: it reads the report's facts (the wait-for graph,
every thread's stack, exits and stderr tails) and states them; it never names a cause the
evidence does not show. The ``nobody`` rule and the ``none`` fallback speak through it.
"""

from __future__ import annotations

import linecache
import os
import re

from ..report.groups import idle_loop, idle_service_thread, is_plugin_thread
from ..report.model import Frame, ProcessReport, TaskWait, ThreadStack
from ..report.waits import Futex, Socket, WaitEnd, WaitFacts
from .frames import in_file, is_library, located, main_thread, primitive
from .graph import SLEEP_CALLS, doing, ignored, task_thread, who
from .sigterm import sigterm_facts
from .tracebacks import last_traceback

#: What ends each kind of wait, in the user's terms (by the primitive's label).
_ENDED_BY: tuple[tuple[str, str], ...] = (
    (
        "Future.result()",
        "the thread that runs its task (an executor's worker, a thread running an event "
        "loop) or a call of set_result",
    ),
    ("queue.Queue.put()", "a thread that takes an item from the queue (get)"),
    ("queue.Queue.get()", "a thread that puts an item in the queue"),
    ("queue.Queue.join()", "one task_done() call for every item put in the queue"),
    ("Thread.join()", "the end of the thread it joins"),
    ("Barrier.wait()", "every party of the Barrier arriving at it"),
    ("Event.wait()", "a thread that sets the Event"),
    ("Condition.wait()", "a thread that notifies the Condition"),
    ("Lock.acquire()", "the thread that holds the lock releasing it"),
)

#: Where a thread waits for a module's import lock (another thread is importing that module).
_IMPORT_LOCK = (("<frozen importlib._bootstrap>", ("_lock_unlock_module", "acquire")),)
_IMPORTING = ("_load_unlocked", "_find_and_load", "exec_module")


def ended_by(name: str) -> str:
    """What ends a wait in ``name`` (``Thread.join()``), or "" when the table does not say."""
    return next((words for label, words in _ENDED_BY if name == label), "")


def _thread_name(thread: ThreadStack | None) -> str:
    return (thread.name or thread.ident) if thread is not None else ""


def _awaits_import_lock(thread: ThreadStack) -> bool:
    return any(
        f.filename.startswith("<frozen importlib") and f.name == "_lock_unlock_module"
        for f in thread.frames[:3]
    )


def importing(thread: ThreadStack) -> str:
    """The module file the thread is importing (its innermost module frame under importlib),
    or ""."""
    frames = thread.frames
    for i, frame in enumerate(frames):
        if frame.name == "<module>" and any(
            f.filename.startswith("<frozen importlib") and f.name in _IMPORTING
            for f in frames[i + 1 : i + 6]
        ):
            return os.path.basename(frame.filename)
    return ""


def loop_thread(proc: ProcessReport, thread: ThreadStack | None) -> bool:
    """The thread runs an asyncio event loop (the capture saw the loop, or its stack is inside
    the loop's ``_run_once``)."""
    if thread is None:
        return False
    if any(loop.thread == thread.ident for loop in proc.event_loops):
        return True
    return any(in_file(f, "asyncio/base_events.py", "_run_once") for f in thread.frames)


def _pool_workers(proc: ProcessReport, prefix: str) -> list[ThreadStack]:
    return [t for t in proc.threads if t.name.startswith(prefix)]


_POOL_THREAD = re.compile(r"^(ThreadPoolExecutor-\d+_)\d+$")


def thread_end(proc: ProcessReport, thread: ThreadStack) -> WaitEnd:
    """What one other thread of the waiting process is doing."""
    task = next((t for t in proc.tasks if t.python_thread == thread.ident), None)
    name, frame = primitive(thread)
    desc = f"thread '{_thread_name(thread)}' of {who(proc)}"
    if (task is not None and idle_service_thread(proc, task)) or idle_loop(thread.frames):
        where = name or (thread.frames[0].name if thread.frames else "")
        return WaitEnd(proc.pid, thread.name, desc, "idle", f"waits for work in {where}")
    if _awaits_import_lock(thread):
        return WaitEnd(
            proc.pid,
            thread.name,
            desc,
            "waits",
            "waits for a module's import lock "
            f"(another thread is importing that module){located(_user(thread))}",
        )
    if task is not None and (task.call == "running" or task.state == "R"):
        return WaitEnd(proc.pid, thread.name, desc, "running", f"runs{located(frame)}")
    if task is not None and task.call in SLEEP_CALLS:
        return WaitEnd(proc.pid, thread.name, desc, "sleeps", f"sleeps{located(frame)}")
    where = name or (f"`{frame.line}`" if frame is not None and frame.line else "")
    where = where or (thread.frames[0].name if thread.frames else "an unknown place")
    return WaitEnd(proc.pid, thread.name, desc, "waits", f"waits in {where}{located(frame)}")


def earlier(proc: ProcessReport, thread: ThreadStack) -> bool:
    """A thread an earlier test left in the pytest process (``graph.ignored``): it cannot know
    the objects this test made, so it ends none of its waits."""
    task = next((t for t in proc.tasks if t.python_thread == thread.ident), None)
    return task is not None and ignored(proc, task)


def _user(thread: ThreadStack) -> Frame | None:
    return next((f for f in thread.frames if not is_library(f)), None)


def _exited(proc: ProcessReport, how: str) -> WaitEnd:
    """An exited process as an end: how it ended, its last stderr lines and, where they hold a
    traceback, its uncaught exception and where it was raised."""
    end = WaitEnd(proc.pid, "", who(proc), "exited", how, list(proc.stderr_tail[-4:]))
    raised = last_traceback(list(proc.stderr_tail))
    if raised is not None:
        end.exception, end.raised_in, end.called_by = (
            raised.exception,
            raised.raised_in(),
            raised.called_by(),
        )
    return end


def _process_end(proc: ProcessReport) -> WaitEnd:
    """What another process (one the wait-for graph names) is doing, or did last."""
    if proc.exit_status:
        return _exited(proc, proc.exit_status)
    if proc.state.startswith("stopped"):
        return WaitEnd(proc.pid, "", who(proc), "stopped", "is stopped")
    if not proc.threads and proc.stderr_tail:  # gone while it was captured: its last words
        return _exited(proc, "ended")
    main = main_thread(proc)
    if main is not None and main.frames and in_file(main.frames[0], "/threading.py", "_shutdown"):
        others = [
            thread_end(proc, t).where
            for t in proc.threads
            if t is not main and not is_plugin_thread(t)
        ]
        return WaitEnd(
            proc.pid,
            "",
            who(proc),
            "exiting",
            "has finished its main code and, exiting, waits in threading._shutdown for its "
            f"non-daemon threads to end ({'; '.join(others) or 'none is shown'})",
        )
    state = "running" if proc.busy else "waits"
    return WaitEnd(proc.pid, "", who(proc), state, doing(proc))


def wait_facts(
    proc: ProcessReport, task: TaskWait | None, procs: list[ProcessReport]
) -> WaitFacts | None:
    """Both ends of the wait of ``proc``'s main thread (``task``): the object, who could end it
    (the other threads of its process for a wait inside the process, the processes the
    wait-for graph names for one across processes, its exited children), and what the
    evidence says about the wait. None when the process shows no stack."""
    thread = task_thread(proc, task) if task is not None else main_thread(proc)
    if thread is None:
        return None
    name, frame = primitive(thread)
    if task is not None and isinstance(task.wait, Socket) and task.call:
        peer = f" from {task.wait.remote}" if task.wait.remote else ""
        waits_in = f"{task.call}{peer}{located(frame)}"
    else:
        waits_in = f"{name or proc.stuck_at or 'an unknown place'}{located(frame)}"
    facts = WaitFacts(proc.pid, _thread_name(thread), waits_in)
    by_pid = {p.pid: p for p in procs}
    across = sorted(
        {e.pid for e in (task.waits_for if task else []) if e.pid > 0 and e.pid != proc.pid}
    )
    facts.ends += [_process_end(by_pid[pid]) for pid in across if pid in by_pid]
    if not across:
        facts.ends += [
            thread_end(proc, t)
            for t in proc.threads
            if t.ident != thread.ident and not is_plugin_thread(t) and not earlier(proc, t)
        ]
    facts.ends += [
        _process_end(p)
        for p in procs
        if p.pid not in across
        and ((p.ppid == proc.pid and p.exit_status) or (p.ppid == 0 and not p.threads))
        and (p.exit_status or p.stderr_tail)
    ]
    facts.known += _known(proc, thread, name, facts.ends, procs)
    facts.known += sigterm_facts(proc, task, procs)
    return facts


def _known(
    proc: ProcessReport,
    thread: ThreadStack,
    name: str,
    ends: list[WaitEnd],
    procs: list[ProcessReport],
) -> list[str]:
    """What the evidence says about this wait beyond where each end is."""
    known = pool_handlers(proc, name)
    putters = [e for e in ends if "multiprocessing Queue.put()" in e.where]
    if (putters or name == "multiprocessing Queue.put()") and not _anyone_in(procs, "Queue.get()"):
        known.append(
            "a put into a multiprocessing queue blocks when the queue is full; no thread of "
            "any process of the test waits to get from a queue: no reader drains it now"
        )
    ending = ended_by(name)
    if ending:
        known.append(f"{name} ends by {ending}")
    task = next((t for t in proc.tasks if t.python_thread == thread.ident), None)
    if loop_thread(proc, thread):
        # a system call on a file or socket is a blocking call made by loop code; a wait on a
        # primitive of the process is a wait on the thread that should run the loop
        if task is not None and isinstance(task.wait, Socket):
            known.append(
                "it is a blocking call made on the thread of a running asyncio event loop: "
                "while it blocks, no task or callback of that loop runs"
            )
        else:
            known.append(
                "it waits in the thread of its own event loop, which runs nothing while it waits"
            )
    # a lock's: a futex wait, or a `with` whose __enter__ runs in C (the user's line is the
    # innermost frame: no Python __enter__ above it), which only a lock's is among blocking ones
    lock = (task is not None and isinstance(task.wait, Futex)) or bool(
        thread.frames
        and not is_library(thread.frames[0])
        and re.match(r"^\s*with\s", thread.frames[0].line)
    )
    held = holds_already(thread.frames, "thread", "the lock" if lock else "what")
    if held:
        known.append(held)
    module = importing(thread)
    if module:
        known.append(f"it waits while it is itself importing {module}")
    live = [e for e in ends if e.thread and e.state != "idle"]
    match = _POOL_THREAD.match(thread.name)
    if name == "Future.result()" and match:
        workers = _pool_workers(proc, match.group(1))
        if len(workers) == 1:
            known.append(
                f"it is itself the only worker thread of its executor ('{thread.name}'): a "
                "task of that executor waits for a result only that same worker could compute"
            )
    if name == "Future.result()":
        known += _busy_executors(proc, thread)
        known += _process_pool(proc, procs)
    if name == "Future.result()" and not loop_thread(proc, thread):
        runners = [
            t
            for t in proc.threads
            if t.ident != thread.ident
            and (
                _POOL_THREAD.match(t.name)
                or t.name.startswith("asyncio_")
                or loop_thread(proc, t)
                or any(in_file(f, "concurrent/futures/process.py", "run") for f in t.frames)
            )
        ]
        if not runners:
            known.append(
                "no other thread of the process runs an executor's task or an event loop: the "
                "thread that was to complete it ended or never started, or is one of the "
                "threads named here, waiting"
            )
    if name == "queue.Queue.put()" and not any("Queue.get()" in e.where for e in live):
        known.append(
            "no thread of the process waits to take from a queue: the consumer thread ended or "
            "never started, or is one of the threads named here, waiting elsewhere"
        )
    if name == "queue.Queue.join()":
        getters = [e for e in ends if "Queue.get()" in e.where]
        if getters:
            known.append(
                f"{len(getters)} thread(s) wait in queue.Queue.get(): if they serve this queue, "
                "it is empty (every item was taken) and at least one item was never marked "
                "task_done()"
            )
    if name == "Barrier.wait()" or any("Barrier.wait()" in e.where for e in live):
        known.append(
            "a Barrier.wait() ends when every party arrives: a party that is none of the "
            "threads waiting in it ended (an exception, a return) or never reached it"
        )
    if any("import lock" in e.where for e in live) and module:
        known.append(
            "a thread waits for a module's import lock while this thread, inside an import, "
            "waits for it: neither can move until the import ends"
        )
    return known


def render(facts: WaitFacts, *, head: bool = True) -> str:
    """The wait in words, rendered from its facts: ``waits in X. Who could end it: A waits in
    Y; B exited with code 1 (its last stderr line: …). Known: …``; without ``head``, only the
    sentences after the first."""
    parts = []
    for end in facts.ends:
        line = f"{end.who} {end.where}"
        if end.exception:
            line += f" with an uncaught {end.exception.split(':', 1)[0]}, raised in {end.raised_in}"
            line += f" (called by the library's {end.called_by})" if end.called_by else ""
            line += f": `{end.exception}`"
        elif end.last_lines:
            line += f" (its last stderr line: `{end.last_lines[-1].strip()}`)"
        parts.append(line)
    sentences = [f"waits in {facts.waits_in}."] if head else []
    if parts:
        sentences.append("Who could end it: " + "; ".join(parts) + ".")
    if facts.known:
        sentences.append("Known: " + "; ".join(facts.known) + ".")
    return " ".join(sentences)


def pool_thread(thread: ThreadStack) -> bool:
    """A worker thread of a ``ThreadPoolExecutor`` (by its name or its loop)."""
    return bool(_POOL_THREAD.match(thread.name)) or any(
        in_file(f, "concurrent/futures/thread.py", "_worker") for f in thread.frames
    )


def _busy_executors(proc: ProcessReport, waiter: ThreadStack) -> list[str]:
    """Executors whose every worker thread waits, inside a task, in ``Future.result()``."""
    pools: dict[str, list[ThreadStack]] = {}
    for thread in proc.threads:
        match = _POOL_THREAD.match(thread.name)
        if match:
            pools.setdefault(match.group(1), []).append(thread)
    said = []
    for prefix, workers in sorted(pools.items()):
        if all(primitive(t)[0] == "Future.result()" for t in workers):
            many = "its only worker thread" if len(workers) == 1 else f"all {len(workers)} workers"
            said.append(
                f"executor '{prefix.rstrip('_')}' has {many} waiting itself in Future.result() "
                "inside a task: no worker of it is free to run another task, so a result of "
                "that same executor is never computed"
            )
    return said


_WITH = re.compile(
    r"^\s*(?:async\s+)?with\s+(.+?)\s*(?:as\s+\w+\s*)?:|^\s*(?:await\s+)?([\w.\[\]]+)\.acquire\("
)


def _held_expr(line: str) -> str:
    match = _WITH.match(line)
    return (match.group(1) or match.group(2) or "") if match else ""


def holds_already(frames: list[Frame], holder: str, what: str = "what") -> str:
    """The stack (innermost first) waits at ``with X:`` (or ``X.acquire(``) while a frame lower
    in the same stack runs inside a ``with X:`` of its own (the same expression, in the same
    file): it already holds what it waits for, if ``X`` is the same object there. Says also
    when the frames between were entered by a signal handler (a frame on a
    ``signal.signal(`` line). ``holder``: "thread" or "task"; ``what``: "the lock" when the
    wait is known to be a lock's (a futex under a ``with``, an asyncio Lock)."""
    top = next((i for i, f in enumerate(frames) if not is_library(f)), None)
    if top is None:
        return ""
    here = frames[top]
    expr = _held_expr(here.line)
    if not expr:
        return ""
    for i in range(top + 1, len(frames)):
        low = frames[i]
        if low.filename != here.filename:
            continue
        lines = linecache.getlines(low.filename)
        inside = _enclosing_with(lines, low.lineno, expr)
        if not inside:
            continue
        same = "" if low.name == here.name else f", if {expr} is the same object there"
        said = (
            f"the same {holder} holds {what} it waits for{same}: lower in the same stack, "
            f"{low.name} at {os.path.basename(low.filename)}:{low.lineno} runs inside "
            f"`{lines[inside - 1].strip()}` (line {inside})"
        )
        handler = next(
            (
                f
                for f in frames[top + 1 : i]
                if "signal.signal(" in f.line
                or (f.name.startswith("handle") and "signum" in f.line)
            ),
            None,
        )
        if handler is not None:
            said += (
                f", and the frames between were entered by a signal handler "
                f"({located(handler).strip()}) that interrupted it there"
            )
        return said
    return ""


def _enclosing_with(lines: list[str], lineno: int, expr: str) -> int:
    """The line number of a ``with expr:`` (or ``expr.acquire(``) whose block holds line
    ``lineno``, within its function; 0 when there is none."""
    if not lines or lineno > len(lines):
        return 0
    here = lines[lineno - 1]
    indent = len(here) - len(here.lstrip())
    for number in range(lineno - 1, 0, -1):
        text = lines[number - 1]
        if not text.strip() or text.lstrip().startswith("#"):
            continue
        depth = len(text) - len(text.lstrip())
        if depth >= indent:
            continue
        if text.lstrip().startswith(("def ", "async def ", "class ")):
            return 0
        if _held_expr(text) == expr:
            return number
        indent = depth
    return 0


def _inside_block(lines: list[str], head: int, line: int) -> bool:
    """Line ``line`` is in the indented block under line ``head`` (1-based)."""
    if not lines or line > len(lines):
        return False
    indent = len(lines[head - 1]) - len(lines[head - 1].lstrip())
    for text in lines[head:line]:
        if text.strip() and len(text) - len(text.lstrip()) <= indent:
            return False
    return True


def _anyone_in(procs: list[ProcessReport], call: str) -> bool:
    """Some thread of some process of the tree waits in ``call`` (``Queue.get()``)."""
    return any(call in primitive(t)[0] for p in procs for t in p.threads)


#: A multiprocessing.Pool's handler threads in the parent, by the function they run.
_POOL_HANDLERS = ("_handle_workers", "_handle_tasks", "_handle_results")


def pool_handlers(proc: ProcessReport, name: str) -> list[str]:
    """For a wait on a Pool's result: what the Pool's result-handler thread (the one that
    delivers results and runs callbacks) is doing, or that it is gone."""
    if name not in ("Pool.map()", "AsyncResult.get()", "Event.wait()"):
        return []
    running = {
        h: t
        for t in proc.threads
        if not earlier(proc, t)  # an earlier test's Pool is not this one
        for h in _POOL_HANDLERS
        if any(in_file(f, "multiprocessing/pool.py", h) for f in t.frames)
    }
    if not running:
        return []
    results = running.get("_handle_results")
    if results is None:
        if name == "Event.wait()":
            return []
        return [
            "the Pool's result-handler thread (which delivers every result) is not among its "
            "threads while its other handler threads are: it ended, and no result is "
            "delivered any more"
        ]
    user = _user(results)
    if user is not None:
        inner, frame = primitive(results)
        return [
            f"the Pool's result-handler thread '{results.name}', which delivers every result "
            f"and runs the callbacks, waits{' in ' + inner if inner else ''} inside a "
            f"callback ({user.name}{located(frame)}): while it waits, it delivers no result"
        ]
    return []


def _process_pool(proc: ProcessReport, procs: list[ProcessReport]) -> list[str]:
    """A ``ProcessPoolExecutor``'s manager thread runs in ``proc`` and no worker process of it
    is alive in the tree."""
    managers = [
        t
        for t in proc.threads
        if any(in_file(f, "concurrent/futures/process.py", "run") for f in t.frames)
    ]
    if not managers:
        return []
    workers = [
        p
        for p in procs
        if p.ppid == proc.pid
        and not p.exit_status
        and any(
            in_file(f, "concurrent/futures/process.py", "_process_worker")
            for t in p.threads
            for f in t.frames
        )
    ]
    if workers:
        return []
    return [
        f"the process pool's manager thread '{managers[0].name}' waits for a result, and no "
        "worker process of the pool is alive among the test's processes: its workers exited "
        "and none replaced them, or none ever started"
    ]

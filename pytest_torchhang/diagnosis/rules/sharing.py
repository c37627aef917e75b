"""Rules for what processes share: a Queue flushed at exit, a Manager, a Pool, a pipe, a FIFO,
semaphore slots that leaked, an end marker nobody puts, a full pipe read only after the wait, a
chain of joins to what its processes send only after them."""

from __future__ import annotations

import linecache
import os
import re

from ...report.groups import idle_service
from ...report.model import Frame, Hint, ProcessReport, TaskWait
from ...report.waits import (
    CHILD,
    HOLDS_READ_END,
    HOLDS_WRITE_END,
    MAPS,
    SOCKET_PEER,
    Fifo,
    Pipe,
    Semaphore,
    Socket,
)
from ..ends import pool_handlers, wait_facts
from ..frames import (
    enclosing_class,
    has_frame,
    in_file,
    innermost,
    is_library,
    located,
    main_thread,
    primitive,
)
from ..graph import (
    READS,
    WRITES,
    acquire_held,
    blocked_line,
    chain,
    code,
    cycle_text,
    doing,
    edge_lines,
    edges_to,
    following_lines,
    holds_an_acquire,
    ignored,
    joins,
    main_task,
    task_thread,
    user_frame,
    wait_kind,
    waiters_text,
    who,
)
from ..roles import MANAGER_SERVER, POOL_WORKER, is_helper, is_pytest, is_rank, role_of


def hint_queue_join(procs: list[ProcessReport]) -> list[Hint]:
    """A process joins a child that waits at exit for its Queue's data to be read."""
    flushing = [
        p
        for p in procs
        if has_frame(p, "multiprocessing/queues.py", "_finalize_join", "join_thread")
        or (
            has_frame(p, "multiprocessing/util.py", "_exit_function")
            and has_frame(p, "multiprocessing/queues.py")
        )
    ]
    joining = [
        p
        for p in procs
        if has_frame(p, "multiprocessing/popen_fork.py", "wait", "poll")
        or has_frame(p, "multiprocessing/process.py", "join")
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
            rule="queue_join",
            pids=sorted({p.pid for p in flushing + joining}),
        )
    ]


def hint_manager(procs: list[ProcessReport]) -> list[Hint]:
    """Processes wait on a Manager proxy: the server is blocked serving it, or gone."""
    clients = [p for p in procs if has_frame(p, "multiprocessing/managers.py", "_callmethod")]
    if not clients:
        return []
    servers = [p for p in procs if role_of(p) == MANAGER_SERVER]
    # A server thread whose innermost Python frame is serve_client itself is inside a C call made
    # for a client (Lock.acquire, Event.wait, ...): that call blocks every proxy waiting on it.
    blocked = [
        (
            s.pid,
            f"Manager server (pid {s.pid}) thread {t.ident} in {t.frames[0].name}: {t.frames[0].line}",
        )
        for s in servers
        for t in s.threads
        if t.frames
        and (
            in_file(t.frames[0], "multiprocessing/managers.py", "serve_client")
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
    return [
        Hint(
            text,
            [f"{p.role} (pid {p.pid}) in _callmethod" for p in clients] + [b for _, b in blocked],
            rule="manager",
            pids=sorted({p.pid for p in clients} | {pid for pid, _ in blocked}),
        )
    ]


def _pool_parent(proc: ProcessReport) -> Frame | None:
    return innermost(
        proc, lambda f: in_file(f, "multiprocessing/pool.py", "map", "starmap", "get", "wait")
    )


def hint_pool_lost(procs: list[ProcessReport]) -> list[Hint]:
    """A Pool call waits while every worker of its Pool is idle: its task is lost."""
    hints = []
    for parent in procs:
        if _pool_parent(parent) is None:
            continue
        workers = [p for p in procs if p.ppid == parent.pid and role_of(p) == POOL_WORKER]
        idle = [
            w
            for w in workers
            if not w.busy and innermost(w, lambda f: in_file(f, "multiprocessing/queues.py", "get"))
        ]
        if not workers or len(idle) != len(workers):
            continue  # a worker still works (or is stuck in the task): another story
        name, frame = primitive(main_thread(parent))
        oldest = max(w.age_s for w in workers)
        young = [w for w in workers if oldest - w.age_s > 0.5]
        dead = [p for p in procs if p.ppid == parent.pid and p.exit_status]
        based = [f"{who(w)} idle, waiting for a task (age {w.age_s:.1f}s)" for w in workers]
        if young or dead:
            evidence = ", ".join(
                f"{who(w)} is {oldest - w.age_s:.1f}s younger than its siblings" for w in young
            ) or ", ".join(f"pid {d.pid} {d.exit_status}" for d in dead)
            text = (
                f"{who(parent)} waits in {name or 'a Pool call'}{located(frame)} for results that will never "
                f"come: a Pool worker died with a task ({evidence}: the Pool replaced a dead worker), "
                f"and multiprocessing.Pool does not run a lost task again; all {len(workers)} Pool "
                "workers are idle, waiting for a task. Find what killed the worker (the OOM killer, a signal, os._exit), or use "
                "concurrent.futures.ProcessPoolExecutor, which raises BrokenProcessPool instead."
            )
            based += [f"pid {d.pid}: {d.exit_status}" for d in dead]
        else:
            # what the Pool's result-handler thread does is evidence; a lost task is a guess
            handler = pool_handlers(parent, name)
            text = (
                f"{who(parent)} waits in {name or 'a Pool call'}{located(frame)} while all "
                f"{len(workers)} Pool workers are idle, waiting for a task: nothing is computing "
                + (
                    f"the results it waits for; {handler[0]}."
                    if handler
                    else "the results it waits for (a task lost with a worker that died, or "
                    "results awaited from a different Pool)."
                )
            )
        facts = wait_facts(parent, main_task(parent), procs)
        hints.append(
            Hint(
                text,
                based,
                rule="pool_lost",
                pids=[parent.pid, *(w.pid for w in workers)],
                waits=[facts] if facts is not None else [],
            )
        )
    return hints


def _reads(proc: ProcessReport) -> list[tuple[TaskWait, Frame | None]]:
    out = []
    main = main_task(proc)
    # in the pytest process, only the test's own thread: others may be left over from earlier tests
    for task in [main] if is_pytest(proc) and main else proc.tasks:
        if task.call in ("read", "readv", "recvfrom", "recvmsg") and isinstance(
            task.wait, (Pipe, Socket)
        ):
            thread = task_thread(proc, task)
            if thread is not None:
                _, frame = primitive(thread)
                out.append((task, frame or (thread.frames[0] if thread.frames else None)))
    return out


def _cycle_through(
    procs: list[ProcessReport], reader: ProcessReport, writers: list[ProcessReport | None]
) -> str:
    """The cycle the reader is in when each writer's wait leads back to it, in words."""
    for writer in writers:
        if writer is None or writer.pid == reader.pid:
            continue
        path, end = chain(procs, writer)
        if end == "cycle" and reader in path:
            return (
                f". Those waits form a cycle: {cycle_text(path)}; none of them can move until "
                "one of them stops waiting (write before you wait, or do not wait for it)"
            )
    return ""


def hint_pipe(procs: list[ProcessReport]) -> list[Hint]:
    """Reads of a pipe or socket whose writers are in the tree and idle: nothing will come."""
    by_pid = {p.pid: p for p in procs}
    hits, based, pids = [], [], []
    for proc in procs:
        if has_frame(proc, "multiprocessing/managers.py", "_callmethod") or has_frame(
            proc, "torch/utils/data/dataloader.py", "_try_get_data"
        ):
            continue  # a Manager client, or a DataLoader waiting for its workers: other rules
        if (is_rank(proc) or is_helper(proc)) or proc.busy:
            continue
        if role_of(proc) == POOL_WORKER and has_frame(proc, "multiprocessing/pool.py", "worker"):
            continue  # waiting for a task is what an idle Pool worker does
        if idle_service(proc):
            continue  # an executor's worker, a server: waiting for work by design
        for task, frame in _reads(proc):
            writers = [by_pid.get(e.pid) for e in task.waits_for]
            if any(
                w is None or w.busy or w.exit_status or w.state.startswith("stopped")
                for w in writers
            ):
                continue  # a writer outside the tree, busy, dead or stopped: another story
            ends = "; ".join(
                "itself (its own copy)" if w.pid == proc.pid else f"{who(w)}, which {doing(w)}"
                for w in writers
                if w is not None
            )
            hits.append(
                f"{who(proc)} reads {task.obj}{located(frame)}; the other end is held by {ends}"
                + _cycle_through(procs, proc, writers)
            )
            based.append(f"{who(proc)} blocked in {task.summary()}")
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


def _fifo_open(task: TaskWait) -> tuple[str, str, str] | None:
    """(path, the end it opens, who holds it) of a thread blocked opening a FIFO; None for any
    other wait."""
    wait = task.wait
    if task.call not in ("open", "openat") or not isinstance(wait, Fifo) or not wait.opening:
        return None
    return wait.path, wait.opening, wait.held


def hint_fifo(procs: list[ProcessReport]) -> list[Hint]:
    """A process blocked opening a FIFO whose other end no process of the tree opens."""
    out = []
    for proc in procs:
        task = main_task(proc)
        found = _fifo_open(task) if task is not None and not proc.exit_status else None
        if task is None or found is None:
            continue
        path, end, held = found
        other = "writing" if end == "reading" else "reading"
        # opening one end blocks only while nobody has the other end open: whoever holds the
        # FIFO holds this end, and no thread of the tree is blocked opening the other one
        held = held.replace("open in", "it is open only in") if held.startswith("open in") else held
        _, frame = primitive(task_thread(proc, task) or main_thread(proc))
        waiters = edges_to(procs, proc.pid)
        out.append(
            Hint(
                f"{who(proc)} is blocked opening the FIFO {path} for {end}{located(frame)}: "
                f"opening a FIFO waits until another process opens it for {other}, and {held}, "
                f"nor is any blocked opening it: nobody in the tree will ever open its other end."
                + (f" Meanwhile {waiters_text(waiters)}." if waiters else "")
                + f" Start the process that opens it for {other} first, open it with O_RDWR or "
                "O_NONBLOCK, or use a regular file or an os.pipe() the test creates.",
                [blocked_line(proc), *edge_lines(waiters, proc)],
                rule="fifo",
                pids=sorted({proc.pid, *(p.pid for p, _ in waiters)}),
            )
        )
    return out


# --- causes named in the user's words: the kind of object, and the action that is missing ---


def _acquire_line(proc: ProcessReport, task: TaskWait) -> tuple[str, Frame] | None:
    """(the semaphore's expression, the user's frame) of a thread blocked in ``X.acquire()`` or
    ``with X:`` called straight from the user's code (not through a Condition or an Event)."""
    thread = task_thread(proc, task)
    if thread is None or not thread.frames:
        return None
    frames = thread.frames
    top = 0
    # threading.Semaphore.acquire waits in its Condition, and `with` on a multiprocessing
    # SemLock enters through synchronize.py: the user's call is below them
    while top < len(frames) and (
        in_file(frames[top], "threading.py", "wait", "acquire")
        or in_file(frames[top], "multiprocessing/synchronize.py", "__enter__")
    ):
        top += 1
    if top and not any(
        in_file(f, "threading.py", "acquire") or in_file(f, "multiprocessing/synchronize.py")
        for f in frames[:top]
    ):
        return None
    if top >= len(frames) or is_library(frames[top]):
        return None
    match = re.match(r"^\s*(?:with\s+([\w.\[\]]+)\s*:|([\w.\[\]]+)\.acquire\()", frames[top].line)
    if not match:
        return None
    return (match.group(1) or match.group(2)), frames[top]


def _threading_semaphore(proc: ProcessReport, task: TaskWait) -> bool:
    thread = task_thread(proc, task)
    return thread is not None and any(
        in_file(f, "threading.py", "acquire")
        and enclosing_class(f.filename, f.lineno) == "Semaphore"
        for f in thread.frames[:3]
    )


def _cannot_release(proc: ProcessReport, task: TaskWait, waiting: set[tuple[int, int]]) -> bool:
    """A thread that will not release the semaphore: it waits in acquire itself, or waits for
    a child's or a thread's end without holding an acquire in its frames."""
    if (proc.pid, task.tid) in waiting:
        return True
    if proc.busy or wait_kind(proc, task) in ("running", "sleeping", "stopped", "unknown"):
        return False
    thread = task_thread(proc, task)
    joining = joins(proc, task) or (
        thread is not None
        and bool(thread.frames)
        and in_file(thread.frames[min(1, len(thread.frames) - 1)], "threading.py", "join")
    )
    return joining and not holds_an_acquire(thread)


def hint_leaked_slots(procs: list[ProcessReport]) -> list[Hint]:
    """A semaphore (or lock) at count 0 that every live process that could release waits on,
    or waits for a child without holding: its slots were acquired and never released."""
    by_pid = {p.pid: p for p in procs}
    hints = []
    # multiprocessing: a SemLock in /dev/shm, waited on from the user's own acquire()
    groups: dict[str, list[tuple[ProcessReport, TaskWait, str, Frame]]] = {}
    for proc in procs:
        for task in proc.tasks:
            if isinstance(task.wait, Semaphore) and not ignored(proc, task):
                found = _acquire_line(proc, task)
                if found:
                    groups.setdefault(task.wait.path, []).append((proc, task, *found))
    for waiters in groups.values():
        sem = waiters[0][1].wait
        assert isinstance(sem, Semaphore)
        if sem.value not in (0, None):
            continue  # a slot is free: the waiters are about to run
        if sem.value is None and any(t.args[2:3] != [0] for _, t, _, _ in waiters):
            continue  # unread, and the waits were not entered on a count of 0 either
        waiting = {(p.pid, t.tid) for p, t, _, _ in waiters}
        sharers = {e.pid for _, t, _, _ in waiters for e in t.waits_for if e.kind == MAPS}
        if any(pid not in by_pid for pid in sharers):
            continue
        others = [by_pid[pid] for pid in sorted(sharers) if pid not in {p for p, _ in waiting}]
        mappers = others + list({p.pid: p for p, *_ in waiters}.values())
        if not all(
            _cannot_release(o, t, waiting) for o in mappers for t in o.tasks if not ignored(o, t)
        ):
            continue  # a thread that runs, sleeps or may hold a slot could still release it
        hints.append(_leaked_hint(procs, waiters, others, sem))
    # threading: every thread of a process waits in Semaphore.acquire, or joins without holding
    for proc in procs:
        tasks = [t for t in proc.tasks if not ignored(proc, t)]
        stuck = [
            (proc, t, *found)
            for t in tasks
            if _threading_semaphore(proc, t) and (found := _acquire_line(proc, t))
        ]
        if not stuck or proc.busy:
            continue
        waiting = {(proc.pid, t.tid) for _, t, _, _ in stuck}
        if all(_cannot_release(proc, t, waiting) for t in tasks):
            hints.append(_leaked_hint(procs, stuck, [], None))
    return hints


_SEMAPHORES = ("BoundedSemaphore", "Semaphore", "RLock", "Lock")


def _created_as(name: str, procs: list[ProcessReport]) -> tuple[Frame, str] | None:
    """(the line, the class) where a function still on a stack of the tree made a semaphore or
    lock called ``name`` (``slots = ctx.BoundedSemaphore(2)``, above the line that function
    is at); None unless exactly one line does (a name alone is no proof: two are none)."""
    made = re.compile(
        rf"^\s*(?:self\.)?{re.escape(name)}\s*(?::[^=]+)?=\s*[\w.]*?\b({'|'.join(_SEMAPHORES)})\("
    )
    found: dict[tuple[str, int], tuple[Frame, str]] = {}
    for frame in (f for p in procs for t in p.threads for f in t.frames if not is_library(f)):
        lines = linecache.getlines(frame.filename)[: frame.lineno]
        for number in range(len(lines), 0, -1):
            line = lines[number - 1]
            if match := made.match(line):
                made_at = Frame(frame.filename, number, frame.name, code(line.strip()))
                found[(frame.filename, number)] = (made_at, match.group(1))
            if line.lstrip().startswith(("def ", "async def ")):
                break  # the function's own lines only
    return next(iter(found.values())) if len(found) == 1 else None


def _leaked_hint(
    procs: list[ProcessReport],
    waiters: list[tuple[ProcessReport, TaskWait, str, Frame]],
    others: list[ProcessReport],
    sem: Semaphore | None,
) -> Hint:
    """The hint of a leaked semaphore: ``sem`` for a multiprocessing one, None for threading."""
    name, frame = waiters[0][2], waiters[0][3]
    pids = sorted({p.pid for p, *_ in waiters})
    where = ", ".join(
        sorted(
            {f"{who(p)}" + (f" thread {t.tid}" if t.tid != p.pid else "") for p, t, _, _ in waiters}
        )
    )
    if sem is not None:
        what = (
            f"`{name}`, a multiprocessing semaphore (a Semaphore, BoundedSemaphore or Lock: the "
            f"SemLock at {sem.path})"
        )
        count = (
            f"its count is {sem.value} (read from the semaphore)"
            if sem.value is not None
            else f"its count could not be read ({sem.unread}), and its waiters went to sleep "
            "on a count of 0 (the value their futex wait expects)"
        )
    else:
        what = f"`{name}`, a threading Semaphore or BoundedSemaphore"
        count = "its count is 0 (Semaphore.acquire waits only while it is)"
    created = _created_as(name.rsplit(".", 1)[-1], [*procs])
    if created is not None:
        what += (
            f", created (by its name) as a {created[1]} at "
            f"{os.path.basename(created[0].filename)}:{created[0].lineno}: `{created[0].line}`"
        )
    holders = "; ".join(
        f"{who(o)} {doing(o)}, and holds no acquire of it in its frames" for o in others
    ) or (
        "no other live process maps it, and every other thread of the waiting processes waits "
        "too, without an acquire of it in its frames"
        if sem is not None
        else "every other thread of the process waits in the same acquire, or joins threads "
        "without holding an acquire in its frames"
    )
    exited = [p for p in procs if p.exit_status and p.ppid in {o.pid for o in others} | set(pids)]
    gone = (
        "; gone meanwhile: " + ", ".join(f"{who(p)}, which {p.exit_status}" for p in exited)
        if exited
        else ""
    )
    text = (
        f"{where} wait{'s' if len(waiters) == 1 else ''} in {name}.acquire(){located(frame)} on "
        f"{what}: {count}, and no live process holds a slot in a way that will release it: "
        f"{holders}{gone}. Its slots leaked: they were acquired on a path that returned or raised "
        f"without release(). Take it with `with {name}:` (or release it in a finally block), "
        "so that every path gives the slot back."
    )
    based = [f"{who(p)} blocked in {t.summary()}" for p, t, _, _ in waiters]
    based += [blocked_line(o) for o in others]
    return Hint(text, based, rule="leaked_slots", pids=sorted(set(pids) | {o.pid for o in others}))


_MARKER = re.compile(r"\b(\w+)\s+is\s+(None|[A-Z_]{3,})\b|==\s*(None|[A-Z_]{3,}|['\"]\w+['\"])")


def _end_marker(frame: Frame) -> tuple[int, str] | None:
    """The line after a ``get()`` that ends the consumer's loop on a marker (``if item is
    None: return``), or the ``iter(queue.get, None)`` of the line itself."""
    if re.search(r"\biter\(\s*[\w.]+\.get\s*,\s*([^)]+)\)", frame.line):
        return frame.lineno, frame.line
    if ".get(" in frame.line and _MARKER.search(frame.line):  # while (x := q.get()) is not None
        return frame.lineno, frame.line
    for number, text in following_lines(frame, 4)[:2]:
        if text.startswith(("if ", "while ", "elif ")) and _MARKER.search(text):
            return number, text
    return None


def _queue_get(proc: ProcessReport, task: TaskWait) -> Frame | None:
    """The user's frame of a thread blocked in a multiprocessing Queue's get()."""
    thread = task_thread(proc, task)
    if thread is None or not any(
        in_file(f, "multiprocessing/queues.py", "get") for f in thread.frames
    ):
        return None
    frame = next((f for f in thread.frames if not is_library(f)), None)
    if frame is None or not re.search(r"\.get\(|\biter\(\s*[\w.]+\.get\s*,", frame.line):
        return None
    return frame


def hint_end_marker(procs: list[ProcessReport]) -> list[Hint]:
    """A consumer that stops on an end marker waits on an empty Queue whose every writer waits
    (for a child's exit, or in get() itself): the marker it needs will never be put."""
    by_pid = {p.pid: p for p in procs}
    hints = []
    for proc in procs:
        task = main_task(proc)
        if task is None or not isinstance(task.wait, Pipe) or task.call not in READS:
            continue
        frame = _queue_get(proc, task)
        marker = _end_marker(frame) if frame else None
        if frame is None or marker is None:
            continue
        writers = {e.pid for e in task.waits_for if e.kind == HOLDS_WRITE_END} - {proc.pid}
        if not writers or any(w not in by_pid for w in writers):
            continue
        idle = [by_pid[w] for w in sorted(writers)]
        if (
            not all(
                (t := main_task(w)) is not None and (joins(w, t) or _queue_get(w, t) is not None)
                for w in idle
            )
            or any(_sends_later(w) for w in idle)
            or not all(map(_only_waits, [proc, *idle]))
        ):
            continue  # a writer that may still put (later in its code, or on another thread)
        number, text = marker
        hints.append(
            Hint(
                f"{who(proc)} waits in Queue.get(){located(frame)} for the end-of-stream marker "
                f"that ends its loop (line {number}: `{code(text)}`), and the queue is empty (its "
                "reader is blocked reading the queue's pipe). No live process will put it: the "
                "queue's write end is held by "
                + "; ".join(f"{who(w)}, which {doing(w)}" for w in idle)
                + ". Each end marker stops one consumer: put one marker per consumer (a "
                "producer that puts one for several leaves all but one waiting), or stop the "
                "consumers another way (a timeout, an Event).",
                [blocked_line(proc), *(blocked_line(w) for w in idle)],
                rule="end_marker",
                pids=[proc.pid, *(w.pid for w in idle)],
            )
        )
    return hints


def _ancestors(by_pid: dict[int, ProcessReport], proc: ProcessReport) -> set[int]:
    """``proc`` and its ancestors in the tree (a shell between a parent and the writer)."""
    out = {proc.pid}
    while (parent := by_pid.get(proc.ppid)) is not None and parent.pid not in out:
        out.add(parent.pid)
        proc = parent
    return out


def hint_full_pipe(procs: list[ProcessReport]) -> list[Hint]:
    """A child blocked writing a full pipe whose only reader waits for that child to exit."""
    by_pid = {p.pid: p for p in procs}
    hints = []
    for proc in procs:
        task = main_task(proc)
        if task is None or not isinstance(task.wait, Pipe) or task.call not in WRITES:
            continue
        readers = {e.pid for e in task.waits_for if e.kind == HOLDS_READ_END} - {proc.pid}
        if not readers or any(r not in by_pid for r in readers):
            continue
        parents = [by_pid[r] for r in sorted(readers)]
        line = _ancestors(by_pid, proc)
        waiting = [
            r
            for r in parents
            if (t := main_task(r)) is not None
            and any(e.pid in line and e.kind == CHILD for e in t.waits_for)
        ]
        if len(waiting) != len(parents):
            continue
        stream = {1: "stdout", 2: "stderr"}.get(task.wait.fd, f"fd {task.wait.fd}")
        popen = [r for r in waiting if has_frame(r, "subprocess.py", "wait")]
        fix = (
            f"Read while it runs: `{'stdout, stderr' if stream == 'stdout' else '_, stderr'} = "
            f"child.communicate()` instead of wait(), or send the output to a file "
            f"({stream}=open(...)) or to subprocess.DEVNULL"
            if popen
            else "Read the pipe before waiting for the process to end (or in a thread)"
        )
        full = "pipe_write" in task.wchan
        hints.append(
            Hint(
                f"{who(proc)} is blocked writing to its {stream} ({task.wait.summary()}), a pipe "
                f"that is full{' (the kernel: wchan ' + task.wchan + ')' if full else ''}; the "
                "only reader of that pipe is "
                + "; ".join(f"{who(r)}, which {doing(r)}" for r in waiting)
                + f": it waits for the child to exit before it reads, and the child cannot exit "
                f"before its {stream} is read (a pipe holds 64 KiB). {fix}.",
                [blocked_line(proc), *(blocked_line(r) for r in waiting)],
                rule="full_pipe",
                pids=[proc.pid, *(r.pid for r in waiting)],
            )
        )
    return hints


_SENDS = re.compile(
    r"(\.(put|put_nowait|send|send_bytes|sendall|write|set|release|notify|notify_all)\(|"
    r"\bos\.write\()"
)


def _sends_later(proc: ProcessReport) -> tuple[int, str] | None:
    """The first line after the user's current line, in its function, that sends something
    (``queue.put(None)``, ``os.write(fd, ...)``, ``event.set()``)."""
    frame = user_frame(proc)
    if frame is None:
        return None
    return next(((n, t) for n, t in following_lines(frame) if _SENDS.search(t)), None)


def _join_path(by_pid: dict[int, ProcessReport], start: ProcessReport) -> list[ProcessReport]:
    """``start`` and the processes it joins, one after the other (each waits for one child)."""
    path = [start]
    while True:
        task = main_task(path[-1])
        if task is None or not joins(path[-1], task):
            return path
        nxt = [by_pid.get(e.pid) for e in task.waits_for if e.kind == CHILD]
        if len(nxt) != 1 or nxt[0] is None or nxt[0] in path:
            return path
        path.append(nxt[0])


def _only_waits(proc: ProcessReport) -> bool:
    """No thread of ``proc`` but its main one runs, sleeps (to wake up and act) or is stopped."""
    main = main_task(proc)
    return not proc.busy and all(
        wait_kind(proc, t) not in ("running", "sleeping", "stopped")
        for t in proc.tasks
        if t is not main and not ignored(proc, t)
    )


def hint_join_cycle(procs: list[ProcessReport]) -> list[Hint]:
    """A chain of joins whose last process waits for data (a pipe, a Queue, an Event) that only
    the joiners can send, one of them after its join: a cycle, named through all of them."""
    by_pid = {p.pid: p for p in procs}
    hints = []
    for start in procs:
        if not is_pytest(start) and start.ppid in by_pid:
            continue  # start from the top of a chain: the test, or a process without a parent here
        path = _join_path(by_pid, start)
        end = path[-1]
        task = main_task(end)
        if len(path) < 2 or task is None or joins(end, task) or end.busy:
            continue
        releasers = {
            e.pid for e in task.waits_for if e.kind in (HOLDS_WRITE_END, MAPS, SOCKET_PEER)
        } - {end.pid}
        if not releasers or not releasers <= {p.pid for p in path[:-1]}:
            continue
        if wait_kind(end, task) != "blocked" or not all(_only_waits(p) for p in path):
            continue
        later = [(p, sent) for p in path[:-1] if p.pid in releasers and (sent := _sends_later(p))]
        steps = " -> ".join(f"{who(p)}, which {doing(p)}" for p in path)
        text = (
            f"a cycle of waits through {len(path)} processes: {steps}, for what only "
            + ", ".join(who(by_pid[r]) for r in sorted(releasers))
            + (
                f" can write ({task.wait.summary()}: they hold its write end)"
                if isinstance(task.wait, Pipe)
                else f" can post ({task.wait.summary() if task.wait else task.obj}: a semaphore "
                "or event they share)"
            )
            + ", and each of them waits for the next one's exit. "
        )
        stdin = isinstance(task.wait, Pipe) and task.wait.fd == 0
        held = [
            (p, line)
            for p in path[:-1]
            if p.pid in releasers and (line := acquire_held(main_thread(p)))
        ]
        if isinstance(task.wait, Semaphore) and held and not has_frame(end, "multiprocessing/"):
            text += (
                " ".join(
                    f"{who(p)} holds it across its join: line {line.lineno}, `{code(line.line)}`."
                    for p, line in held
                )
                + " Release it before joining the process that waits for it."
            )
        elif has_frame(end, "multiprocessing/queues.py", "put"):
            text += (
                f"{who(end)} waits in Queue.put() for room in a full bounded queue: only a get() "
                "makes room, and the processes that could get() wait for exits. Get the items "
                "before joining the process that puts them (or use a larger or unbounded queue)."
            )
        elif stdin and has_frame(path[-2], "subprocess.py", "wait"):
            text += (
                f"{who(end)} reads its stdin, a pipe from {who(path[-2])}, which waits for it to "
                "exit without closing its end: the read never sees the end of the input. Close "
                "child.stdin after writing (or pass the input with communicate(input=...)) "
                "before waiting."
            )
        elif later:
            text += (
                " ".join(
                    f"{who(p)} sends it only after its join: line {n}, `{code(line)}`."
                    for p, (n, line) in later
                )
                + " Send it before joining (or join with a timeout and check the result)."
            )
        else:
            text += "Nothing in the chain will send it: send it before any join."
        hints.append(
            Hint(
                text,
                [blocked_line(p) for p in path],
                rule="join_cycle",
                pids=[p.pid for p in path],
            )
        )
    return hints

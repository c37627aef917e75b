"""Rules for what processes share: a Queue flushed at exit, a Manager, a Pool, an end marker
nobody puts, a chain of joins to what its processes send only after them."""

from __future__ import annotations

import re

from ...report.model import Frame, Hint, ProcessReport, TaskWait
from ...report.waits import (
    CHILD,
    HOLDS_WRITE_END,
    MAPS,
    SOCKET_PEER,
    Pipe,
    Semaphore,
)
from ..ends import pool_handlers, wait_facts
from ..frames import (
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
    acquire_held,
    blocked_line,
    code,
    doing,
    following_lines,
    ignored,
    joins,
    main_task,
    task_thread,
    user_frame,
    wait_kind,
    who,
)
from ..roles import MANAGER_SERVER, POOL_WORKER, is_pytest, role_of


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


def _waits_only_for(writer: ProcessReport, consumer: ProcessReport) -> bool:
    """The writer's main thread is blocked on what only ``consumer`` can send (a pipe whose
    other writers are the writer's own copies: a DataLoader waiting for this worker's batch)."""
    task = main_task(writer)
    if task is None or wait_kind(writer, task) != "blocked":
        return False
    others = {e.pid for e in task.waits_for} - {writer.pid}
    return others == {consumer.pid}


def _cannot_put(writer: ProcessReport, consumer: ProcessReport) -> bool:
    """A holder of the queue's write end that will not put while the consumer waits: it joins
    a child, waits in a get() of its own, or waits for this very consumer."""
    task = main_task(writer)
    return task is not None and (
        joins(writer, task)
        or _queue_get(writer, task) is not None
        or _waits_only_for(writer, consumer)
    )


def _for_consumer(writer: ProcessReport, consumer: ProcessReport) -> str:
    """``, for DataLoader worker 0/1 (pid 7) itself`` when the writer waits for the consumer."""
    return f", for {who(consumer)} itself" if _waits_only_for(writer, consumer) else ""


def hint_end_marker(procs: list[ProcessReport]) -> list[Hint]:
    """A consumer that stops on an end marker waits on an empty Queue whose every writer waits
    (for a child's exit, in get() itself, or for this consumer): the marker it needs will never
    be put."""
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
            not all(_cannot_put(w, proc) for w in idle)
            or any(_sends_later(w) for w in idle)
            or not all(map(_only_waits, [proc, *idle]))
        ):
            continue  # a writer that may still put (later in its code, or on another thread)
        number, text = marker
        gone = [p for p in procs if p.exit_status and p.ppid in {proc.ppid, *writers}]
        hints.append(
            Hint(
                f"{who(proc)} waits in Queue.get(){located(frame)} for the end-of-stream marker "
                f"that ends its loop (line {number}: `{code(text)}`), and the queue is empty (its "
                "reader is blocked reading the queue's pipe). No live process will put it: the "
                "queue's write end is held by "
                + "; ".join(f"{who(w)}, which {doing(w)}{_for_consumer(w, proc)}" for w in idle)
                + (
                    ". Exited before the deadline: "
                    + ", ".join(f"{who(p)}, which {p.exit_status}" for p in gone)
                    + " (a producer that put its items and ended, a consumer that took a marker)"
                    if gone
                    else ""
                )
                + ". Each end marker stops one consumer: put one marker per consumer (a "
                "producer that puts one for several leaves all but one waiting), or stop the "
                "consumers another way (a timeout, an Event).",
                [blocked_line(proc), *(blocked_line(w) for w in idle)],
                rule="end_marker",
                pids=[proc.pid, *(w.pid for w in idle)],
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

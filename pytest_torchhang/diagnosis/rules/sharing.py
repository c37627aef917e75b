"""Rules for what processes share: a Queue flushed at exit, a Manager, a Pool, a pipe, a FIFO."""

from __future__ import annotations

from ...report.model import Frame, Hint, ProcessReport, TaskWait
from ..frames import has_frame, in_file, innermost, located, main_thread, primitive
from ..graph import (
    blocked_line,
    chain,
    cycle_text,
    doing,
    edge_lines,
    edges_to,
    main_task,
    task_thread,
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
            text = (
                f"{who(parent)} waits in {name or 'a Pool call'}{located(frame)} while all "
                f"{len(workers)} Pool workers are idle, waiting for a task: nothing is computing "
                "the results it waits for (a task lost with a worker that died, or results "
                "awaited from a different Pool)."
            )
        hints.append(
            Hint(text, based, rule="pool_lost", pids=[parent.pid, *(w.pid for w in workers)])
        )
    return hints


def _reads(proc: ProcessReport) -> list[tuple[TaskWait, Frame | None]]:
    out = []
    main = main_task(proc)
    # in the pytest process, only the test's own thread: others may be left over from earlier tests
    for task in [main] if is_pytest(proc) and main else proc.tasks:
        if task.call in ("read", "readv", "recvfrom", "recvmsg") and (
            "pipe:" in task.obj or "socket:" in task.obj
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
    """(path, the end it opens, who holds it) of a thread blocked opening a FIFO, as the capture
    wrote it in the object (``FIFO /p, opening it for reading; no process of the tree has it
    open``); None for any other wait."""
    if task.call not in ("open", "openat") or not task.obj.startswith("FIFO "):
        return None
    head, _, held = task.obj.partition("; ")
    path, _, end = head[len("FIFO ") :].rpartition(", opening it for ")
    return (path, end, held) if path and end in ("reading", "writing") else None


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

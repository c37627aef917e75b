"""Rules for pipes and FIFOs: a read whose writers never write, a FIFO whose other end nobody
opens, a child blocked writing a full pipe that its reader reads only after the child exits."""

from __future__ import annotations

import linecache
import re

from ...report.groups import idle_service
from ...report.model import Frame, Hint, ProcessReport, TaskWait
from ...report.waits import (
    CHILD,
    HOLDS_READ_END,
    HOLDS_WRITE_END,
    Fifo,
    Pipe,
    Socket,
)
from ..frames import (
    has_frame,
    is_library,
    located,
    main_thread,
    primitive,
)
from ..graph import (
    READS,
    WRITES,
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
from ..roles import POOL_WORKER, is_helper, is_pytest, is_rank, role_of


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


def _coprocess(reader: ProcessReport, writers: list[ProcessReport | None]) -> str:
    """``. The child reads its stdin ... its answer waits in its own output buffer``: the
    writer is a child blocked reading its stdin, a pipe only the reader writes, so it took all
    the reader sent and wrote nothing back; empty for any other writer."""
    for writer in writers:
        task = main_task(writer) if writer is not None else None
        if writer is None or task is None or writer.ppid != reader.pid:
            continue
        if not isinstance(task.wait, Pipe) or task.wait.fd != 0 or task.call not in READS:
            continue
        if {e.pid for e in task.waits_for if e.kind == HOLDS_WRITE_END} != {reader.pid}:
            continue
        sent = _wrote_before(reader)
        return (
            f". {who(writer)} reads its stdin, a pipe only {who(reader)} writes, and has read "
            f"all of it (its read is blocked on the empty pipe){sent}, while {who(reader)} "
            f"reads {who(writer)}'s output: the child took every request and wrote no answer "
            "into the pipe. Either its program does not answer this input, or its answer "
            "waits in its own output buffer: a program whose stdout is a pipe block-buffers "
            "it (C stdio, Python) and writes it only when the buffer fills, it flushes or it "
            "exits. Make the child flush after each answer (python -u, print(..., "
            "flush=True), stdbuf -oL), or close its stdin after the last request and read to "
            "the end"
        )
    return ""


def _wrote_before(reader: ProcessReport) -> str:
    """`` after pytest (pid 7) wrote to it at line 16``: a write (and flush) in the reader's
    own frame, a few lines above the read it waits in."""
    thread = main_thread(reader)
    frame = next((f for f in thread.frames if not is_library(f)), None) if thread else None
    if frame is None:
        return ""
    lines = linecache.getlines(frame.filename)
    for number in range(frame.lineno - 1, max(frame.lineno - 6, 0), -1):
        if number <= len(lines) and re.search(r"\.(write|send|sendall)\(", lines[number - 1]):
            return f", after {who(reader)} wrote to it at line {number}"
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
                + _coprocess(proc, writers)
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

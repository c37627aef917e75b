"""The terminal text of a HangReport: the failure message, a log's, ``show``'s default view."""

from __future__ import annotations

from . import groups
from .groups import (
    MAX_BLOCK_PIDS,
    STARTUP_CUT,
    cut_startup,
    cut_stress,
    is_plugin_thread,
    pid_list,
    thread_key,
)
from .model import (
    EventLoop,
    Frame,
    HangReport,
    ProcessReport,
    TaskWait,
    ThreadStack,
    WaitEdge,
    same_thread,
)

#: Upper bound on the text of one report; the JSON keeps everything that was captured.
MAX_TEXT_CHARS = 200_000
#: Upper bound on one process's block in the text, and on the threads shown per process.
MAX_BLOCK_CHARS = 40_000
MAX_THREADS = 40
#: Lines of the table of process groups at the top of the text.
MAX_GROUP_LINES = 12


def to_text(report: HangReport) -> str:
    """The report as a user reads it in the terminal, a failure message or a log."""
    out = [report.headline]
    for hint in report.hints:
        out.append(f"hint: {hint.text}")
        out.extend(f"      based on: {b}" for b in hint.based_on)
    for note in report.notes:
        out.append(f"note: {note}")
    out.append("")
    found = groups.group_processes(report.processes, report.culprits)
    if len(found) > 1 or any(len(g.processes) > 1 for g in found):
        out.append("processes, the odd one out first:")
        for group in found[:MAX_GROUP_LINES]:
            peers = next((g for g in found if g.crowd and g.role == group.role), None)
            odd = ""
            if group.outlier and peers is not None:
                odd = f"  <- differs from {len(peers.processes)} identical"
            out.append(f"  {group.line()}{odd}")
        if len(found) > MAX_GROUP_LINES:
            out.append(f"  ... and {len(found) - MAX_GROUP_LINES} more (below)")
        out.append("")
    head = "\n".join(out)
    tail = _kill_summary(report)
    # Bounded, but the headline, the hints and the cleanup line always stay: each process
    # block is capped, and blocks that no longer fit are counted instead of shown.
    budget = MAX_TEXT_CHARS - len(head) - len(tail) - 300
    blocks, left_out = [], 0
    roles = {p.pid: p.role for p in report.processes}
    gone = [
        [f"--- process {t.pid}, gone before the capture", *_stderr_lines(t.lines), ""]
        for t in report.gone_stderr
    ]
    shown = [_process_text(g.processes[0], roles, g.processes[1:]) for g in found]
    for lines in [*shown, *gone]:
        block = _cap("\n".join(lines), MAX_BLOCK_CHARS)
        if len(block) + 1 <= budget:
            blocks.append(block)
            budget -= len(block) + 1
        else:
            left_out += 1
    if left_out:
        blocks.append(
            f"... {left_out} process block(s) left out to keep the report under "
            f"{MAX_TEXT_CHARS} characters (the JSON report has every one)\n"
        )
    return "\n".join([head, *blocks, tail])


def _kill_summary(report: HangReport) -> str:
    parts = [f"killed {len(report.killed)} process(es)"]
    if report.killed:
        parts[0] += " (" + ", ".join(map(str, report.killed)) + ")"
    if report.spared:
        parts.append(
            f"left helpers {report.spared} running (the session's multiprocessing helpers, or a "
            "torch_shm_manager serving tensors the test still holds; they exit on their own)"
        )
    if report.survivors:
        parts.append(f"COULD NOT KILL {report.survivors}")
    # /dev/shm names are bare; what went from $TMPDIR (a Manager's listener) is a path
    segments = [name for name in report.shm_removed if "/" not in name]
    if segments:
        parts.append(f"removed {len(segments)} /dev/shm segment(s)")
    if len(segments) < len(report.shm_removed):
        parts.append(
            f"removed {len(report.shm_removed) - len(segments)} multiprocessing listener "
            "socket(s) and dir(s) from the temp dir"
        )
    return (
        "cleanup: "
        + "; ".join(parts)
        + f"; capture took {report.capture_s:.2f}s, kill {report.kill_s:.2f}s"
    )


def _cap(block: str, limit: int) -> str:
    if len(block) <= limit:
        return block
    cut = block.rfind("\n", 0, limit)
    hidden = block.count("\n", cut)
    return block[:cut] + f"\n        ... {hidden} more line(s) of this process left out\n"


def edge_text(edge: WaitEdge, roles: dict[int, str]) -> str:
    """``pid 123 [DataLoader worker 0/2] (pipe:[5]: holds its write end)``."""
    if edge.pid == 0:
        return f"nobody ({edge.via})"
    if edge.pid < 0:
        return f"outside the tree ({edge.via})"
    role = roles.get(edge.pid)
    who = f"pid {edge.pid}" + (f" [{role}]" if role else "")
    if edge.tid and edge.tid != edge.pid:
        who += f" thread {edge.tid}"
    return f"{who} ({edge.via})"


#: Edges shown per thread in the text (the JSON keeps all).
MAX_EDGES = 6


def _task_lines(task: TaskWait, roles: dict[int, str], indent: str, own_pid: int) -> list[str]:
    out = [f"{indent}blocked in {task.summary()}" if task.call != "running" else f"{indent}running"]
    edges = task.waits_for
    for edge in edges[:MAX_EDGES]:
        if edge.pid == own_pid and not edge.tid and not edge.via.startswith(("pipe:", "/")):
            out.append(f"{indent}  waits for {edge.via}")
        else:
            out.append(f"{indent}  waits for {edge_text(edge, roles)}")
    if len(edges) > MAX_EDGES:
        out.append(f"{indent}  ... and {len(edges) - MAX_EDGES} more")
    return out


#: Processes named, with their roles, on the line of a folded group; the rest by pid only.
MAX_NAMED = 8


def _same_as(others: list[ProcessReport]) -> list[str]:
    """The line under a group's one block: which other processes have the same stacks."""
    if not others:
        return []
    named = ", ".join(f"pid {p.pid} [{p.role}]" for p in others[:MAX_NAMED])
    rest = others[MAX_NAMED:]
    if rest:
        pids = pid_list([p.pid for p in rest], MAX_BLOCK_PIDS)
        named += f", and {len(rest)} more (pids {pids})"
    return [f"    the same stacks, shown once: {named}"]


def _frame_lines(frames: list[Frame]) -> list[str]:
    out = []
    for frame in cut_startup(cut_stress(frames)):
        if frame.filename in ("<pytest>", "<pytest-torchhang>", STARTUP_CUT):
            out.append(f"        {frame.name}")
            continue
        out.append(f'        File "{frame.filename}", line {frame.lineno}, in {frame.name}')
        if frame.line:
            out.append(f"            {frame.line}")
    return out


def _process_text(
    proc: ProcessReport,
    roles: dict[int, str] | None = None,
    same: list[ProcessReport] | None = None,
) -> list[str]:
    """One process's block; ``same``: the processes with identical stacks it stands for."""
    roles = roles or {}
    if proc.exit_status:
        return [
            f"--- process {proc.pid} [{proc.role}] parent {proc.ppid}, {proc.state}: "
            f"{proc.exit_status}, not reaped yet",
            *_same_as(same or []),
            *_stderr_lines(proc.stderr_tail),
            "",
        ]
    tasks = {t.python_thread: t for t in proc.tasks if t.python_thread}
    mib = proc.rss_bytes / (1 << 20)
    busy = f", +{proc.cpu_delta_s:.2f}s CPU during capture (busy)" if proc.busy else ""
    out = [
        f"--- process {proc.pid} [{proc.role}] parent {proc.ppid}, {proc.state}, "
        f"cpu {proc.cpu_s:.2f}s{busy}, rss {mib:.0f} MiB, {proc.num_threads} threads, "
        f"age {proc.age_s:.1f}s",
        *_same_as(same or []),
        f"    cmdline: {proc.cmdline[:300]}",
    ]
    if proc.motion is not None:  # two looks apart: blocked, spinning, polling or moving
        out.append(f"    motion: {proc.motion.summary()}")
    if proc.dump_status != "ok":
        out.append(f"    ({proc.dump_status})")
    ours = [t for t in proc.threads if is_plugin_thread(t)]
    # Threads with the same stack (a queue feeder per DataLoader worker) are shown once.
    alike: dict[object, list[ThreadStack]] = {}
    for thread in proc.threads:
        if thread not in ours:
            alike.setdefault(thread_key(thread), []).append(thread)
    for twins in list(alike.values())[:MAX_THREADS]:
        thread = twins[0]
        role = proc.thread_roles.get(thread.ident, "")
        words = ["main thread" if thread.current else "thread", thread.ident]
        words += [f'"{thread.name}"'] if thread.name else []
        words += [f"[{role}]"] if role else []
        more = f", and {len(twins) - 1} more with the same stack" if len(twins) > 1 else ""
        out.append(f"    {' '.join(words)} (most recent call first{more}):")
        if thread.ident in tasks:
            out.extend(_task_lines(tasks[thread.ident], roles, "      ", proc.pid))
        if not thread.frames:
            out.append("        <no Python frame>")
        out.extend(_frame_lines(thread.frames))
        if thread.truncated:
            out.append("        ...")
        for loop in proc.event_loops:  # the tasks it runs, below the loop's select
            if same_thread(loop.thread, thread.ident):
                out.extend(_loop_lines(loop, proc))
    if len(alike) > MAX_THREADS:
        out.append(f"    ... {len(alike) - MAX_THREADS} more thread(s) not shown")
    shown = [twins[0] for twins in list(alike.values())[:MAX_THREADS]]
    for loop in proc.event_loops:
        if not any(same_thread(loop.thread, t.ident) for t in shown):
            out.extend(_loop_lines(loop, proc))
    if ours:
        names = ", ".join(proc.thread_roles.get(t.ident) or t.name or t.ident for t in ours)
        out.append(f"    {len(ours)} thread(s) of pytest-torchhang itself, not shown: {names}")
    native = [
        t for t in proc.tasks if not t.python_thread and any(e.pid != proc.pid for e in t.waits_for)
    ]
    if native and proc.threads:
        out.append(
            f"    threads without a Python stack that wait on other processes ({len(native)}):"
        )
        for task in native[:MAX_THREADS]:
            out.append(f'      thread {task.tid} "{task.name}":')
            out.extend(_task_lines(task, roles, "        ", proc.pid))
    elif not proc.threads and proc.tasks:
        for task in proc.tasks[:MAX_THREADS]:
            out.append(f'    thread {task.tid} "{task.name}" ({task.state}):')
            out.extend(_task_lines(task, roles, "      ", proc.pid))
    if proc.collectives:
        out.append("    collectives (flight recorder, oldest first):")
        out.extend(
            f"        {c.label()}"
            + (f" on process group {c.group!r}" if c.group else "")
            + (" completed" if c.completed else " NOT COMPLETED")
            for c in proc.collectives
        )
    if proc.native:
        out.append("    stacks read with pystack/py-spy (most recent call last):")
        out.extend(f"        {line}" for line in proc.native.splitlines())
    out.extend(_stderr_lines(proc.stderr_tail))
    out.append("")
    return out


#: Tasks shown per loop in the text (the JSON keeps all that were read).
MAX_TASKS_SHOWN = 20


def _loop_lines(loop: EventLoop, proc: ProcessReport) -> list[str]:
    """A loop's pending tasks, each with its coroutine stack, as ``python -m asyncio pstree``."""
    main = next((t.ident for t in proc.threads if t.current), "")
    in_main = same_thread(loop.thread, main)
    where = "main thread" if in_main else "thread"
    where += f" {loop.thread}" if loop.thread else ""
    where += f' "{loop.thread_name}"' if loop.thread_name and not in_main else ""
    left = max(len(loop.tasks) - MAX_TASKS_SHOWN, 0) + loop.tasks_left_out
    out = [
        f"    asyncio loop in {where} ({loop.loop}), {len(loop.tasks) + loop.tasks_left_out} "
        f"pending task(s); what could still wake it: {loop.wakers()}"
    ]
    for task in loop.tasks[:MAX_TASKS_SHOWN]:
        awaits = f"awaits {task.awaited()}" if task.state != "running" else "is running"
        if task.awaits == "gather" and task.awaits_tasks:
            awaits += " of " + ", ".join(repr(name) for name in task.awaits_tasks)
        awaits += f" [{task.detail}]" if task.detail else ""
        awaits += ", with a timeout" if task.timed else ""
        if task.state == "running":
            awaits += " (the stack of its loop's thread shows where)"
        out.append(f"      {task.label()} {awaits} (most recent call first):")
        for frame in task.frames:
            out.append(f'        File "{frame.filename}", line {frame.lineno}, in {frame.name}')
            if frame.line:
                out.append(f"            {frame.line}")
    if left > 0:
        out.append(f"      ... {left} more task(s) not shown")
    return out


def _stderr_lines(tail: list[str]) -> list[str]:
    if not tail:
        return []
    return ["    last stderr lines:", *(f"        {line}" for line in tail)]

"""Rules read from the wait-for graph: stopped, dead, deadlock, nobody left to release, sleeper,
outside peer, a poll loop whose producer failed, a server that never answers, busy."""

from __future__ import annotations

import linecache
import re

from ...report.groups import idle_service
from ...report.model import Frame, Hint, ProcessReport, TaskWait
from ...report.waits import HOLDS_WRITE_END, LISTENING, NOBODY, OUTSIDE, SOCKET_PEER, Futex, Socket
from ..ends import loop_thread, pool_thread, render, wait_facts
from ..frames import (
    collective_of,
    fork_parent,
    frame_collective,
    is_library,
    located,
    main_thread,
    primitive,
)
from ..graph import (
    READS,
    SLEEP_CALLS,
    blocked_line,
    code,
    components,
    doing,
    edge_lines,
    edges_to,
    find_knot,
    ignored,
    main_task,
    task_thread,
    wait_kind,
    waiters_text,
    who,
)
from ..roles import is_helper, is_pytest, is_rank, is_worker


def hint_stopped(procs: list[ProcessReport]) -> list[Hint]:
    """A stopped process (SIGSTOP, a tracer), and who waits for it."""
    hints = []
    for proc in procs:
        if not proc.state.startswith("stopped"):
            continue
        main = main_thread(proc)
        _name, frame = primitive(main)
        where = f" in {proc.stuck_at}{located(frame)}" if proc.stuck_at else ""
        waiters = edges_to(procs, proc.pid)
        text = (
            f"{who(proc)} is stopped (SIGSTOP or SIGTSTP, or a debugger holds it){where}: it "
            "does nothing until it gets SIGCONT, and whatever waits for it waits until then. "
            "Look for what stopped it (a kill -STOP, a job-control signal, a tracer)."
        )
        if waiters:
            text += f" Waiting for it: {waiters_text(waiters)}."
        hints.append(
            Hint(
                text,
                [
                    f"pid {proc.pid} was in state T (stopped) in /proc/{proc.pid}/stat, "
                    "read before the capture continued it",
                    *edge_lines(waiters, proc),
                ],
                rule="stopped",
                pids=[proc.pid] + [p.pid for p, _ in waiters],
            )
        )
    return hints


def hint_dead(procs: list[ProcessReport]) -> list[Hint]:
    """A child that exited before the deadline, and who waits for it."""
    hints = []
    by_pid = {p.pid: p for p in procs}
    for proc in procs:
        if not proc.exit_status:
            continue
        parent = by_pid.get(proc.ppid)
        waiters = edges_to(procs, proc.pid)
        ranks = [p for p in procs if collective_of(p)]  # in a rendezvous or a collective
        text = (
            f"{proc.role or 'a child'} (pid {proc.pid}"
            + (f", child of {who(parent)}" if parent else "")
            + f") {proc.exit_status} before the deadline and was not reaped yet."
        )
        if waiters:
            text += f" Waiting for it: {waiters_text(waiters)}."
        if ranks and not is_rank(proc):
            text += (
                " Ranks wait for peers meanwhile ("
                + ", ".join(f"{who(r)} in {collective_of(r)}" for r in ranks)
                + "): if it was a rank, it died before or during the collective they wait in; "
                "its output (stderr) says why."
            )
        elif not waiters:
            text += " Its parent may still be waiting for what it was doing."
        hints.append(
            Hint(
                text,
                [f"pid {proc.pid} is a zombie: {proc.exit_status} (/proc/{proc.pid}/stat)"]
                + edge_lines(waiters, proc)
                + [f"{r.role} in {collective_of(r)}" for r in ranks],
                rule="dead",
                # not the ranks: the rank rules say what they know about the missing one
                pids=[proc.pid, *(p.pid for p, _ in waiters)],
            )
        )
    return hints


def _why_alone(
    proc: ProcessReport,
    task: TaskWait | None,
    name: str,
    parent: ProcessReport | None,
    worker: bool,
) -> str:
    edges = task.waits_for if task else []
    private = task is not None and isinstance(task.wait, Futex) and task.wait.private
    forked = parent is not None or worker
    if private and any(e.kind == NOBODY for e in edges):
        reason = "it is the only thread of its process"
        if forked and name != "Future.result()":
            # what it waits for may be its own (made after the fork): say the condition
            reason += (
                "; if what it waits for was made before the fork, the thread that was to end "
                "the wait stayed in the parent (threads are not copied by fork)"
            )
    elif any(e.kind == HOLDS_WRITE_END and e.pid == proc.pid for e in edges):
        reason = "the only write end of the pipe it reads is its own"
    else:
        reason = "every other thread of its process waits too"
    if name == "Future.result()" and _forked_from_a_pool(proc, parent):
        # only with evidence of a fork: a child forked from a process whose pool threads
        # could complete the Future (issue 28: no fork, no fork story)
        reason += (
            "; a Future is completed by a pool thread, and it was forked from "
            f"{who(parent) if parent else 'its parent'}, whose pool threads were not copied "
            "by fork, so no thread is left to run the task"
        )
    elif name.startswith(("Event.", "Condition.", "Barrier.")):
        reason += f"; no live thread of it is left to set the {name.split('.')[0]}"
    elif "acquire" in name:
        reason += "; no other thread of it is left to release the lock"
    return reason


def _forked_from_a_pool(proc: ProcessReport, parent: ProcessReport | None) -> bool:
    """``proc`` is a fork child (same program, no exec) of a process that has pool threads of
    its own: the evidence the fork clause of a lost Future needs."""
    return (
        parent is not None
        and any(pool_thread(t) for t in parent.threads)
        and not any(pool_thread(t) for t in proc.threads)
    )


def waits_in_words(
    proc: ProcessReport, task: TaskWait | None, name: str, frame: Frame | None
) -> str:
    """``Event.wait() at test_x.py:17``; for a process without a Python stack, what the kernel
    shows (``the system call read(fd 16: pipe:[5]) [anon_pipe_read]``) and why there is no
    stack: never an empty blank."""
    if name or proc.stuck_at:
        return f"{name or proc.stuck_at}{located(frame)}"
    call = f"the system call {task.summary()}" if task and task.call else "an unknown place"
    why = proc.dump_status.removeprefix("no stack: ") if proc.dump_status != "ok" else ""
    return f"{call} (no Python stack{': ' + why if why else ''}; command line: {proc.cmdline})"


def hint_deadlock(procs: list[ProcessReport], explained: set[int]) -> list[Hint]:
    """Processes that wait only for each other (a deadlock), or for a wait that no thread or
    process of the test is left to end (a signal may still: ``enders`` says)."""
    by_pid = {p.pid: p for p in procs}
    knot = find_knot(procs)
    hints = []
    for group in components(knot):
        # services idle by design (an executor's workers waiting for a task) wait in the knot
        # only because their client does: never one of the story's processes
        listed = [by_pid[p] for p in group if not (is_helper(by_pid[p]) or idle_service(by_pid[p]))]
        pids = {p.pid for p in listed}
        if not listed or explained & {p for p in pids if not is_pytest(by_pid[p])}:
            continue
        if pids <= explained:
            continue
        alone = [p for p in listed if knot[p.pid] <= {p.pid}]
        based = [blocked_line(proc) for proc in listed]
        waits = []
        if alone:
            parts = []
            for proc in alone:
                task = main_task(proc)
                name, frame = primitive(task_thread(proc, task) if task else main_thread(proc))
                parent = fork_parent(proc, by_pid)
                facts = wait_facts(proc, task, procs)
                if facts is not None:
                    waits.append(facts)
                stated = f". {render(facts, head=False)}" if facts is not None else ""
                parts.append(
                    f"{who(proc)} waits in {waits_in_words(proc, task, name, frame)}, and no thread "
                    f"or process of the test is left to end that wait: "
                    f"{_why_alone(proc, task, name, parent, is_worker(proc))}{stated}"
                )
            others = [p for p in listed if p not in alone]
            text = " ".join(part if part.endswith(".") else part + "." for part in parts)
            if others:
                text += (
                    " Waiting for it: " + "; ".join(f"{who(p)} {doing(p)}" for p in others) + "."
                )
            rule = "nobody"
        else:
            cycle = "; ".join(
                f"{who(p)} {doing(p)}, for "
                + ", ".join(f"pid {q}" for q in sorted(knot[p.pid] - {p.pid}) if q in by_pid)
                for p in listed
            )
            text = (
                f"deadlock: {len(listed)} processes wait only for each other, and none of them can "
                f"move: {cycle}. Something one of them waits for (a batch, an Event, a lock, a "
                "message) is only produced after a wait of its own."
            )
            rule = "deadlock"
        hints.append(Hint(text, based, rule=rule, pids=[p.pid for p in listed], waits=waits))
    return hints


def hint_sleeper(procs: list[ProcessReport]) -> list[Hint]:
    """A wait whose other end belongs to processes that sleep (a long sleep, or a polling loop)."""
    by_pid = {p.pid: p for p in procs}
    hints = []
    for proc in procs:
        task = main_task(proc)
        if task is None or wait_kind(proc, task) != "blocked" or is_helper(proc):
            continue
        targets = {e.pid for e in task.waits_for if e.pid > 0 and e.pid != proc.pid}
        ends = [by_pid.get(t) for t in targets]
        if not ends or any(e is None or e.busy or e.exit_status for e in ends):
            continue
        kinds = {e.pid: wait_kind(e, t) for e in ends if e and (t := main_task(e))}
        sleepers = [e for e in ends if e and kinds.get(e.pid) == "sleeping"]
        if not sleepers or any(kinds.get(e.pid) not in ("sleeping", "blocked") for e in ends if e):
            continue
        if any(frame_collective(e) for e in sleepers):
            continue  # a rank polling its store: the rank rules tell why
        if any(_supervises(s, procs) or _short_sleep(s) for s in sleepers):
            continue  # a link of a chain, or a loop that wakes up soon: no cause to name
        name, frame = primitive(task_thread(proc, task))
        via = next(e.via for e in task.waits_for if e.pid == sleepers[0].pid)
        hints.append(
            Hint(
                f"{who(proc)} waits in {waits_in_words(proc, task, name, frame)} for "
                + ", ".join(f"{who(s)}, which {doing(s)}" for s in sleepers)
                + f" (through {via}): the wait ends only when the sleeper wakes up and acts. A long "
                "sleep, or a loop that polls for something that never comes.",
                [f"{who(proc)} blocked in {task.summary()}"]
                + [f"{who(s)} blocked in {t.summary()}" for s in sleepers if (t := main_task(s))],
                rule="sleeper",
                pids=[proc.pid, *(s.pid for s in sleepers)],
            )
        )
    return hints


def _supervises(proc: ProcessReport, procs: list[ProcessReport]) -> bool:
    """A poller of its own children (torchrun's agent, a loop over ``Popen.poll()`` or
    ``Process.is_alive()``): whatever its children do, stuck or computing, is the story, and
    other rules tell it. Not when a child waits for it: then its sleep is what holds them."""
    children = [p for p in procs if p.ppid == proc.pid and not p.exit_status and not is_helper(p)]
    return bool(children) and not any(edges_to([c], proc.pid) for c in children)


_SLEEP_CALL = re.compile(r"\bsleep\(\s*(\d+(?:\.\d*)?|\.\d+)\s*\)")

#: A sleep shorter than this, written as a number in the source, wakes up before anyone could
#: call the wait a hang: the process is pacing itself (a rate limiter, a polling loop).
_SHORT_SLEEP_S = 2.0


def _short_sleep(proc: ProcessReport) -> bool:
    """The process sleeps in ``time.sleep(<a number under _SHORT_SLEEP_S>)``, by its source line."""
    task = main_task(proc)
    thread = task_thread(proc, task) if task else main_thread(proc)
    for frame in (thread.frames if thread else [])[:3]:
        match = _SLEEP_CALL.search(frame.line)
        if match:
            return float(match.group(1)) < _SHORT_SLEEP_S
    return False


def hint_outside(procs: list[ProcessReport]) -> list[Hint]:
    """A read on a socket whose peer is no process of this test: a server, a service."""
    hits, based, pids = [], [], []
    local: list[ProcessReport] = []
    for proc in procs:
        task = main_task(proc)
        if task is None or task.call not in READS or (is_rank(proc) or is_helper(proc)):
            continue
        outside = [e for e in task.waits_for if e.kind in (OUTSIDE, LISTENING)]
        if (
            not isinstance(task.wait, Socket)
            or not outside
            or any(e.pid > 0 for e in task.waits_for)
        ):
            continue
        if loop_thread(proc, task_thread(proc, task)):
            continue  # it blocks its own event loop, which may be the server: the ends say
        if _listens_in_tree(task.wait.remote, procs):
            local.append(proc)
            continue
        name, frame = primitive(task_thread(proc, task))
        peer = f" from {task.wait.remote}" if task.wait.remote else ""
        untimed = "" if task.timed else ", with no timeout"
        hits.append(f"{who(proc)} in {name or task.call}{located(frame)}{peer}{untimed}")
        based.append(f"{who(proc)} blocked in {task.summary()}: {outside[0].via}")
        pids.append(proc.pid)
    found = [_on_this_machine(proc, procs) for proc in local]
    if not hits:
        return found
    return [
        *found,
        Hint(
            f"{len(hits)} process(es) wait for data on a socket whose other end is no process of "
            f"this test (a server, a service, or a process started before the test): "
            f"{'; '.join(hits)}. Check that the peer is up and answers, and give the call a timeout.",
            based,
            rule="outside",
            pids=pids,
        ),
    ]


def _listens_in_tree(address: str, procs: list[ProcessReport]) -> bool:
    """A thread of the tree (the waiting process's own threads included) listens on the port
    the socket is connected to, on this machine: its server is the test's own."""
    host, _, port = address.rpartition(":")
    if not port or not host.strip("[]").startswith(("127.", "::1", "0.0.0.0", "::")):
        return False
    return any(
        isinstance(t.wait, Socket) and t.wait.listening and t.wait.local.rpartition(":")[2] == port
        for p in procs
        for t in p.tasks
    )


def _on_this_machine(proc: ProcessReport, procs: list[ProcessReport]) -> Hint:
    """A read from a peer whose server listens in the tree itself (a thread of the test's own)
    but holds no accepted end of the connection: both ends said, no cause guessed."""
    task = main_task(proc)
    facts = wait_facts(proc, task, procs)
    remote = task.wait.remote if task is not None and isinstance(task.wait, Socket) else ""
    return Hint(
        f"{who(proc)} {render(facts) if facts else 'waits on a socket.'} Its peer {remote} is a "
        "server of the test's own (a socket of the tree listens on that port), and no thread "
        "has accepted the connection yet.",
        [f"{who(proc)} blocked in {task.summary() if task else '?'}"],
        rule="outside",
        pids=[proc.pid],
        waits=[facts] if facts else [],
    )


def hint_busy(procs: list[ProcessReport], explained: set[int] | None = None) -> list[Hint]:
    """Processes that used CPU during the capture, and who waits for them."""
    polling = {p.pid for p in procs if _producer_gone(p, procs)}  # hint_poll_dead tells them
    busy = [p for p in procs if p.busy and p.pid not in (explained or set()) | polling]
    if not busy:
        return []
    waiting = [(b, edges_to(procs, b.pid)) for b in busy]
    text = (
        f"{len(busy)} process(es) used CPU during the capture: they are computing or spinning, not "
        "waiting (an endless loop, a retry loop, or work too slow for the timeout)."
    )
    for proc, waiters in waiting:
        if waiters:
            text += f" Waiting for {who(proc)}: {waiters_text(waiters)}."
    return [
        Hint(
            text,
            [f"{p.role} (pid {p.pid}) +{p.cpu_delta_s:.2f}s CPU at {p.stuck_at}" for p in busy]
            + [line for proc, waiters in waiting for line in edge_lines(waiters, proc)],
            rule="busy",
            pids=[p.pid for p in busy],
        )
    ]


#: What a polling loop's condition reads, by the call in it, in the user's words.
_POLLED = (
    (
        re.compile(r"\bos\.path\.(exists|isfile|isdir)\(|\.(exists|is_file|is_dir)\(\)"),
        "a file's existence",
    ),
    (re.compile(r"\.value\b"), "a shared Value"),
    (re.compile(r"\.(empty|qsize)\(\)"), "a queue (queue.empty())"),
    (re.compile(r"\.is_set\(\)"), "an Event (event.is_set())"),
    (re.compile(r"\.poll\(\)"), "a child or a connection (poll())"),
)


def _polls(proc: ProcessReport) -> tuple[str, Frame] | None:
    """(what it polls, the loop's ``while`` line) of a process in a polling loop: spinning on
    the ``while`` line, or sleeping in the loop's body between two looks."""
    thread = main_thread(proc)
    frames = thread.frames if thread else []
    frame = next((f for f in frames if not is_library(f) and not f.filename.startswith("<")), None)
    if frame is None:
        return None
    if not frame.line.startswith("while "):
        task = main_task(proc)
        # the two looks saw it sleep and wake: a sleep, whatever the first read caught
        polled = proc.motion is not None and proc.motion.kind == "polling"
        if not (
            task is not None and (task.call in SLEEP_CALLS or polled) and "sleep(" in frame.line
        ):
            return None
        head = _loop_head(frame)
        if head is None:
            return None
        frame = head
    return next(((what, frame) for pattern, what in _POLLED if pattern.search(frame.line)), None)


def _loop_head(frame: Frame) -> Frame | None:
    """The ``while`` line of the loop whose body holds ``frame``'s line, up to 3 lines above."""
    lines = linecache.getlines(frame.filename)[: frame.lineno]
    if not lines:
        return None
    indent = len(lines[-1]) - len(lines[-1].lstrip())
    for number in range(len(lines) - 1, max(len(lines) - 4, 0), -1):
        text = lines[number - 1]
        depth = len(text) - len(text.lstrip())
        if text.strip() and depth < indent:
            if text.strip().startswith("while "):
                return Frame(frame.filename, number, frame.name, text.strip())
            return None
    return None


def _producer_gone(
    proc: ProcessReport, procs: list[ProcessReport]
) -> tuple[str, Frame, list[ProcessReport]] | None:
    """(what it polls, the loop's frame, the exited children) of a busy process spinning in a
    polling loop while a child of it (or a sibling) has exited: nothing else says it will not
    come (a loop without such a child may just be slow)."""
    task = main_task(proc)
    sleeps = task is not None and task.call in SLEEP_CALLS
    sleeps = sleeps or (proc.motion is not None and proc.motion.kind == "polling")
    found = _polls(proc) if _spins(proc) or sleeps else None
    if found is None:
        return None
    dead = [p for p in procs if _failed(p) and p.ppid in (proc.pid, proc.ppid) and p is not proc]
    # a live process of the test that runs could still make it: then the loop may just wait
    working = [
        p
        for p in procs
        if p is not proc and not p.exit_status and not is_helper(p) and (p.busy or _runs(p))
    ]
    return (*found, dead) if dead and not working else None


def _spins(proc: ProcessReport) -> bool:
    """The process used CPU during the capture, or its main thread was running when read (on
    a loaded machine a spinner may get too little CPU in the sample to be called busy)."""
    task = main_task(proc)
    return proc.busy or (task is not None and (task.call == "running" or task.state == "R"))


def _failed(proc: ProcessReport) -> bool:
    """The process is gone with an error: a non-zero exit code, or killed by a signal."""
    return bool(proc.exit_status) and proc.exit_status != "exited with code 0"


def _runs(proc: ProcessReport) -> bool:
    return any(t.call == "running" or t.state == "R" for t in proc.tasks if not ignored(proc, t))


def hint_poll_dead(procs: list[ProcessReport]) -> list[Hint]:
    """A process spins polling for something (a file, a Value, a queue) that the child meant to
    make it exited without making."""
    hints = []
    for proc in procs:
        found = _producer_gone(proc, procs)
        if found is None:
            continue
        what, frame, dead = found
        errors = [
            f"{who(p)}'s stderr ends: {p.stderr_tail[-1].strip()}"
            for p in dead
            if p.stderr_tail and p.stderr_tail[-1].strip()
        ]
        hints.append(
            Hint(
                f"{who(proc)} "
                + (
                    f"spins (+{proc.cpu_delta_s:.2f}s CPU during the capture)"
                    if proc.busy
                    else "sleeps between looks"
                    if proc.motion is not None and proc.motion.kind == "polling"
                    else "spins (it was running when the capture read it)"
                    if _spins(proc)
                    else "sleeps between looks"
                )
                + f" in a loop that polls {what}{located(frame)}: `{code(frame.line)}`, and the child that was to "
                "make it is gone: "
                + "; ".join(f"{who(p)} {p.exit_status}" for p in dead)
                + ("; " + "; ".join(errors) if errors else "")
                + ". No other process of the test runs: what it polls for will never come. Check the producer's exit (join it and read exitcode, "
                "or wait on something it sets) and give the loop a deadline instead of polling "
                "forever.",
                [
                    f"{who(proc)} +{proc.cpu_delta_s:.2f}s CPU, {proc.state}, at "
                    f"{frame.filename}:{frame.lineno}"
                ]
                + [f"pid {p.pid} is a zombie: {p.exit_status}" for p in dead],
                rule="poll_dead",
                pids=[proc.pid],  # the exited children keep their own fact (hint_dead)
            )
        )
    return hints


def _serving_thread(server: ProcessReport, address: str) -> str:
    """The thread of ``server`` that waits for connections on ``address``, in words."""
    for task in server.tasks:
        if isinstance(task.wait, Socket) and task.wait.listening and task.wait.local == address:
            thread = task_thread(server, task)
            name, frame = primitive(thread)
            label = f"thread {thread.name!r}" if thread and thread.name else f"thread {task.tid}"
            return (
                f"{label} of {who(server)}, which waits in {name or task.call}{located(frame)} "
                "for the next client"
            )
    return who(server)


def hint_no_answer(procs: list[ProcessReport]) -> list[Hint]:
    """A blocking read (no timeout) on a TCP connection to a server of the tree that accepted
    the request and does not answer."""
    by_pid = {p.pid: p for p in procs}
    hints = []
    for proc in procs:
        task = main_task(proc)
        if task is None or task.call not in READS or task.timed or is_rank(proc) or is_helper(proc):
            continue
        sock = task.wait
        if not isinstance(sock, Socket) or sock.family != "tcp" or not sock.remote:
            continue
        peers = {e.pid for e in task.waits_for if e.kind == SOCKET_PEER}
        if len(peers) != 1 or next(iter(peers)) not in by_pid:
            continue  # a server of the tree holds the other end (a thread of this one, maybe)
        server = by_pid[next(iter(peers))]
        others = [t for t in server.tasks if t is not task and not ignored(server, t)]
        if server.exit_status or any(t.call == "running" or t.state == "R" for t in others):
            continue  # it may be computing the answer
        if server is not proc and server.busy:
            continue
        name, frame = primitive(task_thread(proc, task))
        hints.append(
            Hint(
                f"{who(proc)} waits for an answer in {name or task.call}{located(frame)} on a "
                f"connection to {sock.remote}, with no timeout (the socket blocks in "
                f"{task.call} itself): the server at {sock.remote}, served by "
                f"{_serving_thread(server, sock.remote)}, accepted the connection and never "
                "answered, and nothing in it is working on an answer. Pass a timeout "
                "(socket.create_connection(..., timeout=...), sock.settimeout(), "
                "requests' timeout=), and find why the server does not reply.",
                [
                    f"{who(proc)} blocked in {task.summary()}: {sock.local} -> {sock.remote}",
                    blocked_line(server),
                ],
                rule="no_answer",
                pids=[proc.pid, server.pid],
            )
        )
    return hints

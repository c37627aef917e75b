"""A thread blocked on its own process's lock, Event or Condition while every other thread of
the process is an idle service (an HTTP server's ``serve_forever``, an executor's worker waiting
for a task, an ``accept`` on a listening socket): the services wait for work by design, and
none of them is the one that would end the wait."""

from __future__ import annotations

from ...report.groups import idle_service, idle_service_thread
from ...report.model import Hint, ProcessReport, TaskWait
from ...report.waits import LISTENING, THREAD, Futex, Socket
from ..ends import render, wait_facts
from ..frames import primitive
from ..graph import ignored, main_task, task_thread, wait_kind, who
from ..roles import is_helper
from .waits import waits_in_words

#: The frames every ``threading`` thread has at its bottom: not where it serves.
_START = ("_bootstrap", "_bootstrap_inner", "run")


def _service_words(proc: ProcessReport, task: TaskWait) -> str:
    """``thread 'http-server' in serve_forever, for a client of 127.0.0.1:8000``."""
    thread = task_thread(proc, task)
    label = f"thread {thread.name!r}" if thread and thread.name else f"thread {task.tid}"
    frames = [f.name for f in thread.frames if f.name not in _START] if thread else []
    where = f" in {frames[-1]}" if frames else f" in {task.call}"
    sock = task.wait if isinstance(task.wait, Socket) and task.wait.listening else None
    return label + where + (f", for a client of {sock.local}" if sock and sock.local else "")


def _listens(task: TaskWait) -> bool:
    return any(e.kind == LISTENING for e in task.waits_for)


def _idle(proc: ProcessReport, task: TaskWait, procs: list[ProcessReport]) -> bool:
    """A thread of ``proc`` that only waits for work: in a service loop's wait, and, where it
    waits on other processes of the tree (an executor's manager thread on its workers' results),
    only while each of those is idle too. A manager thread whose worker is blocked in its
    initializer waits for that worker: it is the way the test's wait could still end."""
    if not idle_service_thread(proc, task):
        return False
    by_pid = {p.pid: p for p in procs}
    peers = {e.pid for e in task.waits_for if e.pid != proc.pid and e.pid in by_pid}
    return all(idle_service(by_pid[pid]) for pid in peers)


def hint_beside_idle_services(procs: list[ProcessReport]) -> list[Hint]:
    """The process's main thread waits on a primitive of its own process (a private futex: a
    Lock, an Event, a Condition) and its only other threads are idle services."""
    connecting = any(t.call == "connect" for p in procs for t in p.tasks)
    hints = []
    for proc in procs:
        task = main_task(proc)
        if task is None or is_helper(proc) or proc.busy or wait_kind(proc, task) != "blocked":
            continue
        if not (isinstance(task.wait, Futex) and task.wait.private):
            continue
        if not task.waits_for or any(e.kind != THREAD or e.pid != proc.pid for e in task.waits_for):
            continue
        others = [t for t in proc.tasks if t is not task and not ignored(proc, t)]
        if connecting or not others or not all(_idle(proc, t, procs) for t in others):
            continue
        name, frame = primitive(task_thread(proc, task))
        services = "; ".join(_service_words(proc, t) for t in others)
        tail = "release the lock" if "acquire" in name else "end it"
        clients = (
            ", and no process of the test is connecting"
            if any(_listens(t) or "serve_forever" in _service_words(proc, t) for t in others)
            else ""
        )
        facts = wait_facts(proc, task, procs)
        known = f" {render(facts, head=False)}" if facts is not None and facts.known else ""
        hints.append(
            Hint(
                f"{who(proc)} waits in {waits_in_words(proc, task, name, frame)}, and no thread "
                f"or process of the test is left to end that wait: its other thread(s) are idle "
                f"services that only wait for work ({services}){clients}; no other thread of it "
                f"is left to {tail}.{known}",
                [f"{who(proc)} blocked in {task.summary()}"]
                + [f"{who(proc)} thread {t.tid} waits for work: {t.summary()}" for t in others],
                rule="nobody",
                pids=[proc.pid],
                waits=[facts] if facts is not None else [],
            )
        )
    return hints

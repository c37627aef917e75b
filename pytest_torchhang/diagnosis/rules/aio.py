"""The rule for asyncio tasks that wait on a primitive of their own process (an Event, a Lock,
a Queue) that nothing in the process can set, release or fill any more."""

from __future__ import annotations

import os
import re

from ...inject.protocol import PLUGIN_THREAD_NAMES
from ...report.model import (
    AsyncTask,
    EventLoop,
    Frame,
    Hint,
    ProcessReport,
    ThreadStack,
    same_thread,
)
from ..ends import earlier, holds_already, thread_end
from ..frames import in_file, is_library, located
from ..graph import edge_lines, edges_to, waiters_text, who

#: What would end each primitive's wait (the hint's words).
_WHAT_ENDS = {
    "Event": "set it",
    "Lock": "release it",
    "Semaphore": "release it",
    "Condition": "notify it",
    "Barrier": "bring the other parties to it",
    "future": "complete it",
}
_QUEUE_ENDS = {
    "get": "put an item in it",
    "put": "take an item out of it",
    "join": "finish its items",
}


def _ends(task: AsyncTask) -> str:
    if task.awaits == "Queue":
        return _QUEUE_ENDS.get(task.call.rpartition(".")[2].rstrip("()"), "use it")
    return _WHAT_ENDS.get(task.awaits, "")


def _plugin_thread(thread: ThreadStack) -> bool:
    """A thread of this plugin (the watchdog, the /proc reader, a flight-recorder listener)."""
    if thread.name.startswith(PLUGIN_THREAD_NAMES):
        return True
    paths = [f.filename.replace(os.sep, "/") for f in thread.frames]
    ours = [p for p in paths if "/pytest_torchhang/" in p]
    return bool(ours) and all(p in ours or p.endswith("/threading.py") for p in paths)


def _thread_words(thread: ThreadStack) -> str:
    """``'bystander'``, or, for a thread without a name, where it started
    (``thread 0x7f.. started in gateway_base.py _thread_receiver``)."""
    if thread.name:
        return repr(thread.name)
    start = thread.frames[-1] if thread.frames else None
    where = f" started in {os.path.basename(start.filename)} {start.name}" if start else ""
    return f"thread {thread.ident}{where}"


def _thread_doing(proc: ProcessReport, thread: ThreadStack) -> str:
    """``'asyncio_0' (a worker thread of the loop's default executor) waits in
    queue.Queue.get() at x.py:10``: the other end of the wait, and what it is doing."""
    end = thread_end(proc, thread)
    if not thread.name.startswith("asyncio_"):
        return f"{_thread_words(thread)} {end.where}"
    executor = (
        " (a worker thread of the loop's default executor, which runs the functions given to "
        "run_in_executor and to_thread)"
    )
    user = next((f for f in thread.frames if _users(f)), None)
    if user is None:
        return f"{_thread_words(thread)}{executor} {end.where}"
    # a worker with a frame of the user's is inside a function it was given: it has not returned
    return (
        f"{_thread_words(thread)}{executor} is still running the function {user.name} it was "
        f"given, blocked: it {end.where}"
    )


def _users(frame: Frame) -> bool:
    """User code: not the library's, or ``python -c`` / stdin code."""
    return frame.filename in ("<string>", "<stdin>") or not is_library(frame)


def _user_frame(task: AsyncTask) -> Frame | None:
    """Where the user's code awaits: its innermost frame outside the library, else the outermost."""
    outermost = task.frames[-1] if task.frames else None
    return next((f for f in task.frames if _users(f)), outermost)


def _subject(task: AsyncTask) -> str:
    """``test_event awaits Event.wait() in task 'Task-1' at test_a.py:5``; a task with no frame
    of the user's (``wait_for()``'s inner task on 3.11) is named by itself, with no place."""
    frame = next((f for f in task.frames if _users(f)), None)
    if frame is None:
        return f"task {task.name!r} awaits {task.awaited()}"
    name = frame.name.rpartition(".")[2]
    return f"{name} awaits {task.awaited()} in task {task.name!r}{located(frame)}"


def _selecting(loop: EventLoop, proc: ProcessReport) -> ThreadStack | None:
    """The loop's thread, when its innermost frame is the loop's wait in ``select``."""
    for thread in proc.threads:
        top = thread.frames[0] if thread.frames else None
        if (
            same_thread(thread.ident, loop.thread)
            and top
            and in_file(top, "selectors.py", "select")
        ):
            return thread
    return None


def _referrers(task: AsyncTask, loop: EventLoop) -> str:
    """For a locked lock: the other tasks whose frames hold it, and what each awaits (facts:
    asyncio's Lock keeps no owner, so no task is named as its holder)."""
    if task.awaits != "Lock" or task.detail != "locked":
        return ""
    others = [t for t in loop.tasks if t is not task and task.obj in t.refs and t.obj != task.obj]
    if not others:
        return ""
    said = [f"{t.name!r}, which awaits {t.awaited()}{located(_user_frame(t))}" for t in others[:3]]
    return "; tasks that refer to the lock: " + ", and ".join(said)


_STATE = {"not set": "the event is not set", "locked": "the lock is locked"}


def _state(task: AsyncTask) -> str:
    if task.awaits == "Queue" and task.detail.startswith("0 item"):
        return "the queue is empty"
    return _STATE.get(task.detail, task.detail)


_UNFINISHED = re.compile(r"\b(\d+) not task_done\(\)")


def _task_known(task: AsyncTask, loop: EventLoop) -> str:
    """What the task's own evidence says of its wait (issue 28, item 2): it holds the lock it
    awaits; a ``Queue.join()`` on an empty queue with items never marked done."""
    if task.awaits == "Lock":
        held = holds_already(task.frames, "task", "the lock")
        if held:
            return held
    unfinished = _UNFINISHED.search(task.detail)
    if task.call == "Queue.join()" and unfinished and task.detail.startswith("0 item"):
        getters = [t.name for t in loop.tasks if t.call == "Queue.get()" and t.obj == task.obj]
        return (
            f"every item was taken, and {unfinished.group(1)} taken item(s) still wait for "
            "their task_done() call: a task that took one ended before marking it done, or went on "
            "without calling it"
            + (f"; waiting for a new item now: {', '.join(map(repr, getters))}" if getters else "")
        )
    return ""


#: The system calls an asyncio selector sleeps in.
_SELECT_CALLS = ("epoll_wait", "epoll_pwait", "select", "pselect6", "poll", "ppoll")


def _asleep_with_ready(proc: ProcessReport, loop: EventLoop, thread: ThreadStack | None) -> bool:
    """The loop has ready callbacks while its thread sleeps in select without a timeout (the
    kernel's evidence): the loop selects with a zero timeout when something is ready, so the
    callback came after it fell asleep, from another thread, with no wake-up."""
    if thread is None or loop.ready <= 0:
        return False
    task = next((t for t in proc.tasks if same_thread(t.python_thread, thread.ident)), None)
    return task is not None and task.call in _SELECT_CALLS and not task.timed


def _evidence(task: AsyncTask) -> str:
    return f"{task.label()} awaits {task.awaited()}" + (f" [{task.detail}]" if task.detail else "")


def hint_asyncio(procs: list[ProcessReport]) -> list[Hint]:
    """Tasks of a running event loop that await an asyncio primitive, with what could still
    end the wait; "nothing in the process will ..." only when nothing can: the loop has no
    ready callback, timer, file descriptor or signal handler, it waits in ``select`` running
    no task, and no other thread of the process (the plugin's own aside) is there to act."""
    hints = []
    for proc in procs:
        for loop in proc.event_loops:
            hint = _loop_hint(proc, loop)
            if hint is None:
                continue
            waiters = edges_to(procs, proc.pid)  # a parent that waits for this process
            if waiters:
                hint.text += f" Waiting for it: {waiters_text(waiters)}."
                hint.based_on += edge_lines(waiters, proc)
                hint.pids += [p.pid for p, _ in waiters]
            hints.append(hint)
    return hints


def _loop_hint(proc: ProcessReport, loop: EventLoop) -> Hint | None:
    stuck = [t for t in loop.tasks if _ends(t) and not t.timed and t.detail != "set"]
    if not stuck:
        return None
    thread = _selecting(loop, proc)
    running = [t for t in loop.tasks if t.state == "running"]
    others = [
        t
        for t in proc.threads
        if not same_thread(t.ident, loop.thread)
        and not _plugin_thread(t)
        and not earlier(proc, t)  # an earlier test's thread knows nothing of this loop
    ]
    settled = thread is not None and loop.idle() and not running
    final = settled and not others
    sentences = []
    for task in stuck[:3]:
        sentence = _subject(task)
        state = _state(task) + _referrers(task, loop)
        sentence += f" ({state})" if state else ""
        known = _task_known(task, loop)
        sentence += f"; {known}" if known else ""
        if final:
            sentence += f"; nothing in the process will {_ends(task)}"
        sentences.append(sentence)
    if len(stuck) > 3:
        sentences.append(f"{len(stuck) - 3} more task(s) await asyncio primitives too")
    text = f"{who(proc)}: " + "; ".join(sentences) + "."
    idle = (
        "its event loop has nothing that could wake it (no ready callback, timer, file "
        "descriptor or signal handler)"
    )
    if final:
        before = [
            t
            for t in proc.threads
            if not same_thread(t.ident, loop.thread) and not _plugin_thread(t) and earlier(proc, t)
        ]
        if before:  # an xdist worker's channel thread, a thread an earlier test left running
            names = "; ".join(_thread_doing(proc, t) for t in before[:4])
            text += (
                f" {idle[0].upper()}{idle[1:]}, and the process's other Python threads were "
                f"running before this test began ({names})."
            )
        else:
            text += f" {idle[0].upper()}{idle[1:]}, and the process has no other Python thread."
    elif settled:
        names = "; ".join(_thread_doing(proc, t) for t in others[:4])
        text += (
            f" {idle[0].upper()}{idle[1:]}: only another thread of the process could end the "
            "wait" + (f" ({names})" if names else "") + "."
        )
    elif running:
        text += (
            f" Its event loop is running {running[0].label()}, and runs no other task until that "
            "one awaits or returns: the loop's thread's stack shows where it is."
        )
    elif _asleep_with_ready(proc, loop, thread):
        text += (
            f" Its event loop has {loop.ready} ready callback(s), yet its thread sleeps in "
            "select with no timeout: the loop only waits there when nothing is ready, so the "
            "callback was added while it slept, by another thread, without waking it (a Future "
            "set, or a callback scheduled, from another thread with no call_soon_threadsafe); "
            "only an event on its file descriptors or timers wakes it now."
        )
    elif not loop.idle():
        text += f" Its event loop may still be woken by {loop.wakers()}."
    based_on = [
        f"pid {proc.pid}: event loop {loop.loop} in thread {loop.thread}: "
        f"{len(loop.tasks)} pending task(s), could still be woken by {loop.wakers()}",
        *(_evidence(t) for t in stuck[:9]),
    ]
    if thread is not None:
        based_on.append(f"thread {thread.ident} waits in select (its innermost frame)")
    if running:
        based_on.append(f"{running[0].label()} was running")
    if others:
        based_on.append(
            "other threads with a Python stack, the plugin's own aside: "
            + ", ".join(_thread_words(t) for t in others)
        )
    elif thread is not None:
        based_on.append("no other thread has a Python stack, the plugin's own aside")
    return Hint(text, based_on, rule="asyncio", pids=[proc.pid])

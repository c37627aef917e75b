"""The rules for processes starting up when the deadline came: still importing, or stuck on a
module's import lock that a thread of their fork parent held."""

from __future__ import annotations

import os
import re
from typing import NamedTuple

from ...report.model import Frame, Hint, ProcessReport, TaskWait
from ...report.waits import NOBODY, Futex
from ..frames import fork_parent, importing, located, main_thread
from ..graph import code, main_task, who
from ..roles import is_pytest, is_worker, making_progress

_IMPORT = re.compile(
    r"^\s*(?:import\s+([\w.]+)|from\s+([\w.]+)\s+import\b)"
    r"|\b(?:import_module|__import__)\(\s*['\"]([\w.]+)['\"]"
)
#: ``importlib.import_module(self.codec_name)``: the module is named by an expression, whose
#: value the stack does not hold (the frozen importlib frames' arguments are not captured)
_IMPORT_BY_NAME = re.compile(r"\b(?:import_module|__import__)\(\s*([\w.\[\]'\"]+)\s*[,)]")


def _import_frame(frames: list[Frame]) -> Frame | None:
    """The frame of the import statement whose module lock the thread waits for: importlib's
    own frames (``_ModuleLock.acquire``) on top, then the line that imports."""
    bootstrap = [f for f in frames if f.filename.startswith("<frozen importlib")]
    if not bootstrap or frames[0] is not bootstrap[0] or "acquire" not in frames[0].name:
        return None
    return next((f for f in frames if not _importlib(f)), None)


def _importlib(frame: Frame) -> bool:
    """importlib's own frames: the frozen bootstrap, and import_module's wrapper."""
    path = frame.filename.replace(os.sep, "/")
    return path.startswith("<frozen importlib") or path.endswith("/importlib/__init__.py")


class _ImportAtFork(NamedTuple):
    module: str
    parent: ProcessReport | None
    frame: Frame  # the import statement
    task: TaskWait  # the thread that waits


def _import_at_fork(proc: ProcessReport, by_pid: dict[int, ProcessReport]) -> _ImportAtFork | None:
    """(the module, the fork parent) of a forked process whose only thread waits at an import
    statement on a lock that no thread of the process can release: the module's import lock,
    held at fork by a thread of the parent that the child does not have."""
    main, task = main_thread(proc), main_task(proc)
    if main is None or not main.frames or task is None or proc.busy:
        return None
    frame = _import_frame(main.frames)
    if frame is None or not isinstance(task.wait, Futex) or not task.wait.private:
        return None
    match = _IMPORT.search(frame.line)
    named = _IMPORT_BY_NAME.search(frame.line)
    if match:
        module = match.group(1) or match.group(2) or match.group(3)
    elif named:
        module = f"the module that `{named.group(1)}` names"
    else:
        return None
    if not any(e.kind == NOBODY for e in task.waits_for):
        return None  # another thread of the child may hold it: another story
    parent = fork_parent(proc, by_pid)
    if parent is None and not is_worker(proc):
        return None
    return _ImportAtFork(module, parent, frame, task)


def _importer(parent: ProcessReport | None, module: str) -> str:
    """The thread of ``parent`` that runs the module's top-level code, in words."""
    if parent is None or " " in module:
        return ""  # a module named by an expression: its file is not known
    tail = module.replace(".", "/")
    for thread in parent.threads:
        for frame in thread.frames:
            path = frame.filename.replace(os.sep, "/").removesuffix(".py")
            if frame.name == "<module>" and (
                path.endswith("/" + tail) or path.endswith(tail + "/__init__")
            ):
                return (
                    f"; thread {thread.name!r} of {who(parent)} is importing it still"
                    f"{located(frame)}: `{frame.line}`"
                )
    return ""


def hint_import_lock_at_fork(procs: list[ProcessReport]) -> list[Hint]:
    """Forked children stuck on a module's import lock whose owner thread did not fork with them."""
    by_pid = {p.pid: p for p in procs}
    hints = []
    for proc in procs:
        found = _import_at_fork(proc, by_pid)
        if found is None:
            continue
        module, parent, frame, task = found
        hints.append(
            Hint(
                f"{who(proc)} waits at `{code(frame.line)}`{located(frame)} for the import lock "
                f"of {module}"
                ", and no thread of it can release that lock: it was forked "
                + (f"from {who(parent)} " if parent else "")
                + f"while another thread of the parent was importing {module}, and fork copies "
                "the lock held but not the thread that holds it"
                + _importer(parent, module)
                + f". Import {module} in the parent before the workers start (at the top of the "
                "module that starts them), or start them with spawn or forkserver.",
                [
                    f"{who(proc)} blocked in {task.summary()} with no other thread, at "
                    f"{frame.filename}:{frame.lineno}: {frame.line}"
                ],
                rule="import_lock_at_fork",
                pids=[proc.pid],
            )
        )
    return hints


def hint_still_starting(procs: list[ProcessReport]) -> list[Hint]:
    """Processes still importing at the deadline, and moving through their imports (CPU, a
    running thread): the deadline may be shorter than their start-up. A process blocked in its
    import (a lock its parent holds, a pipe nobody writes) is stuck, not slow: raising the
    timeout would not help it, and other rules tell what it waits for (issue 32)."""
    by_pid = {p.pid: p for p in procs}
    starting = [
        p
        for p in procs
        if not is_pytest(p)
        and importing(p)
        and making_progress(p)
        and _import_at_fork(p, by_pid) is None
    ]
    if not starting:
        return []
    oldest = max(p.age_s for p in starting)
    return [
        Hint(
            f"{len(starting)} process(es) are still starting up, importing modules {oldest:.1f}s after "
            "they were started: the deadline may be shorter than their start-up (spawn and forkserver "
            "children import the test module, and torch, anew). Raise the timeout, start them with "
            "fork, or preload heavy modules in the forkserver (set_forkserver_preload).",
            [
                f"{p.role} (pid {p.pid}), age {p.age_s:.1f}s, importing ({p.stuck_at}), "
                f"{_moving(p)}"
                for p in starting
            ],
            rule="still_starting",
            pids=sorted({p.pid for p in starting}),
        )
    ]


def _moving(proc: ProcessReport) -> str:
    """What says the process still moves: its CPU during the capture, else its state."""
    if proc.cpu_delta_s > 0:
        return f"+{proc.cpu_delta_s:.2f}s CPU during the capture"
    return f"{proc.state}, cpu {proc.cpu_s:.2f}s in {proc.age_s:.1f}s"

"""Capture the Python stack of every thread of every process, without ptrace and bounded in time."""

from __future__ import annotations

import contextlib
import linecache
import os
import re
import signal
import sys
import threading
from dataclasses import dataclass, field
from types import FrameType

from .. import clock
from ..inject.protocol import DUMP_SIGNAL, dump_path
from ..report.model import Frame, ThreadStack
from . import procfs
from .tree import ProcessId, signal_process

#: Frames kept per thread in a report (faulthandler itself stops at 100).
MAX_FRAMES = 60

_THREAD_HEADER = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):$")
_FRAME_LINE = re.compile(r'^  File "(.*)", line (\d+) in (.*)$')


@dataclass
class Dump:
    """The outcome of asking one process for its stacks."""

    status: str  # "ok", or why there is no stack
    threads: list[ThreadStack] = field(default_factory=list)
    was_stopped: bool = False
    #: False when the dump's text never showed its end within the budget (kept, but it may be
    #: cut short: a writer preempted mid-dump looks the same as one that is done)
    complete: bool = True


def _frame(filename: str, lineno: int, name: str) -> Frame:
    return Frame(filename, lineno, name, linecache.getline(filename, lineno).strip())


def parse_faulthandler(text: str) -> list[ThreadStack]:
    """Parse faulthandler's ``all_threads=True`` output into thread stacks."""
    threads: list[ThreadStack] = []
    current: ThreadStack | None = None
    for raw in text.splitlines():
        header = _THREAD_HEADER.match(raw)
        if header:
            current = ThreadStack(ident=header.group(2), current=header.group(1) != "Thread")
            threads.append(current)
            continue
        if raw.startswith("Stack (most recent call first):"):
            current = ThreadStack(ident="?", current=True)
            threads.append(current)
            continue
        if current is None:
            continue
        frame = _FRAME_LINE.match(raw)
        if frame:
            if len(current.frames) < MAX_FRAMES:  # trimmed in guard, once the stack is complete
                current.frames.append(_frame(frame.group(1), int(frame.group(2)), frame.group(3)))
            else:
                current.truncated = True
        elif raw.strip() == "...":
            current.truncated = True
    return threads


_PYTEST_INTERNALS = ("/_pytest/", "/pluggy/")


def trim_pytest_frames(stack: ThreadStack) -> None:
    """Cut pytest's and pluggy's own frames below the test code (they say nothing about a hang)."""
    frames = stack.frames
    for i, frame in enumerate(frames):
        internal = any(part in frame.filename for part in _PYTEST_INTERNALS)
        if i > 0 and internal and not any(p in frames[i - 1].filename for p in _PYTEST_INTERNALS):
            stack.frames = [*frames[:i], Frame("<pytest>", 0, "... pytest's own frames cut")]
            return


#: The plugin's own frames at the bottom of a child's stacks (how the child was started).
_PLUGIN_BOTTOM = (
    "pytest_torchhang/runner/zygote.py",
    "pytest_torchhang/runner/child.py",
    "pytest_torchhang/runner/jobs.py",
    "pytest_torchhang/runner/client.py",
    "/runpy.py",
)
PLUGIN_CUT = "<pytest-torchhang>"


def _plugin_frame(frame: Frame) -> bool:
    name = frame.filename.replace(os.sep, "/")
    return name.endswith(_PLUGIN_BOTTOM) or name == "<frozen runpy>"


#: The wrapper that records a store wait's key (inject/ranks.py): innermost, above the caller.
_STORE_WRAPPER = "pytest_torchhang/inject/ranks.py"


def trim_plugin_frames(stack: ThreadStack) -> None:
    """Cut the plugin's own frames (zygote, child, jobs, runpy) below a child's user code, and
    the store wrapper above it (the stack then reads as the user's call into torch's C++)."""
    if stack.frames and stack.frames[0].filename.replace(os.sep, "/").endswith(_STORE_WRAPPER):
        del stack.frames[0]
    frames = stack.frames
    cut = len(frames)
    while cut > 0 and _plugin_frame(frames[cut - 1]):
        cut -= 1
    if 0 < cut < len(frames):
        stack.frames = [
            *frames[:cut],
            Frame(PLUGIN_CUT, 0, "... pytest-torchhang's own frames cut"),
        ]


def in_process_threads(skip_idents: set[int] | None = None) -> list[ThreadStack]:
    """Stacks of this process's threads, with their names, from ``sys._current_frames``."""
    names = {t.ident: t.name for t in threading.enumerate()}
    native = {t.ident: t.native_id or 0 for t in threading.enumerate()}
    main_ident = threading.main_thread().ident
    out: list[ThreadStack] = []
    for ident, top in sys._current_frames().items():
        if skip_idents and ident in skip_idents:
            continue
        stack = ThreadStack(
            ident=hex(ident),
            name=names.get(ident, ""),
            current=ident == main_ident,
            tid=native.get(ident, 0),
        )
        frame: FrameType | None = top
        while frame is not None:
            if len(stack.frames) >= MAX_FRAMES:
                stack.truncated = True
                break
            code = frame.f_code
            stack.frames.append(_frame(code.co_filename, frame.f_lineno or 0, code.co_name))
            frame = frame.f_back
        out.append(stack)
    # main thread first, then by name, so reports read the same way every time
    out.sort(key=lambda s: (not s.current, s.name))
    return out


def handles_signal(pid: int, signum: int) -> bool:
    """Whether process ``pid`` catches ``signum`` (else sending it might kill the process)."""
    for line in procfs.text(f"/proc/{pid}/status").splitlines():
        if line.startswith("SigCgt:"):
            with contextlib.suppress(ValueError, IndexError):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def _state(pid: int) -> str:
    stat = procfs.stat(pid)
    return stat.state if stat is not None else "?"


#: Frames a main thread's stack can start from: a script or ``-c`` (``<module>``), ``python -m``
#: (runpy), and interpreter shutdown waiting for non-daemon threads (threading's ``_shutdown``).
_MAIN_BOTTOMS = (
    ("", "<module>"),
    ("runpy", "_run_module_as_main"),
    ("runpy", "_run_code"),
    ("threading", "_shutdown"),
)


def _outermost(line: str, only_thread: bool) -> bool:
    frame = _FRAME_LINE.match(line)
    if frame is None:
        # faulthandler's own ends: a stack cut at 100 frames, a dump cut at 100 threads, a thread
        # without Python frames
        return line in ("  ...", "...", "  <no Python frame>")
    filename, name = frame.group(1), frame.group(3)
    if only_thread and name == "_bootstrap" and filename.endswith("threading.py"):
        return True  # forked from a thread: that thread is the process's only one
    return any(name == n and part in filename for part, n in _MAIN_BOTTOMS)


def dump_is_complete(text: str, one_thread: bool = False) -> bool:
    """Whether faulthandler's ``all_threads`` output ``text`` has reached its end.

    Evidence, not a pause in its growth: faulthandler writes threads newest first, so the main
    thread comes last, and the dump is whole once that block ends at a frame a main thread starts
    from (or at faulthandler's own truncation line). A writer preempted anywhere before leaves a
    text that fails this test. A thread's ``_bootstrap`` ends a dump only where the kernel says
    the process has ``one_thread`` (a child forked from a thread: that thread is all it has).
    """
    if not text.endswith("\n") or text.endswith("\n\n"):
        return False  # mid-line, or the blank line before the next thread's header
    lines = text.splitlines()
    headers = [i for i, line in enumerate(lines) if _THREAD_HEADER.match(line)]
    if not headers or headers[-1] == len(lines) - 1:
        return False
    return _outermost(lines[-1], one_thread and len(headers) == 1)


def _holds_dump_file(pid: int, path: str) -> bool:
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(f"{fd_dir}/{fd}") == path:
                return True
    return False


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return -1


def request_dumps(
    procs: list[ProcessId], dump_dir: str | None, budget_s: float = 2.0
) -> dict[int, Dump]:
    """Ask each process for its stacks through the injected handler and collect the answers.

    A process is only signalled when it catches the dump signal and still holds its own dump file
    (so a process that replaced that descriptor never writes into someone else's file). A stopped
    process is continued so it can answer. A dump counts once its text shows its end
    (``dump_is_complete``); one that never does is kept, marked incomplete, when the budget is
    spent or when it has not grown for ``QUIET_S`` and nothing else is awaited. Returns within
    ``budget_s``.
    """
    dumps: dict[int, Dump] = {}
    waiting: dict[int, tuple[str, int]] = {}  # pid -> (path, offset before the request)
    for ident in procs:
        pid = ident.pid
        state = _state(pid)
        stopped = state in ("T", "t")
        if dump_dir is None or not handles_signal(pid, DUMP_SIGNAL):
            dumps[pid] = Dump(
                "no stack: no dump handler (not a Python process, or started with python -I/-E/-S "
                "or with a cleared environment)",
                was_stopped=stopped,
            )
            continue
        path = dump_path(dump_dir, pid)
        if not _holds_dump_file(pid, path):
            dumps[pid] = Dump(
                "no stack: the process closed or replaced its dump file", was_stopped=stopped
            )
            continue
        offset = max(_size(path), 0)
        if not signal_process(ident, DUMP_SIGNAL):
            dumps[pid] = Dump("gone before its stack could be taken", was_stopped=stopped)
            continue
        if stopped:
            signal_process(ident, signal.SIGCONT)
        dumps[pid] = Dump("no stack: no answer within the capture budget", was_stopped=stopped)
        waiting[pid] = (path, offset)
    _collect(dumps, waiting, clock.monotonic() + budget_s)
    return dumps


#: A dump whose end never shows is given up on after this long without growing, once it is the
#: only thing the capture still waits for (a preempted writer usually resumes well within it).
QUIET_S = 0.5


def _collect(dumps: dict[int, Dump], waiting: dict[int, tuple[str, int]], deadline: float) -> None:
    """Read the answers as they come until each is complete or the deadline passes."""
    grown: dict[int, tuple[int, float]] = {}  # pid -> (size, when it last changed)
    one_thread = {pid: getattr(procfs.stat(pid), "num_threads", 0) == 1 for pid in waiting}
    unfinished: dict[int, str] = {}  # pid -> the text so far, not yet shown complete
    while waiting:
        now = clock.monotonic()
        for pid, (path, offset) in list(waiting.items()):
            size = _size(path)
            if size <= offset or grown.get(pid, (0, 0.0))[0] == size:
                continue
            grown[pid] = (size, now)
            text = _read_from(path, offset)
            if text is not None and dump_is_complete(text, one_thread[pid]):
                dumps[pid].status = "ok"
                dumps[pid].threads = parse_faulthandler(text)
                unfinished.pop(pid, None)
                del waiting[pid]
            elif text is not None:
                unfinished[pid] = text
        quiet = all(p in grown and now - grown[p][1] >= QUIET_S for p in waiting)
        if not waiting or now >= deadline or quiet:
            break
        clock.sleep(0.01)
    for pid, text in unfinished.items():
        dumps[pid].status = "ok"
        dumps[pid].threads = parse_faulthandler(text)
        dumps[pid].complete = False
        if dumps[pid].threads:
            dumps[pid].threads[-1].truncated = True


def _read_from(path: str, offset: int) -> str | None:
    try:
        with open(path, "rb") as dump_file:
            dump_file.seek(offset)
            return dump_file.read().decode(errors="replace")
    except OSError:
        return None

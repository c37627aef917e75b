"""Capture the Python stack of every thread of every process, without ptrace and bounded in time."""

from __future__ import annotations

import contextlib
import linecache
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from types import FrameType

from ._hook import DUMP_SIGNAL, dump_path
from .proctree import ProcessId, signal_process

#: Frames kept per thread in a report (faulthandler itself stops at 100).
MAX_FRAMES = 60

_THREAD_HEADER = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):$")
_FRAME_LINE = re.compile(r'^  File "(.*)", line (\d+) in (.*)$')


@dataclass(frozen=True)
class Frame:
    """One Python frame; ``line`` is the source text when the file can be read."""

    filename: str
    lineno: int
    name: str
    line: str = ""


@dataclass
class ThreadStack:
    """One thread's stack, most recent call first."""

    ident: str
    name: str = ""
    current: bool = False
    frames: list[Frame] = field(default_factory=list)
    truncated: bool = False
    tid: int = 0  # the kernel thread id, when known (this process's own threads)


@dataclass
class Dump:
    """The outcome of asking one process for its stacks."""

    status: str  # "ok", or why there is no stack
    threads: list[ThreadStack] = field(default_factory=list)
    was_stopped: bool = False


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
    "pytest_torchhang/zygote.py",
    "pytest_torchhang/child.py",
    "pytest_torchhang/jobs.py",
    "pytest_torchhang/runner.py",
    "/runpy.py",
)
PLUGIN_CUT = "<pytest-torchhang>"


def _plugin_frame(frame: Frame) -> bool:
    name = frame.filename.replace(os.sep, "/")
    return name.endswith(_PLUGIN_BOTTOM) or name == "<frozen runpy>"


def trim_plugin_frames(stack: ThreadStack) -> None:
    """Cut the plugin's own frames (zygote, child, jobs, runpy) below a child's user code."""
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
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


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
    process is continued so it can answer. Returns within ``budget_s``.
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
    deadline = time.monotonic() + budget_s
    last_size: dict[int, int] = {}
    while waiting and time.monotonic() < deadline:
        time.sleep(0.01)
        for pid, (path, offset) in list(waiting.items()):
            size = _size(path)
            if size > offset and last_size.get(pid) == size:
                with contextlib.suppress(OSError):
                    with open(path, errors="replace") as dump_file:
                        dump_file.seek(offset)
                        text = dump_file.read()
                    dumps[pid].status = "ok"
                    dumps[pid].threads = parse_faulthandler(text)
                del waiting[pid]
            last_size[pid] = size
    return dumps

"""The one reader of /proc for captures: a read that can block runs with a hard bound, off-thread."""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

from .. import clock
from ..inject.hook import name_thread
from ..inject.protocol import THREAD_PREFIX

T = TypeVar("T")

#: Files whose read takes the target's memory-map lock or faults in its pages: a process stuck
#: in state D (a page of a hung FUSE or NFS file, a driver holding its mmap lock) blocks such a
#: read, uninterruptibly, for as long as it stays stuck. Every other file read here does not.
MMAP_FILES = frozenset(
    {"maps", "smaps", "smaps_rollup", "numa_maps", "mem", "cmdline", "environ", "auxv", "pagemap"}
)
#: The longest one mmap-dependent read may take before it is abandoned.
READ_TIMEOUT_S = 0.25
#: Reader threads left blocked at most (each on a read that never returned); past this, reads
#: that could block are refused rather than stranding one more thread.
MAX_STUCK = 4
#: Read by ``children``: False forces the full scan of /proc/*/stat that kernels without
#: CONFIG_PROC_CHILDREN (and gVisor) need; None: use ``/proc/PID/task/TID/children`` when present.
USE_CHILDREN_FILES: bool | None = None
#: A full scan of /proc gives up after this long (what it found so far is returned).
SCAN_BUDGET_S = 1.0
TICKS = os.sysconf("SC_CLK_TCK")

NOT_IN_TIME = "not read in time"


@dataclass(frozen=True)
class Stat:
    """The fields of ``/proc/PID/stat`` (or of one thread's) that the plugin uses."""

    comm: str
    state: str  # R, S, D, T, t, Z, X, I
    ppid: int
    utime: int  # clock ticks
    stime: int
    num_threads: int
    start_ticks: int  # since boot
    wait_status: int | None  # a zombie's wait status (field 52), when the kernel shows it

    @property
    def cpu_ticks(self) -> int:
        return self.utime + self.stime


def parse_stat(raw: bytes) -> Stat | None:
    """Parse a stat file (the command name may hold spaces and parentheses: split at the last)."""
    head, sep, tail = raw.rpartition(b")")
    if not sep:
        return None
    fields = tail.split()
    try:
        return Stat(
            comm=head.partition(b"(")[2].decode(errors="replace"),
            state=fields[0].decode(),
            ppid=int(fields[1]),
            utime=int(fields[11]),
            stime=int(fields[12]),
            num_threads=int(fields[17]),
            start_ticks=int(fields[19]),
            wait_status=int(fields[49]) if len(fields) > 49 else None,
        )
    except (IndexError, ValueError):
        return None


def read(path: str, limit: int = 65536) -> bytes | None:
    """Read a /proc file that never blocks (stat, status, syscall, wchan, fdinfo, ...); None if
    it cannot be read (the process is gone). Files in ``MMAP_FILES`` go through ``ProcReader``."""
    try:
        return _read_or_raise(path, limit)
    except OSError:
        return None


def text(path: str, limit: int = 65536) -> str:
    """``read`` as text ('' when unreadable)."""
    raw = read(path, limit)
    return "" if raw is None else raw.decode(errors="replace")


def stat(pid: int, tid: int | None = None) -> Stat | None:
    """``/proc/PID/stat`` (or ``/proc/PID/task/TID/stat``), parsed; None when gone."""
    raw = read(f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat", 4096)
    return None if raw is None else parse_stat(raw)


# --- children ----------------------------------------------------------------------------------


def children_files() -> bool:
    """Whether this kernel has ``/proc/PID/task/TID/children`` (CONFIG_PROC_CHILDREN)."""
    if USE_CHILDREN_FILES is not None:
        return USE_CHILDREN_FILES
    return _has_children_files()


def _has_children_files() -> bool:
    global _CHILDREN_FILES_SEEN
    if _CHILDREN_FILES_SEEN is None:
        me = os.getpid()
        _CHILDREN_FILES_SEEN = os.path.exists(f"/proc/{me}/task/{me}/children")
    return _CHILDREN_FILES_SEEN


_CHILDREN_FILES_SEEN: bool | None = None  # a kernel fact: read once


def ppid_table(budget_s: float = SCAN_BUDGET_S) -> dict[int, list[int]]:
    """parent pid -> child pids, from one pass over /proc/*/stat (bounded by ``budget_s``)."""
    deadline = clock.monotonic() + budget_s
    table: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return table
    for name in names:
        if not name.isdigit():
            continue
        if clock.monotonic() > deadline:
            break
        info = stat(int(name))
        if info is not None:
            table.setdefault(info.ppid, []).append(int(name))
    return table


def children(pid: int) -> list[int]:
    """Direct children of ``pid``: the one reader of children for the whole plugin.

    Its threads' ``/proc/PID/task/TID/children`` files (no scan of every process); this
    process's own stay open between reads. Where the kernel has no such files (gVisor, no
    CONFIG_PROC_CHILDREN), a scan of /proc/*/stat: a walk of a tree uses ``child_lister``
    so that it scans once.
    """
    if not children_files():
        return ppid_table().get(pid, [])
    if pid == os.getpid():
        return _OwnChildren.read()
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        raw = read(f"/proc/{pid}/task/{tid}/children")
        if raw:
            out.extend(int(word) for word in raw.split())
    return out


def child_lister() -> Callable[[int], list[int]]:
    """``children`` for one walk of a tree: on kernels without the ``children`` files, every
    step answers from one scan of /proc/*/stat instead of a scan each."""
    if children_files():
        return children
    table = ppid_table()
    return lambda pid: table.get(pid, [])


def walk(roots: Iterable[int], lister: Callable[[int], list[int]] | None = None) -> list[int]:
    """``roots`` and all their descendants, each once, every parent before its children."""
    children_of = lister or child_lister()
    out: list[int] = []
    seen: set[int] = set()
    todo = list(roots)[::-1]
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        out.append(pid)
        todo.extend(reversed(children_of(pid)))
    return out


class _OwnChildren:
    """This process's children, read twice per guarded test: the ``children`` file of each of
    its threads stays open and is read again with ``pread`` (an open per read costs more than
    the rest of the snapshot). Locked: the watchdog's capture reads them while a test runs."""

    lock: ClassVar[threading.Lock] = threading.Lock()
    fds: ClassVar[dict[str, int]] = {}
    pid: ClassVar[int] = 0

    @classmethod
    def read(cls) -> list[int]:
        with cls.lock:
            return cls._read()

    @classmethod
    def _read(cls) -> list[int]:
        me = os.getpid()
        if cls.pid != me:  # first use, or a forked child: the parent's descriptors are not ours
            cls._close()
            cls.pid = me
        try:
            tasks = os.listdir("/proc/self/task")  # threads come and go: list them each time
        except OSError:
            return []
        for gone in set(cls.fds) - set(tasks):
            with contextlib.suppress(OSError):
                os.close(cls.fds.pop(gone))
        out: list[int] = []
        for tid in tasks:
            fd = cls.fds.get(tid)
            try:
                if fd is None:
                    fd = cls.fds[tid] = os.open(
                        f"/proc/self/task/{tid}/children", os.O_RDONLY | os.O_CLOEXEC
                    )
                out.extend(int(word) for word in os.pread(fd, 65536, 0).split())
            except (OSError, ValueError):
                continue
        return out

    @classmethod
    def _close(cls) -> None:
        for fd in cls.fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        cls.fds.clear()

    @classmethod
    def after_fork(cls) -> None:
        """In a forked child: a read in flight in another thread of the parent left the lock
        taken, and the descriptors name the parent's threads."""
        cls.lock = threading.Lock()
        cls._close()
        cls.pid = os.getpid()


os.register_at_fork(after_in_child=_OwnChildren.after_fork)


def disk_sleeper(pid: int) -> int:
    """The id of a thread of ``pid`` in uninterruptible sleep (state D), or 0."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tids:
        info = stat(pid, int(tid))
        if info is not None and info.state == "D":
            return int(tid)
    return 0


# --- bounded calls -----------------------------------------------------------------------------


class _Job:
    """One call handed to a reader thread; ``done`` is set when it returned or raised."""

    __slots__ = ("done", "error", "fn", "result", "what")

    def __init__(self, fn: Callable[[], object], what: str) -> None:
        self.fn = fn
        self.what = what
        self.done = threading.Event()
        self.result: object = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:  # handed back to the caller, who decides
            self.error = exc
        finally:
            self.done.set()


class _Readers:
    """The process's reader thread (one, reused), and the jobs abandoned on earlier ones."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.queue: queue.SimpleQueue[_Job | None] | None = None
        self.thread: threading.Thread | None = None
        self.stuck: list[_Job] = []
        self.pid = os.getpid()

    def submit(self, job: _Job) -> tuple[str, queue.SimpleQueue[_Job | None] | None]:
        """Queue ``job``: ('', the queue it is on), or (why it was refused, None)."""
        with self.lock:
            if self.pid != os.getpid():  # a fork: the parent's thread is not here
                self.__init__()  # type: ignore[misc]
            self.stuck = [j for j in self.stuck if not j.done.is_set()]
            if len(self.stuck) >= MAX_STUCK:
                return f"refused: {len(self.stuck)} earlier reads are still blocked", None
            if self.queue is None:
                self.queue = queue.SimpleQueue()
                self.thread = threading.Thread(
                    target=_serve, args=(self.queue,), name=f"{THREAD_PREFIX}proc-reader",
                    daemon=True,
                )  # fmt: skip
                self.thread.start()
                name_thread(self.thread)
            self.queue.put(job)
            return "", self.queue

    def abandon(self, job: _Job, on: queue.SimpleQueue[_Job | None] | None) -> None:
        """Leave ``job`` to its blocked thread; the next read starts a fresh one."""
        with self.lock:
            self.stuck.append(job)
            if on is not None and self.queue is on:
                on.put(None)  # the blocked thread ends once its read returns, if ever
                self.queue = None
                self.thread = None


def _serve(jobs: queue.SimpleQueue[_Job | None]) -> None:
    while (job := jobs.get()) is not None:
        job.run()


_READERS = _Readers()
os.register_at_fork(after_in_child=lambda: _READERS.__init__())  # type: ignore[misc]


def reader_idents() -> set[int]:
    """Python idents of the reader threads (left out of the capture of this process)."""
    with _READERS.lock:
        threads = [_READERS.thread] if _READERS.thread is not None else []
    return {t.ident for t in threads if t.ident is not None}


def reader_native_ids() -> set[int]:
    """Kernel ids of the reader threads."""
    with _READERS.lock:
        thread = _READERS.thread
    return {thread.native_id} if thread is not None and thread.native_id else set()


def still_blocked(what: str) -> bool:
    """Whether an earlier bounded read of ``what`` (a path) has not returned yet."""
    with _READERS.lock:
        return any(j.what == what and not j.done.is_set() for j in _READERS.stuck)


def _bounded(fn: Callable[[], T], what: str, timeout_s: float) -> tuple[T | None, str]:
    """(result, '') when ``fn`` returned within ``timeout_s`` on the reader thread, else
    (None, why); an OSError of ``fn`` gives (None, '')."""
    if still_blocked(what):
        return None, "skipped: an earlier read of it is still blocked"
    job = _Job(fn, what)
    refused, on = _READERS.submit(job)
    if refused:
        return None, refused
    if not job.done.wait(max(timeout_s, 0.0)):
        _READERS.abandon(job, on)
        return None, f"{NOT_IN_TIME} ({timeout_s:.2f}s)"
    if isinstance(job.error, OSError):
        return None, ""
    if job.error is not None:
        raise job.error
    return job.result, ""  # type: ignore[return-value]


def call_with_timeout(timeout_s: float, fn: Callable[..., T], *args: object) -> T:
    """Run ``fn(*args)`` in a daemon thread of its own; raise ``TimeoutError`` if it has not
    returned within ``timeout_s`` (the thread is left behind: it cannot be stopped).

    For a whole capture whose every step is bounded but whose sum must be too (the monitor's
    last resort): ``report = call_with_timeout(10.0, capture, target)``. Exceptions of ``fn``
    are raised here.
    """
    job = _Job(lambda: fn(*args), getattr(fn, "__name__", "call"))
    thread = threading.Thread(target=job.run, name=f"{THREAD_PREFIX}bounded-call", daemon=True)
    thread.start()
    name_thread(thread)
    if not job.done.wait(timeout_s):
        raise TimeoutError(f"{job.what} did not return within {timeout_s:.1f}s")
    if job.error is not None:
        raise job.error
    return job.result  # type: ignore[return-value]


# --- one capture's reads -----------------------------------------------------------------------


@dataclass
class Unread:
    """A fact a capture could not read, and why."""

    pid: int
    what: str
    reason: str


@dataclass
class ProcReader:
    """One capture's reads of /proc: each that can block is bounded, and by ``deadline`` too.

    ``skip_disk_sleep``: a process with a thread in state D gets its mmap-dependent reads skipped
    (its reason recorded) instead of tried. What could not be read is in ``unread``. ``root``
    is where the per-process directories are (/proc; a test points it elsewhere).
    """

    deadline: float | None = None  # clock.monotonic()
    timeout_s: float = READ_TIMEOUT_S
    skip_disk_sleep: bool = True
    root: str = "/proc"
    unread: list[Unread] = field(default_factory=list)
    _sleepers: dict[int, int] = field(default_factory=dict)

    def _skip(self, pid: int) -> str:
        if not self.skip_disk_sleep:
            return ""
        if pid not in self._sleepers:
            self._sleepers[pid] = disk_sleeper(pid)
        tid = self._sleepers[pid]
        if tid:
            return (
                f"skipped: its thread {tid} is in uninterruptible sleep (state D) and may hold "
                "its memory map"
            )
        return ""

    def _limit(self) -> float:
        if self.deadline is None:
            return self.timeout_s
        return min(self.timeout_s, self.deadline - clock.monotonic())

    def _call(self, pid: int, what: str, path: str, fn: Callable[[], T]) -> T | None:
        reason = self._skip(pid)
        if not reason:
            limit = self._limit()
            if limit <= 0:
                reason = "skipped: the capture's time budget ran out"
            else:
                result, reason = _bounded(fn, path, limit)
                if not reason:
                    return result
        self.unread.append(Unread(pid, what, reason))
        return None

    def file(self, pid: int, name: str, limit: int = 65536) -> bytes | None:
        """``/proc/PID/<name>``: bounded when it can block; None when not read."""
        path = f"{self.root}/{pid}/{name}"
        if name not in MMAP_FILES:
            return read(path, limit)
        return self._call(pid, name, path, lambda: _read_or_raise(path, limit))

    def mem(self, pid: int, addr: int, size: int) -> bytes | None:
        """``size`` bytes of ``pid``'s memory at ``addr`` (a poll array, a select set)."""
        path = f"{self.root}/{pid}/mem"
        return self._call(pid, f"memory at {addr:#x}", path, lambda: _pread(path, addr, size))

    def cmdline(self, pid: int) -> list[str] | None:
        """The command line, as psutil splits it; None when not read."""
        raw = self.file(pid, "cmdline")
        if raw is None:
            return None
        if raw.endswith(b"\0"):
            raw = raw[:-1]
        if not raw:
            return []  # a zombie, or a kernel thread
        words = raw.split(b"\0")
        if len(words) == 1 and b" " in words[0]:  # a process that rewrote its title
            words = words[0].split(b" ")
        return [w.decode(errors="replace") for w in words]

    def environ(self, pid: int) -> dict[str, str] | None:
        """The process's environment at its start; None when not read."""
        raw = self.file(pid, "environ", 1 << 20)
        if raw is None:
            return None
        out: dict[str, str] = {}
        for entry in raw.split(b"\0"):
            key, sep, value = entry.partition(b"=")
            if sep:
                out[key.decode(errors="replace")] = value.decode(errors="replace")
        return out

    def notes(self, pids: Iterable[int] | None = None) -> list[str]:
        """One note per process with facts missing: what, and why."""
        wanted = None if pids is None else set(pids)
        by_pid: dict[int, list[str]] = {}
        for item in self.unread:
            if wanted is None or item.pid in wanted:
                by_pid.setdefault(item.pid, []).append(f"{item.what} ({item.reason})")
        return [
            f"pid {pid}: /proc facts missing, so what depends on them is not shown: "
            + "; ".join(dict.fromkeys(parts))
            for pid, parts in by_pid.items()
        ]


def _read_or_raise(path: str, limit: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = [os.read(fd, limit)]
        got = len(chunks[0])
        while chunks[-1] and got < limit:  # seq files hand out a page or so per read
            chunks.append(os.read(fd, limit - got))
            got += len(chunks[-1])
        return b"".join(chunks)
    finally:
        os.close(fd)


def _pread(path: str, addr: int, size: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.pread(fd, size, addr)
    finally:
        os.close(fd)

"""The test's process tree: discovery, subreaper, identity-checked freeze-and-kill, reaping, shm."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import ClassVar

import psutil

from . import procfs
from .target import Births

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36

SHM_DIR = "/dev/shm"
# Segment names the multiprocess stack creates: multiprocessing named semaphores (spawn and
# forkserver), torch's file_system sharing strategy, multiprocessing.shared_memory.
_SHM_PREFIXES = ("sem.mp-", "torch_", "psm_")
_TORCH_SHM_PID = re.compile(r"^torch_(\d+)_")

#: After the last SIGKILL, how long the killed get to die before any is called a survivor.
SETTLE_S = 1.0
#: Helpers that clean up shared memory when their clients are gone, if given a moment to.
TRACKER_GRACE_S = {"resource_tracker": 2.0, "torch_shm_manager": 4.0}


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, arg: int) -> bool:
    try:
        return int(_libc().prctl(option, arg, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def end_helper(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """Wait up to ``grace_s`` for a helper told to exit (its pipe closed), then kill it; bounded."""
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)


def become_subreaper() -> bool:
    """Adopt orphans of this process's descendants (setsid'd daemons) so they stay in its tree."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent thread exits."""
    return _prctl(_PR_SET_PDEATHSIG, sig)


@dataclass(frozen=True)
class ProcessId:
    """A process as identity: a pid is only the same process while its start time matches."""

    pid: int
    create_time: float


def helper_kind(cmdline: list[str], name: str) -> str | None:
    """Recognise the multiprocessing and torch helper processes by their command line."""
    joined = " ".join(cmdline)
    if name == "torch_shm_manager" or (cmdline and cmdline[0].endswith("torch_shm_manager")):
        return "torch_shm_manager"
    if "multiprocessing.resource_tracker" in joined and "main(" in joined:
        return "resource_tracker"
    if "multiprocessing.forkserver" in joined and "main(" in joined:
        return "forkserver"
    return None


def _safe_cmdline(proc: psutil.Process) -> list[str]:
    # bounded: psutil's cmdline() blocks on a process stuck in state D holding its mmap lock
    return procfs.ProcReader().cmdline(proc.pid) or []


def _safe_name(proc: psutil.Process) -> str:
    stat = procfs.stat(proc.pid)  # not psutil's name(): it reads the cmdline of long names
    return stat.comm if stat is not None else ""


def is_zombie(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


def same_process(proc: psutil.Process, ident: ProcessId) -> bool:
    """True while ``proc`` still is the process first seen as ``ident`` (not a recycled pid)."""
    try:
        return proc.pid == ident.pid and proc.create_time() == ident.create_time
    except psutil.Error:
        return False


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (``/proc/PID/stat`` field 22), or None."""
    stat = procfs.stat(pid)
    return stat.start_ticks if stat is not None else None


def _child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` from ``/proc/PID/task/*/children``: no scan of every process
    (where the kernel has no such files, one scan of /proc: see ``_children_lister``)."""
    if pid == os.getpid() and procfs.children_files():
        return _OwnChildren.read()
    return procfs.children(pid)


def _children_lister() -> Callable[[int], list[int]]:
    """How to list children for one walk of a tree: the ``children`` files, or, on kernels
    without them (gVisor, no CONFIG_PROC_CHILDREN), one scan of /proc/*/stat for all."""
    if procfs.children_files():
        return _child_pids
    table = procfs.ppid_table()
    return lambda pid: table.get(pid, [])


class _OwnChildren:
    """This process's children, read twice per guarded test: the ``children`` file of each of
    its threads stays open and is read again with ``pread`` (an open per read costs more than
    the rest of the snapshot)."""

    fds: ClassVar[dict[str, int]] = {}
    pid: ClassVar[int] = 0

    @classmethod
    def read(cls) -> list[int]:
        me = os.getpid()
        if cls.pid != me:  # first use, or a forked child: the parent's descriptors are not ours
            cls.close()
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
    def close(cls) -> None:
        for fd in cls.fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        cls.fds.clear()


def births(root_pid: int, skip: Iterable[int] = ()) -> Births:
    """(pid, start ticks) of every descendant of ``root_pid`` now: what a test did not start.

    Cheap on the common path (a pytest process without children reads one small file per
    thread), since it runs before and after every guarded test. ``skip``: children left out
    with their trees (the plugin's monitor, which starts nothing).
    """
    leave_out = set(skip)
    children = _children_lister()
    return _births_below((pid for pid in children(root_pid) if pid not in leave_out), children)


def births_below(pids: Iterable[int]) -> Births:
    """(pid, start ticks) of ``pids`` and all their descendants, as they are now."""
    return _births_below(pids, _children_lister())


def _births_below(pids: Iterable[int], children: Callable[[int], list[int]]) -> Births:
    found: set[tuple[int, int]] = set()
    todo = list(pids)
    while todo:
        pid = todo.pop()
        ticks = start_ticks(pid)
        if ticks is None or (pid, ticks) in found:
            continue
        found.add((pid, ticks))
        todo.extend(children(pid))
    return frozenset(found)


def _transparent_helpers(procs: list[psutil.Process], root_pid: int) -> set[int]:
    """The root's own multiprocessing helpers (forkserver, resource_tracker): session-wide
    state, neither the test's nor context; what they fork for a test is the test's."""
    out = set()
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if proc.ppid() == root_pid and helper_kind(_safe_cmdline(proc), _safe_name(proc)):
                out.add(proc.pid)
    return out


def split_descendants(
    root_pid: int, exclude: Iterable[int] = (), before: Births | None = None
) -> tuple[list[psutil.Process], list[psutil.Process]]:
    """Live descendants of ``root_pid`` as (owned, context), minus the ``exclude``d processes.

    Context is what existed in ``before`` (a snapshot taken when the test began) and everything
    below it: a session fixture's server and its workers. Excluded processes (the plugin's own
    helpers) and the root's multiprocessing helpers are transparent: their children are judged
    one by one, so a zygote child or forkserver worker born during the test is the test's.
    """
    skip = set(exclude)
    try:
        procs = psutil.Process(root_pid).children(recursive=True)
    except psutil.Error:
        return [], []
    if not before:
        return [p for p in procs if p.pid not in skip], []
    transparent = skip | _transparent_helpers(procs, root_pid)
    context: set[int] = set()
    for proc in procs:  # breadth first: a parent comes before its children
        if proc.pid in transparent:
            continue
        with contextlib.suppress(psutil.Error):
            if (proc.pid, start_ticks(proc.pid)) in before or proc.ppid() in context:
                context.add(proc.pid)
    owned = [p for p in procs if p.pid not in skip and p.pid not in context]
    return owned, [p for p in procs if p.pid in context]


def descendants(
    root_pid: int, exclude: Iterable[int] = (), before: Births | None = None
) -> list[psutil.Process]:
    """Every live descendant of ``root_pid`` the test owns (see ``split_descendants``)."""
    return split_descendants(root_pid, exclude, before)[0]


def identify(procs: Iterable[psutil.Process]) -> dict[int, ProcessId]:
    """Identities of ``procs`` that are still there, by pid."""
    out: dict[int, ProcessId] = {}
    for proc in procs:
        try:
            out[proc.pid] = ProcessId(proc.pid, proc.create_time())
        except psutil.Error:
            continue
    return out


def signal_process(ident: ProcessId, sig: int) -> bool:
    """Send ``sig`` to ``ident`` only if that pid still belongs to that process."""
    try:
        proc = psutil.Process(ident.pid)
        if not same_process(proc, ident):
            return False
        proc.send_signal(sig)  # psutil re-checks identity before signalling
        return True
    except (psutil.Error, OSError):
        return False


@dataclass
class KillResult:
    """What a kill did: whom it killed, who outlived it, what it reaped and unlinked."""

    killed: list[ProcessId] = field(default_factory=list)
    spared: list[ProcessId] = field(default_factory=list)
    survivors: list[ProcessId] = field(default_factory=list)
    reaped: dict[int, int] = field(default_factory=dict)  # pid -> exit status
    shm_removed: list[str] = field(default_factory=list)


def kill_tree(
    root_pid: int,
    *,
    exclude: Iterable[int] = (),
    include_root: bool = False,
    spare_root_helpers: bool = True,
    budget_s: float = 5.0,
    before: Births | None = None,
) -> KillResult:
    """SIGKILL every descendant of ``root_pid`` (and the root itself if ``include_root``).

    Processes are frozen with SIGSTOP first and the tree is listed again until it stops growing, so
    a process that forks during the kill cannot escape. Every signal is identity-checked. Helpers
    that clean shared memory (resource_tracker, torch_shm_manager) born in the tree get a short
    grace to do so; ``spare_root_helpers`` leaves the root's own multiprocessing helpers
    (forkserver, resource_tracker: session-wide state of the root) alone. What existed in
    ``before`` (and its descendants) is never signalled. Bounded by ``budget_s``.
    """
    kill = _TreeKill(root_pid, set(exclude), include_root, spare_root_helpers, before)
    deadline = time.monotonic() + budget_s
    stable_rounds = 0
    while time.monotonic() < deadline:
        targets, grew = kill.list_targets()
        kill.freeze(targets)
        if grew and stable_rounds < 20:
            stable_rounds += 1
            continue  # list again: a process may have forked before it was frozen
        kill.kill(targets)
        kill.end_graceful()
        if not targets and not kill.graceful:
            break
        time.sleep(0.02 if targets else 0.05)
    return kill.finish(min(deadline, time.monotonic() + SETTLE_S))


@dataclass
class _TreeKill:
    """The state of one ``kill_tree``: whom it has seen, frozen, spared and is waiting for."""

    root_pid: int
    excluded: set[int]
    include_root: bool
    spare_root_helpers: bool
    before: Births | None
    result: KillResult = field(default_factory=KillResult)
    seen: dict[int, ProcessId] = field(default_factory=dict)
    stopped: set[int] = field(default_factory=set)
    graceful: dict[int, tuple[ProcessId, float]] = field(default_factory=dict)  # give-up time
    spared: dict[int, ProcessId] = field(default_factory=dict)

    def list_targets(self) -> tuple[list[psutil.Process], bool]:
        """The tree's processes to kill now, and whether any is new since the last listing."""
        procs = descendants(self.root_pid, self.excluded, self.before)
        if self.include_root:
            with contextlib.suppress(psutil.Error):
                procs.append(psutil.Process(self.root_pid))
        targets: list[psutil.Process] = []
        grew = False
        for proc in procs:
            if proc.pid in self.spared or proc.pid in self.graceful or is_zombie(proc):
                continue
            ident = self.seen.get(proc.pid)
            if ident is None:
                ident = self._first_sight(proc)
                if ident is None:
                    continue
                grew = True
            elif not same_process(proc, ident):
                continue
            targets.append(proc)
        return targets, grew

    def _first_sight(self, proc: psutil.Process) -> ProcessId | None:
        """Identify a process seen for the first time; None when it is not to be killed now
        (gone, a helper of the root that is spared, a helper given a grace to clean up)."""
        ident = identify([proc]).get(proc.pid)
        if ident is None:
            return None
        cmdline = _safe_cmdline(proc)
        kind = helper_kind(cmdline, _safe_name(proc))
        try:
            parent = proc.ppid()
            if kind is not None and _safe_cmdline(psutil.Process(parent)) == cmdline:
                kind = None  # a child the helper forked (forkserver), not the helper
        except psutil.Error:
            parent = -1
        if kind is not None and self.spare_root_helpers and parent == self.root_pid:
            self.spared[proc.pid] = ident
            return None
        if kind in TRACKER_GRACE_S and proc.pid != self.root_pid:
            self.graceful[proc.pid] = (ident, time.monotonic() + TRACKER_GRACE_S[kind])
            return None
        self.seen[proc.pid] = ident
        return ident

    def freeze(self, targets: list[psutil.Process]) -> None:
        for proc in targets:
            if proc.pid not in self.stopped and signal_process(self.seen[proc.pid], signal.SIGSTOP):
                self.stopped.add(proc.pid)

    def kill(self, targets: list[psutil.Process]) -> None:
        for proc in targets:
            ident = self.seen[proc.pid]
            if signal_process(ident, signal.SIGKILL) and ident not in self.result.killed:
                self.result.killed.append(ident)

    def end_graceful(self) -> None:
        """Helpers that had a grace: gone by themselves, spared, or killed once it is over."""
        now = time.monotonic()
        for pid, (ident, give_up) in list(self.graceful.items()):
            if not _alive(ident):
                del self.graceful[pid]
                self.result.killed.append(ident)  # it cleaned up and exited on its own
            elif now >= give_up and not self.include_root and _maps_torch_shm(self.root_pid):
                # The root (the test process) still maps tensors this manager serves: killing
                # it would make freeing them abort the root (libshm throws in a destructor). It
                # exits, unlinking its segments, once they are freed or the root exits.
                del self.graceful[pid]
                self.spared[pid] = ident
            elif now >= give_up and signal_process(ident, signal.SIGKILL):
                del self.graceful[pid]
                self.result.killed.append(ident)

    def finish(self, settle_until: float) -> KillResult:
        """Survivors, reaped children: the result."""
        result = self.result
        result.spared = list(self.spared.values())
        # SIGKILL is not instant: a busy machine may take a moment to end a process (one that
        # left the tree meanwhile, reparented when its parent died, is no longer listed). Give
        # the killed a bounded moment to die before calling any of them a survivor.
        while (alive := [i for i in self.seen.values() if _alive(i)]) and (
            time.monotonic() < settle_until
        ):
            time.sleep(0.01)
        result.survivors = alive
        result.reaped = reap(result.killed)
        return result


def _alive(ident: ProcessId) -> bool:
    """Whether ``ident`` still runs (a zombie, or a recycled pid, does not)."""
    try:
        proc = psutil.Process(ident.pid)
        return same_process(proc, ident) and not is_zombie(proc)
    except psutil.Error:
        return False


def _maps_torch_shm(pid: int) -> bool:
    """Whether ``pid`` maps a segment of torch's file_system sharing strategy (True when its
    maps cannot be read in time: sparing the manager is the safe side)."""
    reader = procfs.ProcReader(skip_disk_sleep=False)
    maps = reader.file(pid, "maps", 16 << 20)
    if maps is None:
        return bool(reader.unread)
    return f"{SHM_DIR}/torch_".encode() in maps


def reap(killed: Iterable[ProcessId], timeout_s: float = 1.0) -> dict[int, int]:
    """Wait for those of ``killed`` that are this process's own children, so no zombie is left.

    A child that a live ``subprocess.Popen`` or ``multiprocessing.Process`` of this process
    owns is left to its owner: reaping it here would steal its exit status (``Popen.poll()``
    would then say 0 for a process that was killed).
    """
    me = os.getpid()
    pending: dict[int, ProcessId] = {}
    for ident in killed:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(ident.pid)
            if same_process(proc, ident) and proc.ppid() == me:
                pending[ident.pid] = ident
    if pending:
        for pid in owned_by_objects() & set(pending):
            del pending[pid]
    reaped: dict[int, int] = {}
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        for pid in list(pending):
            try:
                got, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                del pending[pid]  # someone else reaped it
                continue
            if got == pid:
                reaped[pid] = os.waitstatus_to_exitcode(status)
                del pending[pid]
        if pending:
            time.sleep(0.01)
    return reaped


def owned_by_objects() -> set[int]:
    """Pids of children that a live ``Popen`` or ``multiprocessing.Process`` here will wait for."""
    pids: set[int] = set()
    mp_process = sys.modules.get("multiprocessing.process")
    for child in list(getattr(mp_process, "_children", ())):
        popen = getattr(child, "_popen", None)
        if popen is not None and getattr(popen, "returncode", 0) is None:
            pids.add(popen.pid)
    subprocess = sys.modules.get("subprocess")
    if subprocess is not None:
        # Popen objects are found by a scan of the heap: only after a kill, never per test.
        popen_type = subprocess.Popen
        for obj in gc.get_objects():
            # type(), not isinstance(): isinstance may call a __class__ property (deprecated
            # torch objects warn when asked)
            if issubclass(type(obj), popen_type) and obj.returncode is None:
                pids.add(obj.pid)
    return pids


def reap_orphans() -> list[int]:
    """Reap exited children nobody here will wait for (orphans this subreaper adopted)."""
    me = os.getpid()
    zombies = []
    for pid in _child_pids(me):
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                zombies.append(pid)
    reaped = []
    for pid in set(zombies) - (owned_by_objects() if zombies else set()):
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                reaped.append(pid)
    return reaped


def shm_entries() -> set[str]:
    """Names in /dev/shm now (empty where there is no /dev/shm)."""
    try:
        return set(os.listdir(SHM_DIR))
    except OSError:
        return set()


def _open_anywhere(names: set[str]) -> set[str]:
    """Which of ``names`` some live process still has open or mapped.

    Matched by inode, not path: glibc's sem_open maps a temporary file and then renames it, so a
    process's maps name a deleted ``sem.XXXXXX`` while /dev/shm shows ``sem.mp-...``.
    """
    by_inode: dict[int, str] = {}
    for name in names:
        with contextlib.suppress(OSError):
            by_inode[os.stat(os.path.join(SHM_DIR, name)).st_ino] = name
    used: set[str] = set()
    # Every process of the machine: one stuck in state D must not hang the cleanup (its maps are
    # then unknown, and so is whether it uses a segment: all are kept).
    reader = procfs.ProcReader(deadline=time.monotonic() + 2.0, skip_disk_sleep=False)
    for pid_dir in os.listdir("/proc"):
        if not pid_dir.isdigit():
            continue
        base = f"/proc/{pid_dir}"
        unread = len(reader.unread)
        maps = reader.file(int(pid_dir), "maps", 16 << 20)
        if len(reader.unread) > unread:
            return set(names)
        for line in (maps or b"").decode(errors="replace").splitlines():
            if SHM_DIR not in line:
                continue
            fields = line.split(None, 5)
            if len(fields) >= 5 and fields[4].isdigit() and int(fields[4]) in by_inode:
                used.add(by_inode[int(fields[4])])
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"{base}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"{base}/fd/{fd}").startswith(SHM_DIR):
                        inode = os.stat(f"{base}/fd/{fd}").st_ino
                        if inode in by_inode:
                            used.add(by_inode[inode])
    return used


def cleanup_shm(since: float, killed_pids: Iterable[int]) -> list[str]:
    """Unlink /dev/shm segments created since ``since`` (wall time) that the killed tree left.

    Only multiprocessing/torch names are considered, and only those no live process has open or
    mapped (a parallel pytest-xdist worker's segments stay; a segment the test still maps is its
    spared torch_shm_manager's to unlink); ``torch_<pid>_*`` names must also belong to a killed
    process. Ages come from the entries themselves, so no listing is taken before each test.
    """
    killed = set(killed_pids)
    candidates: set[str] = set()
    for name in shm_entries():
        if not name.startswith(_SHM_PREFIXES):
            continue
        match = _TORCH_SHM_PID.match(name)
        if match and int(match.group(1)) not in killed:
            continue
        try:
            # file times come from a coarse clock, a tick behind time.time() at most
            if os.stat(os.path.join(SHM_DIR, name)).st_ctime < since - 0.05:
                continue
        except OSError:
            continue
        candidates.add(name)
    if not candidates:
        return []
    removed = []
    for name in sorted(candidates - _open_anywhere(candidates)):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
    return removed

"""The kill of a test's tree: freeze, identity-checked SIGKILL, reaping; what it holds is read
while it is frozen, so that its /dev/shm and $TMPDIR leftovers can be removed by ownership."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field

import psutil

from .. import clock
from . import leftovers, loader_sigchld, procfs
from .target import Births
from .tree import (
    ProcessId,
    command_line,
    descendants,
    helper_kind,
    identify,
    is_zombie,
    process_name,
    same_process,
    signal_process,
)

SHM_DIR = leftovers.SHM_DIR

#: After the last SIGKILL, how long the killed get to die before any is called a survivor.
SETTLE_S = 1.0
#: Helpers that clean up shared memory when their clients are gone, if given a moment to.
TRACKER_GRACE_S = {"resource_tracker": 2.0, "torch_shm_manager": 4.0}


@dataclass
class KillResult:
    """What a kill did: whom it killed, who outlived it, what it reaped and unlinked."""

    killed: list[ProcessId] = field(default_factory=list)
    spared: list[ProcessId] = field(default_factory=list)
    survivors: list[ProcessId] = field(default_factory=list)
    reaped: dict[int, int] = field(default_factory=dict)  # pid -> exit status
    shm_removed: list[str] = field(default_factory=list)
    #: What each frozen process mapped and had open, read before it was killed.
    held: list[leftovers.Holding] = field(default_factory=list)


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
    deadline = clock.monotonic() + budget_s
    kill = _TreeKill(root_pid, set(exclude), include_root, spare_root_helpers, before)
    kill.reader = procfs.ProcReader(deadline=deadline)
    stable_rounds = 0
    try:
        while clock.monotonic() < deadline:
            targets, grew = kill.list_targets()
            kill.freeze(targets)
            if grew and stable_rounds < 20:
                stable_rounds += 1
                continue  # list again: a process may have forked before it was frozen
            kill.kill(targets)
            kill.end_graceful()
            if not targets and not kill.graceful:
                break
            clock.sleep(0.02 if targets else 0.05)
    finally:
        kill.resume_forkers()
    return kill.finish(min(deadline, clock.monotonic() + SETTLE_S))


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
    reader: procfs.ProcReader = field(default_factory=procfs.ProcReader)
    #: processes of the tree that are not the test's (a forkserver an earlier test started) but
    #: forked a target: stopped while the kill runs, so that a Pool's handler thread cannot have
    #: them fork replacements as fast as they are killed (hundreds in 5 s), continued after
    paused: dict[int, ProcessId] = field(default_factory=dict)

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
        cmdline = command_line(proc.pid)
        kind = helper_kind(cmdline, process_name(proc.pid))
        try:
            parent = proc.ppid()
            if kind is not None and command_line(parent) == cmdline:
                kind = None  # a child the helper forked (forkserver), not the helper
        except psutil.Error:
            parent = -1
        if kind is not None and self.spare_root_helpers and parent == self.root_pid:
            self.spared[proc.pid] = ident
            return None
        if kind in TRACKER_GRACE_S and proc.pid != self.root_pid:
            self.graceful[proc.pid] = (ident, clock.monotonic() + TRACKER_GRACE_S[kind])
            return None
        self.seen[proc.pid] = ident
        return ident

    def freeze(self, targets: list[psutil.Process]) -> None:
        """SIGSTOP the new targets, then read what each holds (it can no longer change)."""
        frozen = []
        for proc in targets:
            if proc.pid not in self.stopped and signal_process(self.seen[proc.pid], signal.SIGSTOP):
                self.stopped.add(proc.pid)
                frozen.append(self.seen[proc.pid])
                self._pause_forker(proc)
        if frozen:
            sockets = leftovers.unix_sockets(frozen[0].pid)
            for ident in frozen:
                held = leftovers.read_holding(ident.pid, ident.create_time, self.reader, sockets)
                self.result.held.append(held)

    def _pause_forker(self, proc: psutil.Process) -> None:
        """Stop the parent of ``proc`` while the kill runs when it lives on (a forkserver)."""
        try:
            parent = proc.ppid()
        except psutil.Error:
            return
        spare = {self.root_pid, os.getpid(), 0, 1, *self.excluded, *self.seen, *self.paused}
        if parent in spare or parent in self.graceful:
            return
        try:
            ident = identify([psutil.Process(parent)]).get(parent)
        except psutil.Error:
            return
        if ident is not None and signal_process(ident, signal.SIGSTOP):
            self.paused[parent] = ident

    def resume_forkers(self) -> None:
        for ident in self.paused.values():
            signal_process(ident, signal.SIGCONT)
        self.paused.clear()

    def kill(self, targets: list[psutil.Process]) -> None:
        loader_sigchld.expect_killed(self.seen[proc.pid] for proc in targets)
        for proc in targets:
            ident = self.seen[proc.pid]
            if signal_process(ident, signal.SIGKILL) and ident not in self.result.killed:
                self.result.killed.append(ident)

    def end_graceful(self) -> None:
        """Helpers that had a grace: gone by themselves, spared, or killed once it is over."""
        now = clock.monotonic()
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
            clock.monotonic() < settle_until
        ):
            clock.sleep(0.01)
        result.survivors = alive
        result.reaped = reap(result.killed)
        return result


def remove_leftovers(
    result: KillResult, since: float | None = None, living: list[int] | None = None
) -> list[str]:
    """Remove what the processes ``result`` killed made or held (``leftovers.remove``), the
    segments and temp dir of ``living`` processes (this one, usually) kept; returns what went."""
    keep: list[str] | None = []
    if any(pid != os.getpid() for pid in living or []):
        keep = None  # another live process's multiprocessing temp dir is not known here
    elif (own := leftovers.own_mp_tempdir()) is not None:
        keep = [own]
    living = [*(living or []), *(p.pid for p in result.spared)]
    killed = [p.pid for p in result.killed]
    return leftovers.remove(result.held, killed, since, living, keep)


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
    deadline = clock.monotonic() + timeout_s
    while pending and clock.monotonic() < deadline:
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
            clock.sleep(0.01)
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
    for pid in procfs.children(me):
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                zombies.append(pid)
    reaped = []
    for pid in set(zombies) - (owned_by_objects() if zombies else set()):
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                reaped.append(pid)
    return reaped

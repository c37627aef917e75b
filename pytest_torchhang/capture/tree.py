"""The test's process tree: who is in it (identity, descendants) and who was there before (births).

``births`` runs before and after every guarded test, so this module imports no psutil at load:
the functions that need it import it when called (on the cold path, or with a fixture's
processes to judge).
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import procfs
from .target import Births

if TYPE_CHECKING:
    import psutil


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


def command_line(pid: int) -> list[str]:
    """``pid``'s command line ([] when not read): bounded, unlike psutil's ``cmdline()``, which
    blocks on a process stuck in state D holding its mmap lock."""
    return procfs.ProcReader().cmdline(pid) or []


def process_name(pid: int) -> str:
    """The kernel's name of ``pid`` (not psutil's ``name()``: it reads the cmdline of long names)."""
    stat = procfs.stat(pid)
    return stat.comm if stat is not None else ""


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (``/proc/PID/stat`` field 22), or None."""
    stat = procfs.stat(pid)
    return stat.start_ticks if stat is not None else None


# --- identity (psutil: imported when first called, never by ``births``) ------------------------


def is_zombie(proc: psutil.Process) -> bool:
    import psutil

    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


def same_process(proc: psutil.Process, ident: ProcessId) -> bool:
    """True while ``proc`` still is the process first seen as ``ident`` (not a recycled pid)."""
    import psutil

    try:
        return proc.pid == ident.pid and proc.create_time() == ident.create_time
    except psutil.Error:
        return False


def identify(procs: Iterable[psutil.Process]) -> dict[int, ProcessId]:
    """Identities of ``procs`` that are still there, by pid."""
    import psutil

    out: dict[int, ProcessId] = {}
    for proc in procs:
        try:
            out[proc.pid] = ProcessId(proc.pid, proc.create_time())
        except psutil.Error:
            continue
    return out


def signal_process(ident: ProcessId, sig: int) -> bool:
    """Send ``sig`` to ``ident`` only if that pid still belongs to that process.

    Every signal the plugin sends to a process of the tree goes through here. Where the kernel
    has pidfds (Linux 5.3+), the pid is pinned by a pidfd first, then its identity is checked,
    then the signal goes through the pidfd: a process that exits and has its pid reused between
    the check and the signal cannot get it. Elsewhere, psutil checks identity just before
    ``kill(2)`` (a narrow window remains).
    """
    import psutil

    fd = _pidfd(ident.pid)
    if fd is None:
        return _signal_by_pid(ident, sig)
    try:
        if not same_process(psutil.Process(ident.pid), ident):
            return False
        signal.pidfd_send_signal(fd, sig)
        return True
    except (psutil.Error, OSError):  # ESRCH: it exited after the pidfd was opened
        return False
    finally:
        os.close(fd)


def _pidfd(pid: int) -> int | None:
    """A pidfd for ``pid``; None where the kernel or Python has none, or the pid is gone (the
    fallback then finds it gone too)."""
    if not (hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal")):
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:  # ENOSYS (an old kernel, a sandbox), ESRCH
        return None


def _signal_by_pid(ident: ProcessId, sig: int) -> bool:
    import psutil

    try:
        proc = psutil.Process(ident.pid)
        if not same_process(proc, ident):
            return False
        proc.send_signal(sig)  # psutil re-checks identity before signalling
        return True
    except (psutil.Error, OSError):
        return False


# --- births: the ownership snapshot, per test ----------------------------------------------------


def births(root_pid: int, skip: Iterable[int] = ()) -> Births:
    """(pid, start ticks) of every descendant of ``root_pid`` now: what a test did not start.

    Cheap on the common path (a pytest process without children reads one small file per
    thread, through descriptors kept open), since it runs before and after every guarded test.
    ``skip``: children left out with their trees (the plugin's monitor, which starts nothing).
    """
    leave_out = set(skip)
    children = procfs.child_lister()
    return _births_below((pid for pid in children(root_pid) if pid not in leave_out), children)


def born_before(births: Births, ticks: int) -> Births:
    """Those of ``births`` that started before clock tick ``ticks`` (``clock.boot_ticks``).

    A start time is truncated to its tick: a process that started in the tick ``ticks`` itself
    may have started before or after that moment, and is left out.
    """
    return frozenset(birth for birth in births if birth[1] < ticks)


def births_below(pids: Iterable[int]) -> Births:
    """(pid, start ticks) of ``pids`` and all their descendants, as they are now."""
    return _births_below(pids, procfs.child_lister())


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


# --- descendants: owned and context -------------------------------------------------------------


def _processes(root_pid: int) -> list[psutil.Process]:
    """Live descendants of ``root_pid``, every parent before its children."""
    import psutil

    procs = []
    for pid in procfs.walk([root_pid])[1:]:
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(pid))
    return procs


def _transparent_helpers(procs: list[psutil.Process], root_pid: int) -> set[int]:
    """The root's own multiprocessing helpers (forkserver, resource_tracker): session-wide
    state, neither the test's nor context; what they fork for a test is the test's."""
    import psutil

    out = set()
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if proc.ppid() == root_pid and helper_kind(
                command_line(proc.pid), process_name(proc.pid)
            ):
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
    import psutil

    skip = set(exclude)
    procs = _processes(root_pid)
    if not before:
        return [p for p in procs if p.pid not in skip], []
    transparent = skip | _transparent_helpers(procs, root_pid)
    context: set[int] = set()
    for proc in procs:  # a parent comes before its children
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
